"""SCIP through pywraplp: single thread, fixed seeds, explicit tolerances.

SCIP computes in floating point, so its answers are candidates only:
``solver.search`` re-evaluates the decisions exactly and never trusts its sums.
The auxiliary variables could be continuous (the formulation allows it), but
as binaries they let SCIP see that both objectives are integral and propagate
the clauses as clauses: on a 3-layer graph that is 0.15 s against a 60 s
time-out. The offload layer is refused: its cost is exact 64-bit integers,
which SCIP's floating point cannot hold.
"""

from __future__ import annotations

import math
import threading
import time

from ortools.linear_solver import pywraplp

from optiremat.solver.backends.interface import (
    BackendStatus,
    Goal,
    IncumbentCallback,
    Objective,
    RawResult,
    stop_when_set,
)
from optiremat.solver.formulation import Formulation

TOLERANCE = 1e-9  # feasibility and epsilon; sums are small after gcd scaling
DUAL_TOLERANCE = 1e-7  # SCIP's default; tighter asks SoPlex for more than it offers
SCIP_SETTINGS = "\n".join(
    [
        "randomization/randomseedshift = 0",
        "randomization/permutationseed = 0",
        "randomization/lpseed = 0",
        "parallel/maxnthreads = 1",
        "lp/threads = 1",
        f"numerics/feastol = {TOLERANCE}",
        f"numerics/dualfeastol = {DUAL_TOLERANCE}",
        f"numerics/epsilon = {TOLERANCE}",
        # Both objectives are integers at the optimum, so a gap below 1 proves it.
        "limits/absgap = 0.999",
    ]
)


class ScipBackend:
    name = "scip"
    min_work = 1000.0  # branch-and-bound nodes

    def __init__(self, formulation: Formulation) -> None:
        if formulation.offload is not None:
            raise ValueError("SCIP does not solve the offload layer (its cost is exact 64-bit "
                             "integers, beyond SCIP's floating point): solve offload with CP-SAT")
        solver = pywraplp.Solver.CreateSolver("SCIP")
        if solver is None:
            raise RuntimeError("this OR-Tools build has no SCIP")
        self._f = formulation
        self._solver = solver
        x = [solver.BoolVar(name) for name in formulation.var_names]
        inf = solver.infinity()
        for clause in formulation.clauses:
            negatives = sum(1 for _, positive in clause if not positive)
            row = solver.Constraint(1.0 - negatives, inf)
            for v, positive in clause:
                row.SetCoefficient(x[v], 1.0 if positive else -1.0)
        self._sums = {
            Objective.COST: formulation.cost,
            Objective.BYTES: formulation.budgeted_bytes,
        }
        self._caps = {}
        for which, s in self._sums.items():
            row = solver.Constraint(-inf, inf, f"cap[{which}]")
            for v, coef in s.terms:
                row.SetCoefficient(x[v], float(coef))
            self._caps[which] = row
        self._x = x
        self._last: list[float] | None = None

    def hint(self, values: list[int]) -> None:
        self._last = [float(v) for v in values]

    def minimize(
        self,
        goal: Goal,
        *,
        time_limit_s: float,
        relative_gap: float,
        work_limit: float | None = None,
        on_incumbent: IncumbentCallback | None = None,  # pywraplp reports no incumbents
        cancel: threading.Event | None = None,
        stop_at: int | None = None,  # no incumbent callback to stop from
    ) -> RawResult:
        called = time.monotonic()
        solver, x = self._solver, self._x
        inf = solver.infinity()
        for which, cap in ((Objective.BYTES, goal.bytes_cap), (Objective.COST, goal.cost_cap)):
            self._caps[which].SetBounds(-inf, inf if cap is None else cap + 0.5)
        objective = solver.Objective()
        objective.Clear()
        for v, coef in self._sums[goal.objective].terms:
            objective.SetCoefficient(x[v], float(coef))
        objective.SetMinimization()
        if self._last is not None:
            solver.SetHint(x, self._last)

        left = time_limit_s - (time.monotonic() - called)  # the limit covers the setup
        solver.SetTimeLimit(max(1, int(left * 1000)))
        nodes = -1 if work_limit is None else max(1, int(work_limit))
        solver.SetSolverSpecificParametersAsString(
            f"{SCIP_SETTINGS}\nlimits/totalnodes = {nodes}"
        )
        params = pywraplp.MPSolverParameters()
        params.SetDoubleParam(params.RELATIVE_MIP_GAP, relative_gap)
        params.SetDoubleParam(params.PRIMAL_TOLERANCE, TOLERANCE)
        params.SetDoubleParam(params.DUAL_TOLERANCE, DUAL_TOLERANCE)
        with stop_when_set(cancel, solver.InterruptSolve):
            status = solver.Solve(params)

        work = float(solver.nodes())
        if status == pywraplp.Solver.INFEASIBLE:
            return RawResult(BackendStatus.INFEASIBLE, None, 0.0, work)
        bound = objective.BestBound()
        bound = bound if math.isfinite(bound) else 0.0
        if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
            return RawResult(BackendStatus.NO_SOLUTION, None, bound, work)
        self._last = [var.solution_value() for var in x]
        decisions = tuple(value > 0.5 for value in self._last[: self._f.num_decisions])
        optimal = status == pywraplp.Solver.OPTIMAL
        outcome = BackendStatus.OPTIMAL if optimal else BackendStatus.FEASIBLE
        return RawResult(outcome, decisions, bound, work)
