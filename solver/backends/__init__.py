"""MILP backends behind one small interface (``interface``): CP-SAT (``cpsat``),
the default and the only one that takes the offload layer, and SCIP (``scip``).

A backend module is imported when a search first asks for it, so a process that
never uses SCIP never loads it.
"""

from __future__ import annotations

from optiremat.solver.backends.interface import (
    BackendStatus,
    Goal,
    IncumbentCallback,
    MilpBackend,
    Objective,
    RawResult,
    stop_when_set,
)
from optiremat.solver.formulation import Formulation
from optiremat.solver.solution import Backend

__all__ = ["Goal", "IncumbentCallback", "MilpBackend", "Objective", "RawResult", "BackendStatus",
           "make_backend", "stop_when_set"]


def make_backend(kind: Backend, formulation: Formulation) -> MilpBackend:
    if kind == Backend.CPSAT:
        from optiremat.solver.backends.cpsat import CpSatBackend

        return CpSatBackend(formulation)
    from optiremat.solver.backends.scip import ScipBackend

    return ScipBackend(formulation)
