"""One search: a request's phases, starts, exact pricing and the Solution.

(Over 400 lines on purpose: one request's phases share its clock, backends and cut.)

A solve is lexicographic. Phase 1 minimises the plan's cost within the budget;
phase 2 fixes the cost at that optimum and minimises the bytes the budget caps,
so of all equally cheap plans the answer is the leanest one (with transfers that
overlap compute, ``offload.PlanTime``, a third phase then takes the fewest host
bytes, since a hidden transfer costs no time); ``canonical`` then drops saves
that have no effect. The cost is recompute FLOPs, and the bytes
residual bytes; with offload (the formulation's offload layer,
``optiremat.solver.formulation``) the cost is in FLOP-equivalents, recompute
FLOPs plus transfers priced in FLOPs, and the bytes are those left on the
device, with host bytes capped too. Backends run single-threaded with fixed
seeds and phase 2 is bounded by deterministic work, so the same request gives
the same Solution on every run and host whenever phase 1 finishes inside
``time_limit_s``; a search cut off by the wall clock or by ``cancel`` (status
feasible) returns whatever it had at that moment.

Phase 1 starts from the best of a few plans that fit the budget: a caller's
plan (``solve_from``; a sweep passes the neighbouring budget's), for an untied
solve the tied optimum found in ``TIED_SHARE`` of the time limit and the
plans of the Lagrangian walk (``optiremat.solver.lagrange``), else the greedy knapsack
(``optiremat.solver.baselines``). The backend is hinted with it and cut off at its
FLOPs, so a search stopped early still answers with at least that plan, and an
untied answer is never worse than the tied one. The walk's bound is valid for
every untied plan: it stops the search at the first incumbent it proves within
``relative_gap`` (or skips the search when it proves the start), and it is the
reported bound when it beats the backend's. An offload search starts from no
plan: the walk's bound holds only where every residual counts against the
budget, and plans that offload nothing have never been its starting points.
A model too big for the time left (``MILP_VARIABLES_PER_SECOND``) is not
searched at all. ``direct=True`` skips the starts, the bound and the
reductions: the reference model for tests and benchmarks. Tied solves of graphs
with repeated layers run on the folded graph
(``optiremat.solver.repeats.FoldedSearch``, made by ``search_for``).

Every plan a backend proposes is re-evaluated with ``semantics.evaluate`` and,
with offload, split into device and host bytes (``offload.evaluate_offload``);
reported bytes and FLOPs are those exact integers, never a solver's floats. A
floating-point backend whose plan turns out over budget is asked again with a
tighter cap, and after a few tries CP-SAT, which is exact, takes over. Only
CP-SAT takes the offload layer, so an offload request is always solved by it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import ortools

from optiremat.solver.backends import (
    BackendStatus,
    Goal,
    MilpBackend,
    Objective,
    RawResult,
    make_backend,
)
from optiremat.solver.baselines import compare, greedy_saves
from optiremat.solver.formulation import Formulation, build
from optiremat.solver.graph import CostGraph
from optiremat.solver.lagrange import CutModel, bound_and_plans
from optiremat.solver.offload import (
    TRANSFERS_PER_BYTE,
    OffloadPlan,
    OffloadReport,
    evaluate_offload,
)
from optiremat.solver.repeats import FoldedSearch, compress
from optiremat.solver.semantics import Evaluation, baseline_backward_flops, evaluate
from optiremat.solver.solution import (
    Backend,
    Decision,
    InfeasibleBudgetError,
    ProgressCallback,
    Solution,
    SolveOptions,
    SolveStatus,
)

MAX_TIGHTENINGS = 3  # re-solves of an over-budget floating-point plan before CP-SAT takes over
PHASE2_WORK = 2.0  # phase 2's effort cap, relative to phase 1's
TIED_SHARE = 0.25  # of an untied solve's time limit, spent first on the tied plan it starts from
# CP-SAT's presolve alone took 54 s on the 347k-variable untied model of a
# 100k-node graph (and ignored its time limit meanwhile); a 30k-variable model
# solves in 10 s. Below this rate of variables per second left, no search is
# tried and the answer is the best start with the cut's bound.
MILP_VARIABLES_PER_SECOND = 5_000
FINISH_SHARE = 0.05  # of the time limit, kept for evaluating and reporting the plan
BOUND_EPSILON = 1e-6  # a float bound this close below an integer counts as that integer


def search_for(
    graph: CostGraph,
    options: SolveOptions,
    started: float,
    progress: ProgressCallback | None,
    cancel: threading.Event | None,
) -> Search | FoldedSearch:
    """The search for one request: on the folded graph when a tied plan's repeated
    layers fold exactly (``optiremat.solver.repeats``), else on the graph itself.
    An offload search on a step's graph is not folded: the folded graph has no
    scan regions, whose transfers overlap compute (``offload.PlanTime``)."""
    overlaps = options.offload is not None and any(r >= 0 for r in graph.node_region or ())
    if options.tie and not options.direct and not overlaps:
        folded = compress(graph)
        if folded is not None:
            inner = Search(folded.graph, options, started, progress, cancel)
            return FoldedSearch(graph, folded, inner)
    return Search(graph, options, started, progress, cancel)


@dataclass(frozen=True)
class _Plan:
    """Decisions priced exactly: per formulation decision, saved and offloaded."""

    decisions: tuple[bool, ...]
    offloads: tuple[bool, ...]
    priced: OffloadPlan
    recompute_flops: int
    cost: Fraction  # what phase 1 minimises, in FLOP-equivalents

    @property
    def device_bytes(self) -> int:
        return self.priced.device_bytes

    @property
    def host_bytes(self) -> int:
        return self.priced.host_bytes


class Search:
    """One request: the formulation, the clock, and the backends built so far."""

    def __init__(
        self,
        graph: CostGraph,
        options: SolveOptions,
        started: float,
        progress: ProgressCallback | None,
        cancel: threading.Event | None,
    ) -> None:
        self.graph = graph
        self.options = options
        self.restart_clock(started)
        self.progress = progress
        self.cancel = cancel
        self.f: Formulation = build(graph, options.tie, reduce=not options.direct,
                                    offload=options.offload)
        self.kind = options.backend if self.f.offload is None else Backend.CPSAT
        self.baseline = baseline_backward_flops(graph)
        self._save_all_bytes = evaluate(graph, [True] * graph.num_nodes).residual_bytes
        self._backends: dict[Backend, MilpBackend] = {}
        self._cut_model: CutModel | None = None
        self._cut_bound: int | None = None  # recompute FLOPs no plan within the budget beats
        self._cut_proved = False  # the cut's bound proved a start before any search

    def restart_clock(self, started: float) -> None:
        """Time the next request from ``started`` (a sweep's next budget)."""
        self.started = started
        # The backends stop early enough to leave time for pricing the answer.
        self.deadline = started + self.options.time_limit_s * (1 - FINISH_SHARE)

    # ---- the request ------------------------------------------------------

    def solve(self, budget: int, start: Sequence[bool] | None = None) -> Solution:
        kind = self.kind
        plan: _Plan | None
        self._cut_bound, self._cut_proved = None, False
        start_plan = self._start(budget, start)
        if budget >= self._save_all_bytes and self.f.offload is None:
            # Saving everything fits and runs the fewest nodes: phase 1 is answered.
            # (An offload search runs phase 1 even so: its phase 2 has always
            # started from that search's solution, and a request's answer stays.)
            save_all = self._plan((True,) * self.f.num_decisions)
            fewest = float(self.f.cost.cap(save_all.cost))
            first, plan = RawResult(BackendStatus.OPTIMAL, save_all.decisions, fewest), save_all
        else:
            kind, first, plan = self._cheapest(kind, budget, start_plan)
            if first.outcome == BackendStatus.INFEASIBLE:
                min_budget = self.min_budget()
                if min_budget <= budget:  # a floating-point backend was wrong; ask CP-SAT
                    kind, first, plan = self._cheapest(Backend.CPSAT, budget)
                else:
                    raise InfeasibleBudgetError(budget, min_budget)
        if plan is None:
            return self._solution(budget, kind, SolveStatus.TIMED_OUT, None, Fraction(0))
        if first.outcome == BackendStatus.OPTIMAL and not self._cut_proved:
            # Phase 2 refines a search's answer; a plan the cut's bound proved
            # before any search is answered as the cut found it.
            plan = self._leanest(kind, budget, plan, first.work)
        lower_bound = min(self._lower_bound(first.bound), plan.cost)
        if self.f.offload is not None and first.outcome == BackendStatus.OPTIMAL:
            # The offload solve has always reported a phase 1 proven within
            # ``relative_gap`` as exact (gap 0, the plan's cost as its bound), where
            # the checkpointing solve reports the solver's bound; kept so that its
            # answers stay the same, bit for bit.
            lower_bound = plan.cost
        proven = (first.outcome == BackendStatus.OPTIMAL or lower_bound == plan.cost
                  or self._good_enough(plan.cost))
        status = SolveStatus.OPTIMAL if proven else SolveStatus.FEASIBLE
        return self._solution(budget, kind, status, plan, lower_bound)

    def min_budget(self) -> int:
        """Smallest budgeted bytes over all plans (device bytes with offload), by CP-SAT
        (exact integers)."""
        raw = self._run(Backend.CPSAT, Goal(Objective.BYTES))
        extremes = [(True,) * self.f.num_decisions, (False,) * self.f.num_decisions]
        candidates = [self._plan(d) for d in extremes]
        if raw.decisions is not None:
            candidates.append(self._plan(raw.decisions, raw.offloads))
        return min(p.device_bytes for p in candidates)

    # ---- starting points --------------------------------------------------

    def _start(self, budget: int, start: Sequence[bool] | None) -> _Plan | None:
        """The cheapest plan within the budget for phase 1 to start from, or None
        (an offload search starts from none: see the module docstring)."""
        if self.f.offload is not None:
            return None
        starts = [self._start_plan(budget, start)]
        cancelled = self.cancel is not None and self.cancel.is_set()
        if not self.options.direct and budget < self._save_all_bytes and not cancelled:
            # An untied search starts from the tied optimum and from the cut's
            # plans, whose bound may prove one of them (``optiremat.solver.lagrange``).
            # Without any, the greedy knapsack (over policy keys) gives one in
            # well under a second, so the search always has an incumbent.
            if not self.options.tie:
                starts.append(self._start_plan(budget, self._tied_start(budget)))
                starts.append(self._cut_start(budget))
            if all(p is None for p in starts):
                starts.append(self._start_plan(budget, greedy_saves(self.graph, budget)))
        plans = [p for p in starts if p is not None]
        return min(plans, key=lambda p: (p.cost, p.device_bytes), default=None)

    def _tied_start(self, budget: int) -> list[bool] | None:
        """The tied optimum (within a share of the time limit), as per-node saves.

        Every tied plan is an untied plan too, so starting the untied search
        from it, cut off at its FLOPs, means an untied answer is never worse
        than the tied one even when the untied search is stopped early.
        """
        options = self.options.model_copy(
            update={"tie": True, "time_limit_s": self.options.time_limit_s * TIED_SHARE}
        )
        try:
            search = search_for(self.graph, options, time.monotonic(), None, self.cancel)
            tied = search.solve(budget)
        except InfeasibleBudgetError:
            return None
        if not tied.planned:
            return None
        return tied.saved()

    def _cut_start(self, budget: int) -> _Plan | None:
        """The cheapest plan the Lagrangian walk meets, and its bound kept for later."""
        if self._cut_model is None:
            self._cut_model = CutModel(self.graph)
        found = bound_and_plans(self.graph, budget, self.deadline, self._cut_model)
        self._cut_bound = found.backward_flops - self.baseline
        return None if found.best is None else self._start_plan(budget, found.best.saves)

    def _scaled_cut_bound(self) -> float:
        """The cut's bound in the formulation's scaled cost (0 without one)."""
        if self._cut_bound is None:
            return 0.0
        return float(max(0, self.f.cost.at_least(self._cut_bound)))

    def _search_fits(self) -> bool:
        """Whether a MILP of this size can get anywhere in the time left."""
        remaining = self.deadline - time.monotonic()
        return len(self.f.var_names) <= MILP_VARIABLES_PER_SECOND * remaining

    def _good_enough(self, cost: Fraction) -> bool:
        """The cut's bound proves this cost within the requested relative gap."""
        if self._cut_bound is None:
            return False
        gap = self.options.relative_gap
        return cost - self._cut_bound <= gap * cost

    def _stop_at(self) -> int | None:
        """Scaled cost at which a search may stop: the cut's bound proves it."""
        if self._cut_bound is None or self.options.relative_gap >= 1:
            return None
        target = math.floor(self._cut_bound / (1 - self.options.relative_gap))
        return self.f.cost.cap(target)

    def _start_plan(self, budget: int, start: Sequence[bool] | None) -> _Plan | None:
        if start is None:
            return None
        decisions = tuple(any(start[n] for n in nodes) for nodes in self.f.decision_nodes)
        plan = self._plan(decisions)
        return plan if plan.device_bytes <= budget else None

    # ---- phases -----------------------------------------------------------

    def _cheapest(
        self, kind: Backend, budget: int, start: _Plan | None = None
    ) -> tuple[Backend, RawResult, _Plan | None]:
        """Phase 1, with over-budget floating-point plans tightened and re-solved.

        With a ``start`` plan within budget the search is hinted with it and cut
        off at its cost; if the search finds nothing cheaper, ``start`` is the answer.
        """
        if start is not None and self._good_enough(start.cost):
            self._cut_proved = True
            proven = RawResult(BackendStatus.OPTIMAL, start.decisions, self._scaled_cut_bound())
            return kind, proven, start
        if not self._search_fits():
            # No time for a search this size: answer with the start, bounded by the cut.
            outcome = BackendStatus.FEASIBLE if start is not None else BackendStatus.NO_SOLUTION
            bound = self._scaled_cut_bound()
            decisions = None if start is None else start.decisions
            return kind, RawResult(outcome, decisions, bound), start
        if start is not None and self.progress is not None:
            # The start is an incumbent already: report it, since SCIP (through
            # pywraplp) reports nothing more until it finishes.
            fewest = self._plan((True,) * self.f.num_decisions).cost
            self._report(start.cost, min(fewest, start.cost))
        kind, raw, plan = self._cheapest_search(kind, budget, start)
        if start is None or (plan is not None and plan.cost <= start.cost):
            return kind, raw, plan
        if raw.outcome == BackendStatus.OPTIMAL:  # proven: nothing cheaper than the start fits
            scaled = float(self.f.cost.cap(start.cost))
            return kind, RawResult(BackendStatus.OPTIMAL, start.decisions, scaled, raw.work), start
        return kind, RawResult(BackendStatus.FEASIBLE, start.decisions, raw.bound, raw.work), start

    def _cheapest_search(
        self, kind: Backend, budget: int, start: _Plan | None
    ) -> tuple[Backend, RawResult, _Plan | None]:
        cap = self.f.budgeted_bytes.cap(budget)
        cost_cap = None
        if start is not None:
            self._backend(kind).hint(self.f.assignment(self.graph, start.decisions))
            cost_cap = self.f.cost.cap(start.cost)
        for attempt in range(MAX_TIGHTENINGS + 1):
            if cap < 0:
                raw = RawResult(BackendStatus.INFEASIBLE, None, 0.0)
            else:
                goal = Goal(Objective.COST, bytes_cap=cap, cost_cap=cost_cap)
                raw = self._run(kind, goal, report=True, stop_at=self._stop_at())
            if raw.decisions is None:
                if raw.outcome == BackendStatus.INFEASIBLE and (attempt > 0 or start is not None):
                    break  # infeasible only because we tightened or cut off at the start
                return kind, raw, None
            plan = self._plan(raw.decisions, raw.offloads)
            excess = plan.device_bytes - budget
            if excess <= 0:
                return kind, raw, plan
            cap -= -(-excess // self.f.budgeted_bytes.scale)
        if start is not None:
            # Nothing below the start's cost fits: with an exact backend that proves it.
            exact = kind == Backend.CPSAT and raw.outcome == BackendStatus.INFEASIBLE
            outcome = BackendStatus.OPTIMAL if exact else BackendStatus.FEASIBLE
            return kind, RawResult(outcome, None, raw.bound, raw.work), None
        if kind == Backend.CPSAT:
            raise AssertionError("CP-SAT returned a plan over budget; the formulation is wrong")
        return self._cheapest(Backend.CPSAT, budget)

    def _leanest(self, kind: Backend, budget: int, plan: _Plan, phase1_work: float) -> _Plan:
        """Phase 2: the fewest budgeted bytes among plans with the optimal cost.

        Its effort is capped in deterministic units (at most ``PHASE2_WORK``
        times phase 1's) and only a proven answer replaces phase 1's plan, so
        whether the tie-break happened never depends on the machine's speed.
        """
        goal = Goal(
            Objective.BYTES,
            bytes_cap=self.f.budgeted_bytes.cap(budget),
            cost_cap=self.f.cost.cap(plan.cost),
        )
        lean = self._tie_break(kind, goal, phase1_work)
        if lean is not None:
            better = (lean.cost, lean.device_bytes) <= (plan.cost, plan.device_bytes)
            plan = lean if better and lean.device_bytes <= budget else plan
        if self.f.offload is not None and self.f.offload.integers and plan.host_bytes:
            plan = self._least_host(kind, plan, phase1_work)
        return plan

    def _least_host(self, kind: Backend, plan: _Plan, phase1_work: float) -> _Plan:
        """Phase 3, with overlapped transfers: the fewest host bytes among plans as cheap
        and as lean as ``plan``. A transfer the compute hides costs nothing, so without
        it a plan could offload bytes that lower neither its time nor its peak."""
        goal = Goal(Objective.HOST, bytes_cap=self.f.budgeted_bytes.cap(plan.device_bytes),
                    cost_cap=self.f.cost.cap(plan.cost))
        fewer = self._tie_break(kind, goal, phase1_work)
        if fewer is None:
            return plan
        same = (fewer.cost, fewer.device_bytes) <= (plan.cost, plan.device_bytes)
        return fewer if same and fewer.host_bytes < plan.host_bytes else plan

    def _tie_break(self, kind: Backend, goal: Goal, phase1_work: float) -> _Plan | None:
        """A later phase's plan, when proven within effort capped relative to phase 1's."""
        backend = self._backend(kind)
        raw = self._run(kind, goal, work_limit=max(backend.min_work, PHASE2_WORK * phase1_work))
        if raw.outcome != BackendStatus.OPTIMAL or raw.decisions is None:
            return None
        return self._plan(raw.decisions, raw.offloads)

    # ---- helpers ----------------------------------------------------------

    def _backend(self, kind: Backend) -> MilpBackend:
        if kind not in self._backends:
            self._backends[kind] = make_backend(kind, self.f)
        return self._backends[kind]

    def _run(
        self,
        kind: Backend,
        goal: Goal,
        *,
        report: bool = False,
        work_limit: float | None = None,
        stop_at: int | None = None,
    ) -> RawResult:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0 or (self.cancel is not None and self.cancel.is_set()):
            return RawResult(BackendStatus.NO_SOLUTION, None, 0.0)
        on_incumbent = self._on_incumbent if report and self.progress is not None else None
        return self._backend(kind).minimize(
            goal,
            time_limit_s=remaining,
            relative_gap=self.options.relative_gap,
            work_limit=work_limit,
            on_incumbent=on_incumbent,
            cancel=self.cancel,
            stop_at=stop_at,
        )

    def _on_incumbent(self, objective: float, bound: float) -> None:
        incumbent = self.f.cost.raw(round(objective))
        self._report(incumbent, min(incumbent, self._lower_bound(bound)))

    def _report(self, incumbent: Fraction, lower_bound: Fraction) -> None:
        assert self.progress is not None
        self.progress(math.floor(incumbent), math.floor(lower_bound),
                      time.monotonic() - self.started)

    def _lower_bound(self, solver_bound: float) -> Fraction:
        """The cost no plan beats: a solver's bound on the scaled cost (rounded up to
        the next cost the integers allow, never below 0), or the cut's if higher."""
        bound = self.f.cost.raw(math.ceil(solver_bound - BOUND_EPSILON))
        return max(Fraction(0), bound, Fraction(self._cut_bound or 0))

    def _plan(self, decisions: Sequence[bool], offloads: Sequence[bool] = (),
              evaluation: Evaluation | None = None) -> _Plan:
        """``decisions`` (and ``offloads``, per decision) priced exactly; ``evaluation``
        is that of the decisions' saves when the caller has it."""
        offloads = tuple(offloads) or (False,) * len(decisions)
        offloaded = [False] * self.graph.num_nodes
        if any(offloads):
            for d, nodes in enumerate(self.f.decision_nodes):
                if offloads[d]:
                    for n in nodes:
                        offloaded[n] = True
        saves = self.f.node_saves(self.graph, decisions)
        priced = evaluate_offload(self.graph, saves, offloaded, evaluation)
        recompute = priced.evaluation.backward_flops - self.baseline
        cost = Fraction(recompute) if self.f.offload is None else self.f.offload.time.cost(priced)
        return _Plan(tuple(decisions), offloads, priced, recompute, cost)

    def _solution(
        self,
        budget: int,
        kind: Backend,
        status: SolveStatus,
        plan: _Plan | None,
        lower_bound: Fraction,
    ) -> Solution:
        common: dict[str, Any] = dict(
            graph_hash=self.graph.content_hash,
            budget_bytes=budget,
            options=self.options,
            status=status,
            solver=kind.value,
            solver_version=ortools.__version__,  # type: ignore[attr-defined]
        )
        if plan is None:  # stopped before any plan was found
            return Solution(
                **common,
                residual_bytes=0,
                recompute_flops=0,
                lower_bound_flops=0,
                gap=1.0,
                saved_keys=[],
                node_decisions=[],
                solve_seconds=time.monotonic() - self.started,
            )
        decisions, evaluation = self.f.canonical(self.graph, plan.decisions)
        offloads = [d and o for d, o in zip(decisions, plan.offloads, strict=True)]
        final = self._plan(decisions, offloads, evaluation)
        assert (final.recompute_flops, final.device_bytes, final.host_bytes) == (
            plan.recompute_flops, plan.device_bytes, plan.host_bytes,
        ), "dropping ineffective saves changed the cost"
        chosen = {(key, _decision(saved, off))
                  for key, saved, off in zip(self.f.decision_keys, decisions, offloads, strict=True)
                  if key}
        gap = 0.0 if final.cost == lower_bound else float((final.cost - lower_bound) / final.cost)
        offload = self.options.offload
        return Solution(
            **common,
            residual_bytes=final.device_bytes,
            recompute_flops=final.recompute_flops,
            lower_bound_flops=math.floor(lower_bound),
            gap=gap,
            saved_keys=sorted(key for key, d in chosen if d == Decision.SAVE),
            offloaded_keys=sorted(key for key, d in chosen if d == Decision.OFFLOAD),
            node_decisions=[_decision(saved, off) for saved, off in
                            zip(final.priced.saves, final.priced.offloaded, strict=True)],
            # Offload plans are judged on estimated seconds, which baselines do not
            # report: they are compared on plans without offload only.
            baselines=(compare(self.graph, budget, final.recompute_flops)
                       if self.options.compare_baselines and offload is None else None),
            offload=None if offload is None else OffloadReport(
                host_bytes=final.host_bytes,
                transfer_bytes=TRANSFERS_PER_BYTE * final.host_bytes,
                estimated_seconds=offload.seconds(final.cost),
                lower_bound_seconds=offload.seconds(lower_bound),
            ),
            solve_seconds=time.monotonic() - self.started,
        )


def _decision(saved: bool, offloaded: bool) -> Decision:
    return Decision.OFFLOAD if offloaded else Decision.SAVE if saved else Decision.RECOMPUTE
