"""The offload solve: save on device, offload to host, or recompute, by CP-SAT.

It reuses the checkpointing formulation (``formulation.build``): offloading
changes where a residual lives, not which values are needed (``optiremat.solver.offload``),
so the needed/active/residual clauses stay as they are. Added per decision is
``offload[d] -> save[d]``, and per residual ``host[v] = residual[v] and
offload[d]`` (two clauses, exact), so device bytes are the residual bytes less
the host ones. Caps: device bytes <= budget, host bytes <= host budget. The
objective is integer FLOP-equivalents, ``bandwidth * flops + 2 * flop_rate *
host_bytes`` over their gcd, which CP-SAT solves exactly; reported figures come
from ``semantics.evaluate``.

The formulation is built without its dominance reductions: the zero-FLOP chain
rule moves a residual onto its producer's output, which may be an input that
cannot be offloaded, so it is not sound once host bytes are free of the budget.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from fractions import Fraction
from typing import Any, Literal

import ortools
from ortools.sat.python import cp_model

from optiremat.solver.backends import stop_when_set
from optiremat.solver.backends.cpsat import CpSatBackend, Incumbents, set_search_parameters
from optiremat.solver.formulation import Formulation, build
from optiremat.solver.graph import CostGraph
from optiremat.solver.offload import (
    TRANSFERS_PER_BYTE,
    OffloadOptions,
    OffloadPlan,
    OffloadReport,
    evaluate_offload,
)
from optiremat.solver.search import PHASE2_WORK
from optiremat.solver.semantics import baseline_backward_flops
from optiremat.solver.solution import InfeasibleBudgetError, Solution, SolveOptions, SolveStatus

INT64_SAFE = 2**62  # CP-SAT rejects linear expressions whose extremes may overflow int64

# progress(incumbent, bound, elapsed_s), in FLOP-equivalents.
Progress = Callable[[int, int, float], None]


def _gcd_scaled(coefs: list[int]) -> tuple[list[int], int]:
    g = math.gcd(*coefs) if coefs else 1
    g = g or 1
    return [c // g for c in coefs], g


def _check_fits(what: str, coefs: list[int]) -> None:
    if sum(abs(c) for c in coefs) >= INT64_SAFE:
        raise ValueError(
            f"the offload {what} does not fit 64-bit integers: choose host_bandwidth and "
            "device_flop_rate with a larger common divisor (round numbers, e.g. 25e9 and 4e14)")


class _Model:
    """The CP-SAT model of one offload request."""

    def __init__(self, graph: CostGraph, f: Formulation, offload: OffloadOptions) -> None:
        m = cp_model.CpModel()
        x = [m.new_bool_var(name) for name in f.var_names]
        for clause in f.clauses:
            m.add_bool_or([x[v] if pos else ~x[v] for v, pos in clause])
        decision_of = {n: d for d, nodes in enumerate(f.decision_nodes) for n in nodes}
        residual_of = dict(f.residual_vars)  # residual variable -> value position
        off: dict[int, cp_model.IntVar] = {}
        host: dict[int, cp_model.IntVar] = {}  # residual variable -> its host copy
        for var, v in f.residual_vars:
            p = graph.producer[v]
            assert p is not None, "a residual variable stands for a free node's output"
            d = decision_of[p]
            if d not in off:
                off[d] = m.new_bool_var(f"offload[{f.var_names[d]}]")
                m.add_implication(off[d], x[d])
            h = m.new_bool_var(f"host[{f.var_names[var]}]")
            m.add_bool_or([~x[var], ~off[d], h])
            m.add_bool_and([x[var], off[d]]).only_enforce_if(h)
            host[var] = h

        raw = f.residual_bytes.scale
        dev_vars, dev_coefs = [], []
        for var, coef in f.residual_bytes.terms:
            dev_vars.append(x[var])
            dev_coefs.append(coef * raw)
            if var in host:
                dev_vars.append(host[var])
                dev_coefs.append(-coef * raw)
        host_vars = list(host.values())
        host_coefs = [graph.value_bytes[residual_of[var]] for var in host]

        # Objective: bandwidth * flops + 2 * flop_rate * host bytes, exactly, over the gcd.
        rate = offload.flops_per_transfer_byte * TRANSFERS_PER_BYTE
        flop_scale = f.recompute_flops.scale
        obj_vars = [x[var] for var, _ in f.recompute_flops.terms] + host_vars
        obj_coefs = ([c * flop_scale * rate.denominator for _, c in f.recompute_flops.terms]
                     + [b * rate.numerator for b in host_coefs])
        obj_coefs, obj_scale = _gcd_scaled(obj_coefs)
        _check_fits("objective", obj_coefs)
        dev_coefs, self.dev_scale = _gcd_scaled(dev_coefs)
        host_coefs, self.host_scale = _gcd_scaled(host_coefs)

        self.model, self.x, self.off = m, x, off
        self.variables = [*x, *off.values(), *host.values()]  # for hints
        self.device = cp_model.LinearExpr.weighted_sum(dev_vars, dev_coefs)
        self.host = cp_model.LinearExpr.weighted_sum(host_vars, host_coefs)
        self.objective = cp_model.LinearExpr.weighted_sum(obj_vars, obj_coefs)
        self.dev_offset = f.residual_bytes.offset
        # FLOP-equivalents of an objective value: offset + value * obj_scale / denominator.
        self.obj_unit = Fraction(obj_scale, rate.denominator)
        self.host_budget = offload.host_budget_bytes

    def cap_device(self, budget: int) -> None:
        self.model.add(self.device <= (budget - self.dev_offset) // self.dev_scale)

    def cap_host(self) -> None:
        self.model.add(self.host <= self.host_budget // self.host_scale)


class _OffloadSearch:
    def __init__(self, graph: CostGraph, options: SolveOptions, started: float,
                 progress: Progress | None, cancel: threading.Event | None) -> None:
        assert options.offload is not None
        self.graph, self.options, self.offload = graph, options, options.offload
        self.started, self.progress, self.cancel = started, progress, cancel
        self.f = build(graph, options.tie, reduce=False)
        self.baseline = baseline_backward_flops(graph)
        self.flops_offset = self.f.recompute_flops.offset

    def _run(self, model: _Model, minimize: cp_model.LinearExpr, report: bool,
             work_limit: float | None = None) -> tuple[cp_model.CpSolver, Any]:
        model.model.minimize(minimize)
        solver = cp_model.CpSolver()
        time_left = max(1e-3, self.started + self.options.time_limit_s - time.monotonic())
        set_search_parameters(solver, time_left, self.options.relative_gap, work_limit)
        callback = None
        if report and self.progress is not None:
            callback = Incumbents(lambda objective, bound: self._report(model, objective, bound))
        if self.cancel is not None and self.cancel.is_set():
            return solver, cp_model.UNKNOWN
        with stop_when_set(self.cancel, solver.stop_search):
            status = solver.solve(model.model, callback)
        if status == cp_model.MODEL_INVALID:
            raise RuntimeError(f"CP-SAT rejected the offload model: {model.model.validate()}")
        return solver, status

    def _report(self, model: _Model, objective: float, bound: float) -> None:
        assert self.progress is not None
        incumbent = self._cost(model, round(objective))
        lower = min(incumbent, self._cost(model, math.ceil(bound - 1e-6)))
        self.progress(math.floor(incumbent), math.floor(lower), time.monotonic() - self.started)

    def _cost(self, model: _Model, scaled: int) -> Fraction:
        return self.flops_offset + scaled * model.obj_unit

    def min_device_budget(self) -> int:
        """Smallest device residual bytes of any plan within the host budget."""
        model = _Model(self.graph, self.f, self.offload)
        model.cap_host()
        solver, status = self._run(model, model.device, report=False)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            raise RuntimeError("no plan found for the smallest device budget within the time limit")
        return self._plan(solver, model).device_bytes

    def solve(self, budget: int) -> Solution:
        model = _Model(self.graph, self.f, self.offload)
        model.cap_device(budget)
        model.cap_host()
        solver, status = self._run(model, model.objective, report=True)
        if status == cp_model.INFEASIBLE:
            raise InfeasibleBudgetError(budget, self.min_device_budget())
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return self._solution(budget, SolveStatus.TIMED_OUT, None, Fraction(0))
        plan = self._plan(solver, model)
        if status == cp_model.OPTIMAL:
            plan = self._leanest(model, solver, plan)
        cost = self.offload.cost_flops(self._recompute(plan), plan.host_bytes)
        bound = min(cost, self._cost(model, math.ceil(solver.best_objective_bound - 1e-6)))
        proven = status == cp_model.OPTIMAL or bound == cost
        status_ = SolveStatus.OPTIMAL if proven else SolveStatus.FEASIBLE
        return self._solution(budget, status_, plan, cost if proven else bound)

    def _leanest(self, model: _Model, first: cp_model.CpSolver, plan: OffloadPlan) -> OffloadPlan:
        """Phase 2, as in ``solver.search``: of the cheapest plans, the fewest device bytes.

        Bounded by deterministic work and used only when proven, so whether it
        happened never depends on the machine's speed.
        """
        values = [first.boolean_value(v) for v in model.variables]
        model.model.add(model.objective <= round(first.objective_value))
        model.model.clear_hints()
        for var, value in zip(model.variables, values, strict=True):
            model.model.add_hint(var, value)
        work = max(CpSatBackend.min_work, PHASE2_WORK * first.deterministic_time)
        solver, status = self._run(model, model.device, report=False, work_limit=work)
        if status != cp_model.OPTIMAL:
            return plan
        lean = self._plan(solver, model)
        old = self.offload.cost_flops(self._recompute(plan), plan.host_bytes)
        new = self.offload.cost_flops(self._recompute(lean), lean.host_bytes)
        return lean if (new, lean.device_bytes) <= (old, plan.device_bytes) else plan

    def _recompute(self, plan: OffloadPlan) -> int:
        return plan.evaluation.backward_flops - self.baseline

    def _plan(self, solver: cp_model.CpSolver, model: _Model) -> OffloadPlan:
        """The solver's answer, canonical (saves with no effect dropped) and re-evaluated."""
        f, g = self.f, self.graph
        decisions = [solver.boolean_value(model.x[d]) for d in range(f.num_decisions)]
        decisions, _ = f.canonical(g, decisions)
        offloaded = [False] * g.num_nodes
        for d, nodes in enumerate(f.decision_nodes):
            if decisions[d] and d in model.off and solver.boolean_value(model.off[d]):
                for n in nodes:
                    offloaded[n] = True
        plan = evaluate_offload(g, f.node_saves(g, decisions), offloaded)
        assert plan.host_bytes <= self.offload.host_budget_bytes, "host bytes over budget"
        return plan

    def _solution(self, budget: int, status: SolveStatus, plan: OffloadPlan | None,
                  bound: Fraction) -> Solution:
        common = dict(graph_hash=self.graph.content_hash, budget_bytes=budget,
                      options=self.options, status=status, solver="cpsat",
                      solver_version=ortools.__version__)
        if plan is None:
            return Solution(**common, residual_bytes=0, recompute_flops=0, lower_bound_flops=0,
                            gap=1.0, saved_keys=[], node_decisions=[],
                            solve_seconds=time.monotonic() - self.started)
        assert plan.device_bytes <= budget, "device bytes over budget"
        recompute = self._recompute(plan)
        cost = self.offload.cost_flops(recompute, plan.host_bytes)
        decisions: list[Literal["save", "offload", "recompute"]] = [
            "offload" if o else "save" if s else "recompute"
            for s, o in zip(plan.saves, plan.offloaded, strict=True)]
        chosen = {(key, decisions[nodes[0]])
                  for key, nodes in zip(self.f.decision_keys, self.f.decision_nodes, strict=True)
                  if key}
        return Solution(
            **common,
            residual_bytes=plan.device_bytes,
            recompute_flops=recompute,
            lower_bound_flops=math.floor(bound),
            gap=float((cost - bound) / cost) if cost > 0 else 0.0,
            saved_keys=sorted(key for key, d in chosen if d == "save"),
            offloaded_keys=sorted(key for key, d in chosen if d == "offload"),
            node_decisions=decisions,
            offload=OffloadReport(
                host_bytes=plan.host_bytes,
                transfer_bytes=TRANSFERS_PER_BYTE * plan.host_bytes,
                estimated_seconds=self.offload.seconds(cost),
                lower_bound_seconds=self.offload.seconds(bound),
            ),
            solve_seconds=time.monotonic() - self.started,
        )


def solve_offload(graph: CostGraph, budget_bytes: int, options: SolveOptions, *,
                  progress: Progress | None = None, cancel: threading.Event | None = None,
                  started: float | None = None) -> Solution:
    """The plan with the fewest estimated seconds whose device residuals fit ``budget_bytes``
    and whose host residuals fit ``options.offload.host_budget_bytes``.

    Raises InfeasibleBudgetError, naming the smallest feasible device budget, when none fits.
    """
    started = time.monotonic() if started is None else started
    return _OffloadSearch(graph, options, started, progress, cancel).solve(budget_bytes)
