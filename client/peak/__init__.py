"""Peak plans: a budget that is the peak of the compiled training step.

The room of the peak model, in the order one ``optimize(..., memory="peak")``
call goes through it (``planner.plan_peak``):

* ``regions``: what a region is, one protocol (how it is placed, calibrated and
  summarised on the wire), and its kinds: ``scan_region`` (a differentiated
  ``lax.scan``'s body, per iteration) and ``block_region`` (straight-line code,
  once);
* ``finding``: where they are (scans, the user's checkpoints, repeated blocks
  by ``repeats``, or named scopes), and why a function has none;
* ``placement``: the function rebuilt with each region checkpointed;
* ``step_graph``: the step's cost graph, walked with those regions in place,
  and what the step holds (``client.step``: arguments, gradients, XLA's figures);
* ``calibration``: each phase's working set, from the compiles of the step
  under one policy;
* the solve: ``solver.peak`` prices every phase of the step, ``solver.nesting``
  adds nested groups of layers (``solver.solve``, local or a server's);
* ``priced``: with ``save_price``, the budget whose plan has the least recompute
  FLOPs plus the price of its saved bytes (the solver's plans at a grid of budgets);
* ``measures``: a plan's peak measured (the whole step compiled with it, or one
  layer per region);
* ``refine``: the plan fitted to its measured peak, and to JAX's built-ins and
  the user's names as measured; the smallest budget it plans;
* ``apart``: after refinement, the layers planned apart where one policy leaves
  room: ``mixing``, a scan's layers in groups taking different plans' saves
  (``layer_groups`` runs the groups), or ``block_mixing``, a run of repeated blocks'
  last blocks taking a heavier plan's, each where that fits as measured; with
  offload, ``offload_fit`` fits the plan to its measured device peak instead;
* ``planner``: the above in order, answered as a ``client.plan.PeakPlan``.
"""
