"""A peak plan fitted to its own working set.

The peak model (``optiremat.solver.peak``) is exact about what the step holds
and what its forward pass stacks; the backward pass's working set is the one
figure it takes from a measurement, and the solver takes it from one compile
of one layer under ``nothing_saveable`` (``client.calibration``). The working
set moves with the plan, though: on the 4-layer f32 Llama of the scan corpus it
is 30.4 MiB under ``nothing_saveable`` and 22.2 to 27.7 MiB under the plans
along its frontier, so predictions ran up to 21% high; on the CNN and the MLP
some plans hold 2 MiB more than ``nothing_saveable`` and ran over their
budgets (bench/peak.py).

So a plan is refined against its own working set: one more compile of one
layer under the plan's policy measures it (``working_bytes(region, keys)``),
the prediction is corrected by the difference, and while the plan does not fit,
or the budget has room the assumed working set took, the budget is solved again
shifted by that difference. Then each of JAX's built-in policies that fits
with its own working set and recomputes less than the answer is tried: solved
at the shift that lets it fit, and taken itself where the solver's plans there
hold more than it does, so that a plan is never worse than the built-ins as
XLA measures them. Each round is one solve and at most one compile of one
layer per region (measurements are remembered), never a compile per candidate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from optiremat.client.calibration import working_bytes
from optiremat.client.placement import Region
from optiremat.solver.baselines import policy_saves
from optiremat.solver.graph import CostGraph, NodeMode
from optiremat.solver.peak import BudgetView, priced_extra_bytes
from optiremat.solver.semantics import recompute_flops
from optiremat.solver.solution import InfeasibleBudgetError, Solution, SolveOptions, SolveStatus
from optiremat.solver.solve import solve

# Solves following the working set's shift: it settles in one or two on the corpus.
MAX_ROUNDS = 4
# Solves tightening past a built-in's shift when the solver's plan there holds more.
MAX_TIGHTENINGS = 3

SolveAt = Callable[[int], Solution]


def plan_working_bytes(regions: Sequence[Region], saved_keys: frozenset[str]) -> int:
    """The step's backward working set under the plan saving ``saved_keys`` in every
    region: the largest region's, since the backward pass runs one region at a time."""
    return max((working_bytes(r, saved_keys) for r in regions), default=0)


def working_set_delta(graph: CostGraph, regions: Sequence[Region], saves: Sequence[bool],
                      keys: frozenset[str], groups: Sequence[int] | None = None) -> int:
    """What the peak of the plan saving ``saves`` (the policy keys ``keys``) is beyond
    the solver's price: its own working set for the assumed one, and, where the graph
    prices XLA's f32 copies of stacked half-float residuals (``value_extra_bytes``,
    fitted on CPU), the copies its working set measured instead."""
    assert graph.step is not None
    priced_extra = priced_extra_bytes(graph, saves, groups)
    return plan_working_bytes(regions, keys) - graph.step.working_bytes - priced_extra


def refined_solve(graph: CostGraph, regions: Sequence[Region], budget: int,
                  solve_at: SolveAt) -> Solution:
    """The plan for ``budget`` whose peak, with its own working set measured, fits.

    ``solve_at(b)`` solves ``graph`` (a step's) at budget ``b``, which assumes the
    step's calibrated working set. Raises InfeasibleBudgetError when no plan fits, as
    the solver does.
    """
    return _Refinement(graph, regions, budget, solve_at).run()


