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

from solver.graph import CostGraph
from solver.semantics import evaluate


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
