"""Peak plans: a budget that is the peak of the compiled training step.

The room of the peak model, in the order one ``optimize(..., memory="peak")``
call goes through it (``planner.plan_peak``):

* ``placement``: the regions, one per differentiated ``lax.scan``, and the
  function rebuilt with a checkpoint per iteration inside each;
* ``step_graph``: the step's cost graph, walked with those regions in place,
  and what the step holds (``client.step``: arguments, gradients, XLA's figures);
* ``calibration``: each phase's working set, from the compiles of the step
  under one policy;
* the solve: ``solver.peak`` prices every phase of the step, ``solver.nesting``
  adds nested groups of layers (``solver.solve``, local or a server's);
* ``refine``: the plan fitted to the step compiled with it applied, and to
  JAX's built-ins and the user's names as measured;
* ``planner``: the above in order, answered as a ``client.plan.PeakPlan``.
"""