class _Refinement:
    def __init__(self, graph: CostGraph, regions: Sequence[Region], budget: int,
                 solve_at: SolveAt) -> None:
        assert graph.step is not None
        self.graph, self.regions, self.budget, self.solve_at = graph, regions, budget, solve_at
        self.assumed = graph.step.working_bytes
        self.best: Solution | None = None
        self.tried: set[int] = set()
        self.options: SolveOptions | None = None  # as the solver echoed the request
        self.unplanned: Solution | None = None  # an answer without a plan (time limit, cancel)

    def run(self) -> Solution:
        # Infeasible here is the solver's answer to keep: its smallest plan is
        # nothing_saveable in every layer, whose working set is the one assumed.
        first = self._attempt(0)
        if first is None:
            assert self.unplanned is not None
            return self.unplanned  # stopped before a plan: nothing to measure
        # Each answer's peak was priced ``delta`` under what it holds: solve again there.
        self._chase(first[1], MAX_ROUNDS - 1, lambda answer, delta, shift: delta)
        self._builtins()
        return self.best if self.best is not None else self._smallest()

    def _attempt(self, shift: int) -> tuple[Solution, int] | None:
        """The plan solved at ``budget - shift``, measured, and how much more its peak is
        than the solver priced it; kept when it fits and is best. None when the solver
        stopped before a plan."""
        self.tried.add(shift)
        answer = self.solve_at(self.budget - shift)
        if not answer.node_decisions or answer.peak_bytes is None:
            self.unplanned = answer
            return None
        self.options = answer.options
        measured = self._measured(answer)
        if self._fits(measured) and (self.best is None or _better(measured, self.best)):
            self.best = measured
        assert measured.peak_bytes is not None
        return measured, measured.peak_bytes - answer.peak_bytes

    def _chase(self, shift: int, rounds: int,
               after: Callable[[Solution, int, int], int | None]) -> None:
        """Solve at ``shift``, then at the shift ``after(answer, delta, shift)`` names, at
        most ``rounds`` solves; stop at a shift tried already, or where none fits."""
        for _ in range(rounds):
            if shift in self.tried or self.budget < shift:
                return
            try:
                attempt = self._attempt(shift)
            except InfeasibleBudgetError:
                return
            following = None if attempt is None else after(*attempt, shift)
            if following is None:
                return
            shift = following

    def _builtins(self) -> None:
        view = BudgetView.of(self.graph, None)
        for saves in policy_saves(self.graph).values():
            offered = [s and bool(key) for s, key in zip(saves, self.graph.node_key, strict=True)]
            flops = recompute_flops(self.graph, offered)
            if self.best is not None and flops >= self.best.recompute_flops:
                continue
            predicted = view.predicted(offered)
            if predicted - self.assumed > self.budget:
                continue  # over the budget whatever its working set
            keys = frozenset(k for k, s in zip(self.graph.node_key, offered, strict=True) if s)
            shift = self._delta(offered, keys, None)
            if predicted + shift > self.budget:
                continue
            # The solver's plan there may hold a little more than the built-in does:
            # then tighten by what it overshot.
            self._chase(shift, MAX_TIGHTENINGS, self._tightened)
            if self.best is None or flops < self.best.recompute_flops:
                builtin = self._measured(self._priced(offered, keys, self.budget - shift))
                if self._fits(builtin):
                    self.best = builtin

    def _tightened(self, answer: Solution, delta: int, shift: int) -> int | None:
        assert answer.peak_bytes is not None
        return None if self._fits(answer) else shift + answer.peak_bytes - self.budget

    def _smallest(self) -> Solution:
        """Every plan outgrew its shift: the smallest plan (``nothing_saveable`` in every
        layer, whose working set is the calibrated one) fits wherever one does."""
        try:
            smallest = self.solve_at(0)
        except InfeasibleBudgetError as err:
            smallest = self.solve_at(err.min_budget_bytes)
        smallest = self._measured(smallest)
        if self._fits(smallest):
            return smallest
        assert smallest.peak_bytes is not None
        raise InfeasibleBudgetError(self.budget, smallest.peak_bytes)

    def _priced(self, offered: Sequence[bool], keys: frozenset[str], budget: int) -> Solution:
        """The plan saving exactly ``offered`` (the policy keys ``keys``), as the solver
        prices it with every free node's mode forced. Not searched: no optimality claimed."""
        modes = [mode if mode != NodeMode.FREE else NodeMode.SAVE if s else NodeMode.RECOMPUTE
                 for s, mode in zip(offered, self.graph.node_mode, strict=True)]
        forced = CostGraph.model_construct(**{**dict(self.graph), "node_mode": modes})
        answer = solve(forced, budget, nest=False)
        return answer.model_copy(update={
            "graph_hash": self.graph.content_hash, "saved_keys": sorted(keys),
            "options": self.options or answer.options,
            "status": SolveStatus.FEASIBLE,
            "lower_bound_flops": 0, "gap": 1.0 if answer.recompute_flops else 0.0})

    def _measured(self, answer: Solution) -> Solution:
        """``answer`` with its own working set and the peak it makes."""
        assert answer.peak_bytes is not None
        saves = [d != "recompute" for d in answer.node_decisions]
        keys = frozenset(answer.saved_keys)
        return answer.model_copy(update={
            "budget_bytes": self.budget, "working_bytes": plan_working_bytes(self.regions, keys),
            "peak_bytes": answer.peak_bytes + self._delta(saves, keys, answer.groups)})

    def _delta(self, saves: Sequence[bool], keys: frozenset[str],
               groups: Sequence[int] | None) -> int:
        return working_set_delta(self.graph, self.regions, saves, keys, groups)

    def _fits(self, answer: Solution) -> bool:
        assert answer.peak_bytes is not None
        return answer.peak_bytes <= self.budget


def _better(a: Solution, b: Solution) -> bool:
    """Fewer recompute FLOPs, then the smaller peak: the solver's own order."""
    assert a.peak_bytes is not None and b.peak_bytes is not None
    return (a.recompute_flops, a.peak_bytes) < (b.recompute_flops, b.peak_bytes)
