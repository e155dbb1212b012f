"""optiremat.solver: the cost-graph schema and the MILP that plans checkpointing.

Pure pydantic + OR-Tools; never imports JAX.
"""

from solver.graph import SCHEMA_VERSION, CostGraph, GraphBuilder, GraphError, NodeMode
from solver.semantics import Evaluation, evaluate, recompute_flops

__all__ = [
    "SCHEMA_VERSION",
    "CostGraph",
    "Evaluation",
    "GraphBuilder",
    "GraphError",
    "NodeMode",
    "evaluate",
    "recompute_flops",
]
