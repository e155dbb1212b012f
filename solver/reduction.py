"""What no plan can change, so the MILP need not model it.

The needed/active fixpoint of ``semantics.evaluate`` grows monotonically with
the set of recomputed nodes: recomputing one more node only adds reads. So
every plan's needed values and active nodes lie between two extremes,

* ``always_*``: the plan that saves every free node (the fewest reads), and
* ``maybe_*``: the plan that recomputes every free node (the most reads).

Values outside ``maybe_needed`` are never needed and nodes outside
``maybe_active`` never run in the backward pass, whatever the decisions; the
things inside ``always_*`` are needed or active in every plan. Both facts hold
for every decision vector, so fixing them keeps the optimum exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from optiremat.solver.graph import CostGraph, NodeMode
from optiremat.solver.semantics import evaluate


@dataclass(frozen=True)
class Bounds:
    always_needed: frozenset[int]  # value positions
    maybe_needed: frozenset[int]
    always_active: frozenset[int]  # node positions
    maybe_active: frozenset[int]


def bounds(graph: CostGraph) -> Bounds:
    """The two extreme plans, evaluated by the one definition of the semantics."""
    fewest = evaluate(graph, [True] * graph.num_nodes)
    most = evaluate(graph, [False] * graph.num_nodes)
    return Bounds(
        always_needed=frozenset(fewest.needed),
        maybe_needed=frozenset(most.needed),
        always_active=frozenset(fewest.active),
        maybe_active=frozenset(most.active),
    )


def dominated_choices(graph: CostGraph, b: Bounds, tie: bool) -> dict[int, bool]:
    """Free nodes whose other choice is dominated: node position -> the choice to keep.

    Each rule turns any plan into one that is no worse in both FLOPs and bytes
    and makes the rule's choice; so fixing all of them keeps an optimal plan.

    * **save, free of bytes**: every output some plan needs has 0 bytes. Saving
      adds no residual bytes and only removes reads (the fixpoint is monotone).
    * **recompute, free of FLOPs**: 0 FLOPs and every input is needed by every
      plan. Running it again reads nothing new, and its outputs leave the
      residuals.
    * **zero-FLOP chains**: 0 FLOPs, one input ``v`` (no loop carry) and one
      output ``w`` with ``bytes(v) <= bytes(w)`` (a reshape, a transpose), and
      ``v`` is an input, a forced save's only output or the only output of a
      per-node decision. A plan that saves it keeps ``w`` (when needed) where
      saving ``v``'s producer instead and recomputing the node keeps the no
      larger ``v`` and runs nothing more. Applied consumers-first (reverse
      topological order) these rewrites never undo each other, so a chain of
      such nodes collapses onto its head.

    With ``tie`` a keyed node's decision is shared by its whole key, so the
    chain rule, which also changes the producer's decision, applies only to
    nodes that decide alone (no key) with producers that decide alone.
    """
    modes, keys, flops = graph.node_mode, graph.node_key, graph.node_flops
    outs, ins, producer = graph.node_outputs, graph.node_inputs, graph.producer
    nbytes = graph.value_bytes
    carried = {graph.value_index[v] for v in graph.carry_in}

    def alone(n: int) -> bool:
        return not tie or not keys[n]

    fixed: dict[int, bool] = {}
    for n in range(graph.num_nodes):
        if modes[n] != NodeMode.FREE:
            continue
        maybe_outs = [v for v in outs[n] if v in b.maybe_needed]
        if not maybe_outs:
            continue
        if all(nbytes[v] == 0 for v in maybe_outs):
            fixed[n] = True
        elif flops[n] == 0 and all(v in b.always_needed for v in ins[n]):
            fixed[n] = False
        elif flops[n] == 0 and alone(n) and len(ins[n]) == 1 and len(outs[n]) == 1:
            (v,), (w,) = ins[n], outs[n]
            p = producer[v]
            settable = p is None or (
                len(outs[p]) == 1
                and (modes[p] == NodeMode.SAVE or (modes[p] == NodeMode.FREE and alone(p)))
            )
            if v not in carried and nbytes[v] <= nbytes[w] and settable:
                fixed[n] = False
    return fixed
