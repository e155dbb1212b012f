"""optiremat.solver: the cost-graph schema and the MILP that plans checkpointing.

Pure pydantic + OR-Tools; never imports JAX. OR-Tools is imported at the first
search (``solve``), not with the package: a client planning through a server
(``RematClient``) needs none.
"""

from optiremat.solver.errors import OptirematError
from optiremat.solver.graph import SCHEMA_VERSION, CostGraph, GraphBuilder, GraphError, NodeMode
from optiremat.solver.offload import OffloadOptions
from optiremat.solver.semantics import (
    Evaluation,
    baseline_backward_flops,
    evaluate,
    recompute_flops,
)
from optiremat.solver.solution import (
    Backend,
    Decision,
    InfeasibleBudgetError,
    Solution,
    SolveOptions,
    SolveStatus,
)
from optiremat.solver.solve import ProgressCallback, max_useful_budget, min_feasible_budget, solve

__all__ = [
    "SCHEMA_VERSION",
    "Backend",
    "CostGraph",
    "Decision",
    "Evaluation",
    "GraphBuilder",
    "GraphError",
    "InfeasibleBudgetError",
    "NodeMode",
    "OffloadOptions",
    "OptirematError",
    "ProgressCallback",
    "Solution",
    "SolveOptions",
    "SolveStatus",
    "baseline_backward_flops",
    "evaluate",
    "max_useful_budget",
    "min_feasible_budget",
    "recompute_flops",
    "solve",
]
