"""CP-SAT: integer-exact, deterministic with one worker and a fixed seed.

The one backend that takes a formulation's offload layer: its cost is exact
64-bit integers. Which of several equally good plans CP-SAT returns depends on
how the model is posed, and answers are cached by request, so each model keeps
the form it was first solved in (measured on 690 offload requests: capping its
sums the checkpointing model's way changed 46 answers, skipping hint repair 2):

* checkpointing: both sums always capped (at their largest value when a phase
  leaves one open), the caps moved between phases, hints not repaired;
* offload: each phase caps only the sums it bounds, plus host bytes, on a copy
  of the model, and phase 2's hint (phase 1's solution) is repaired as CP-SAT
  does by default.
"""

from __future__ import annotations

import threading
import time

from ortools.sat.python import cp_model

from optiremat.solver.backends.interface import (
    BackendStatus,
    Goal,
    IncumbentCallback,
    Objective,
    RawResult,
    stop_when_set,
)
from optiremat.solver.formulation import Formulation, ScaledSum

SEED = 0


def set_search_parameters(solver: cp_model.CpSolver, time_limit_s: float, relative_gap: float,
                          work_limit: float | None) -> None:
    """What every CP-SAT search of the project runs with."""
    params = solver.parameters
    params.num_workers = 1  # one worker and a fixed seed: the same answer on every run and host
    params.random_seed = SEED
    params.log_search_progress = False
    params.max_time_in_seconds = time_limit_s
    params.relative_gap_limit = relative_gap
    if work_limit is not None:
        params.max_deterministic_time = work_limit
    # The LP over all constraints gives the bound that closes these models;
    # the default level leaves the clauses out of it.
    params.linearization_level = 2
    # Symmetry detection never changed the search on these models (same
    # deterministic time with and without), and on a 10k-node tied graph its
    # presolve ran a minute past max_time_in_seconds.
    params.symmetry_level = 0


class Incumbents(cp_model.CpSolverSolutionCallback):
    """Reports each new solution's (objective, bound); stops at ``stop_at`` if given."""

    def __init__(self, report: IncumbentCallback | None, stop_at: int | None = None) -> None:
        super().__init__()
        self._report = report
        self._stop_at = stop_at

    def on_solution_callback(self) -> None:
        if self._report is not None:
            self._report(self.objective_value, self.best_objective_bound)
        if self._stop_at is not None and self.objective_value <= self._stop_at:
            self.stop_search()


class CpSatBackend:
    name = "cpsat"
    min_work = 2.0  # deterministic seconds

    def __init__(self, formulation: Formulation) -> None:
        self._f = formulation
        model = cp_model.CpModel()
        integers = dict(formulation.offload.integers) if formulation.offload else {}
        x: list[cp_model.IntVar] = [
            model.new_int_var(0, integers[v], name) if v in integers else model.new_bool_var(name)
            for v, name in enumerate(formulation.var_names)]
        for clause in formulation.clauses:
            model.add_bool_or([x[v] if positive else ~x[v] for v, positive in clause])
        for row in formulation.offload.at_least if formulation.offload else ():
            terms = cp_model.LinearExpr.weighted_sum([x[v] for v, _ in row.terms],
                                                     [c for _, c in row.terms])
            model.add(x[row.var] >= terms + row.constant)
        self._sums = {
            Objective.COST: formulation.cost,
            Objective.BYTES: formulation.budgeted_bytes,
        }
        self._exprs = {which: _weighted(x, s) for which, s in self._sums.items()}
        self._caps: dict[Objective, cp_model.Constraint] = {}
        self._host: cp_model.LinearExprT | None = None
        if formulation.offload is None:
            self._caps = {
                which: model.add_linear_constraint(self._exprs[which], 0, s.max_scaled).with_name(
                    f"cap[{which}]"
                )
                for which, s in self._sums.items()
            }
        else:
            self._host = _weighted(x, formulation.offload.host_bytes)
            self._exprs[Objective.HOST] = self._host
        self._model = model
        self._x = x
        self._last: list[int] | None = None  # previous phase's solution, for the hint

    def hint(self, values: list[int]) -> None:
        self._last = list(values)

    def minimize(
        self,
        goal: Goal,
        *,
        time_limit_s: float,
        relative_gap: float,
        work_limit: float | None = None,
        on_incumbent: IncumbentCallback | None = None,
        cancel: threading.Event | None = None,
        stop_at: int | None = None,
    ) -> RawResult:
        called = time.monotonic()  # the time limit covers setting the model up too
        model = self._posed(goal)
        model.clear_hints()  # type: ignore[no-untyped-call]
        if self._last is not None:
            for var, value in zip(self._x, self._last, strict=True):
                model.add_hint(var, int(value))

        solver = cp_model.CpSolver()
        time_left = max(0.0, time_limit_s - (time.monotonic() - called))
        set_search_parameters(solver, time_left, relative_gap, work_limit)
        if self._f.offload is None:
            # The hint is a complete plan that the objective cut-off already keeps as
            # the answer to beat; repairing it first ("hint search") spent a third of
            # a 10 s untied solve on the 96-layer stack for a 0.1% better start, and
            # left a 6.6% gap where the plain search proves the optimum.
            solver.parameters.hint_conflict_limit = 0
        wanted = on_incumbent is not None or stop_at is not None
        callback = Incumbents(on_incumbent, stop_at) if wanted else None
        with stop_when_set(cancel, solver.stop_search):
            status = solver.solve(model, callback)

        if status == cp_model.MODEL_INVALID:
            raise RuntimeError(f"CP-SAT rejected the model: {model.validate()}")
        work = solver.deterministic_time
        if status == cp_model.INFEASIBLE:
            return RawResult(BackendStatus.INFEASIBLE, None, 0.0, work)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return RawResult(BackendStatus.NO_SOLUTION, None, solver.best_objective_bound, work)
        self._last = list(solver.response_proto.solution)
        decisions = tuple(bool(v) for v in self._last[: self._f.num_decisions])
        outcome = BackendStatus.OPTIMAL if status == cp_model.OPTIMAL else BackendStatus.FEASIBLE
        return RawResult(outcome, decisions, solver.best_objective_bound, work,
                         self._f.offloads(self._last))

    def _posed(self, goal: Goal) -> cp_model.CpModel:
        """The model with ``goal``'s caps and objective (see the module docstring)."""
        caps = {Objective.BYTES: goal.bytes_cap, Objective.COST: goal.cost_cap}
        if self._host is None:
            model = self._model
            for which, cap in caps.items():
                domain = self._caps[which].proto.linear.domain
                domain[1] = self._sums[which].max_scaled if cap is None else cap
            model.clear_objective()  # type: ignore[no-untyped-call]
        else:
            assert self._f.offload is not None
            model = self._model.clone()
            if goal.bytes_cap is not None:
                model.add(self._exprs[Objective.BYTES] <= goal.bytes_cap)
            model.add(self._host <= self._f.offload.host_cap)
            if goal.cost_cap is not None:
                model.add(self._exprs[Objective.COST] <= goal.cost_cap)
        model.minimize(self._exprs[goal.objective])
        return model


def _weighted(x: list[cp_model.IntVar], s: ScaledSum) -> cp_model.LinearExprT:
    return cp_model.LinearExpr.weighted_sum([x[v] for v, _ in s.terms], [c for _, c in s.terms])
