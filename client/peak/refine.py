"""A peak plan fitted to its own measured peak.

The peak model (``optiremat.solver.peak``) is exact about what the step holds
and what its forward pass stacks; the working sets of its phases are the
figures it takes from measurements, made once per step under one policy
(``client.peak.calibration``). They move with the plan, though: on the 4-layer f32
Llama of the scan corpus a layer's backward holds 30.4 MiB under
``nothing_saveable`` and 22.2 to 27.7 MiB under the plans along its frontier;
on the CNN and the MLP some plans hold 2 MiB more; on an LM the head's phase
holds up to 7% less under plans that save more than ``nothing_saveable``
(bench/peak.py).

So a plan is refined against its own measurement (a ``PeakMeasure``): with the
function at hand, as ``optimize`` has it, the whole step compiled with the plan
applied (``StepMeasure``: XLA's peak itself, every phase included); with the
graph and its regions alone, one layer per region compiled under the plan's
policy (``LayerMeasure``: the layers' phases corrected, the others as
calibrated). The prediction is corrected by the difference, and while the plan
does not fit, or the budget has room the calibration took, the budget is solved
again shifted by that difference. Then each of JAX's built-in policies, each
value the user named saved alone, and the names saved together up to each one in
program order (``_candidates``), that fits as measured and recomputes less
than the answer is tried: solved at the shift that lets it fit, and taken itself
where the solver's plans there hold more than it does, so that a plan is never
worse than the built-ins as XLA measures them. Where the answer then leaves more
than 2% of the budget unused and a solve nearer the budget measured over it, the
budgets between are bisected (twice at most), so that a plan priced between two
solves is not missed. Each round is one solve and at most one compile
(measurements are remembered), never a compile per candidate of the MILP; none
where the solve recomputes no less than the best plan measured so far, which it
cannot beat (at equal FLOPs, only tie on a lower peak). A
budget the solver's price of its smallest plan misses by a few bytes is answered
with that plan when it fits as measured. The smallest feasible
budget an infeasible one names is the smallest budget refinement plans, found
from the smallest plan and every candidate measured (``smallest_budget``), not
from what one budget's refinement happened to measure: on an LM a name saved
alone measures 18% under the smallest plan.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

from optiremat.client.peak.measures import LayerMeasure, PeakMeasure, measure_ahead
from optiremat.client.peak.regions import Region
from optiremat.client.step import COMPILE_WORKERS
from optiremat.solver.baselines import builtin_offered_saves
from optiremat.solver.graph import CostGraph, NodeMode
from optiremat.solver.peak import BudgetView
from optiremat.solver.semantics import (
    baseline_backward_flops,
    effective_saves,
    evaluate,
    kept_anyway,
    recompute_flops,
)
from optiremat.solver.solution import Decision, InfeasibleBudgetError, Solution, SolveStatus

# Solves following the working set's shift: it settles in one or two on the corpus.
MAX_ROUNDS = 4
# Solves tightening past a built-in's shift when the solver's plan there holds more.
MAX_TIGHTENINGS = 3
# Solves bisecting between a shift whose plan fitted and one whose plan did not, where
# the answer leaves more than ROOM of the budget unused.
MAX_FILLS = 2
ROOM = 0.02
# Checkpoint names tried, at most (an LM layer names about eight values), and the
# candidates measured in all once a plan fits: each is a compile. While no plan fits,
# every candidate is measured (leanest first): else a budget a candidate meets is refused.
MAX_NAMED = 12
MAX_CANDIDATES_MEASURED = 8

SolveAt = Callable[[int], Solution]


def refined_solve(graph: CostGraph, regions: Sequence[Region], budget: int,
                  solve_at: SolveAt, measure: PeakMeasure | None = None,
                  presets: Sequence[Sequence[bool]] = (),
                  fill: Callable[[Solution], bool] | None = None) -> Solution:
    """The plan for ``budget`` whose peak, measured, fits.

    ``solve_at(b)`` solves ``graph`` (a step's) at budget ``b``, which assumes the
    step's calibrated working sets; ``measure`` says what a plan's peak is (by default
    its regions' layers compiled, ``LayerMeasure``). ``presets`` are plans the answer is
    never worse than where they fit as measured, each measured (a framework's presets: a
    names-only plan is compared with them, ``client.frameworks``). ``fill``: whether to
    bisect where the answer leaves room (``_Refinement._fill``), asked of the answer
    before (by default, always): a plan whose layers are mixed next
    (``client.peak.mixing``) leaves that to the mix, which fills it finer. Raises
    InfeasibleBudgetError when no plan fits, naming the smallest budget refinement plans
    (``smallest_budget``).
    """
    measure = LayerMeasure(graph, regions) if measure is None else measure
    answer = _Refinement(graph, budget, solve_at, measure, presets).run(fill)
    if answer is not None:
        return answer
    least, found = _smallest_answer(graph, solve_at, measure, presets)
    # The search from the smallest budget can meet a plan this budget's did not (on a
    # Flax decoder planned for jax 0.10's own CPU compile, the solver's plan saving
    # everything measured 1 KiB under the built-in that led this budget's search there):
    # the smallest budget named is always answered.
    if found is not None and found.peak_bytes is not None and found.peak_bytes <= budget:
        return found.model_copy(update={"budget_bytes": budget})
    raise InfeasibleBudgetError(budget, least)


# Refinements at the smallest budget found, each at the peak the last one answered: the
# answer a budget takes can measure under it (another plan the solver finds there).
MAX_DESCENTS = 3


def smallest_budget(graph: CostGraph, solve_at: SolveAt, measure: PeakMeasure,
                    presets: Sequence[Sequence[bool]] = ()) -> int:
    """The smallest budget refinement plans, whatever was asked before: the least
    measured peak of the solver's smallest plan and of every candidate
    (``_Refinement._candidates``: the built-ins, the names alone), then refined at that
    budget until the plan it answers peaks there. Depends on the graph and the measure
    only, so an infeasible budget names the same minimum in any order and any process
    (issue: a penzai stack's minimum moved with the budgets planned before)."""
    return _smallest_answer(graph, solve_at, measure, presets)[0]


def _smallest_answer(graph: CostGraph, solve_at: SolveAt, measure: PeakMeasure,
                     presets: Sequence[Sequence[bool]]) -> tuple[int, Solution | None]:
    """``smallest_budget``, and the plan found peaking there (None where the least was a
    candidate measured whose search did not come back to it)."""
    start = _Refinement(graph, 0, solve_at, measure, presets)
    least, found = start.smallest_measured(), None
    for _ in range(MAX_DESCENTS):
        answer = _Refinement(graph, least, solve_at, measure, presets).run()
        if answer is None or answer.peak_bytes is None:
            break  # not expected: a plan peaking at ``least`` was measured
        settled = answer.peak_bytes >= least
        least, found = min(least, answer.peak_bytes), answer
        if settled:
            break
    return least, found


class _Refinement:
    def __init__(self, graph: CostGraph, budget: int, solve_at: SolveAt,
                 measure: PeakMeasure, presets: Sequence[Sequence[bool]] = ()) -> None:
        assert graph.step is not None
        self.graph, self.budget, self.solve_at, self.measure = graph, budget, solve_at, measure
        self.presets = [list(p) for p in presets]
        # A floor on a plan's peak whatever its working sets: at the forward pass's end
        # every residual is live.
        view = BudgetView.of(graph, None)
        self.unmeasured_share = view.held_bytes - graph.step.held_bytes - max(
            (p.fixed_residual_bytes for p in view.phases), default=0)
        # Blocks of straight-line code are priced loosely: their residuals count in every
        # phase and the calibrated working set is nothing_saveable's, so a built-in can
        # measure under that floor (dots_saveable per layer of an unrolled Llama: floor
        # 60.02 MiB, measured 58.02). Their candidates are measured, not ruled out.
        self.floor_holds = not graph.step.has_blocks
        self.candidates_measured = 0
        self.best: Solution | None = None
        self.tried: set[int] = set()
        self.peaks: dict[int, int] = {}  # shift -> the measured peak of the plan solved there
        self.solved: Solution | None = None  # the last solve's plan: its solver and options
        self.unplanned: Solution | None = None  # an answer without a plan (time limit, cancel)

    def run(self, fill: Callable[[Solution], bool] | None = None) -> Solution | None:
        """The best plan that fits as measured; None when none does. ``fill``: whether to
        bisect where it leaves room (``_fill``), asked of the best plan before (by
        default, always)."""
        start = 0
        try:
            first = self._attempt(start)
        except InfeasibleBudgetError as err:
            # The solver's price for its smallest plan may be a little over what XLA
            # holds (its small buffers): measured, that plan may fit the budget.
            if err.min_budget_bytes <= self.budget:
                raise
            start = self.budget - err.min_budget_bytes
            first = self._attempt(start)
        if first is None:
            assert self.unplanned is not None
            return self.unplanned  # stopped before a plan: nothing to measure
        assert first[0].peak_bytes is not None
        # Each answer's peak was priced ``delta`` under what it holds: solve again there.
        self._chase(first[1], MAX_ROUNDS - 1, lambda answer, delta, shift: delta,
                    (start, first[0].peak_bytes))
        self._builtins()
        if fill is None or (self.best is not None and fill(self.best)):
            self._fill()
        return self.best if self.best is not None else self._smallest()

    def _attempt(self, shift: int, bracketing: bool = False) -> tuple[Solution, int] | None:
        """The plan solved at ``budget - shift``, measured, and how much more its peak is
        than the solver priced it; kept when it fits and is best. None when the solver
        stopped before a plan, or when it recomputes no less than the best plan so far and
        is not ``bracketing`` (measured for where the plans that fit begin, ``_fill``)."""
        self.tried.add(shift)
        answer = self.solve_at(self.budget - shift)
        if not answer.planned or answer.peak_bytes is None:
            self.unplanned = answer
            return None
        self.solved = answer
        if (not bracketing and self.best is not None
                and answer.recompute_flops >= self.best.recompute_flops):
            # It cannot be the answer, measured or not, nor can the plans of the smaller
            # budgets a chase goes on to: not compiled (on the corpus's unrolled Llama,
            # 4 of the 13 compiles of its smallest budget). A plan recomputing as much
            # could only tie, on a lower peak: on the scan corpus's 8-layer Llama at 0.6x
            # its peak, the chase's second solve swapped two saves that cost nothing
            # (RoPE's sin and cos) and measured to the byte what the first did.
            return None
        if not self.peaks:
            self._candidates_ahead(answer)
        measured = self._measured(answer)
        if self._fits(measured) and (self.best is None or _better(measured, self.best)):
            self.best = measured
        assert measured.peak_bytes is not None
        self.peaks[shift] = measured.peak_bytes
        return measured, measured.peak_bytes - answer.peak_bytes

    def _fill(self) -> None:
        """Where the answer leaves room, the plans priced between the least shift whose
        plan fitted and the greatest below it whose plan did not, bisected: a plan
        recomputing less can be priced there, which neither solve met (penzai's decoder on
        jax 0.12 at 126.10 MiB answered 113.46 MiB and 4.59e6 FLOPs; at 120.14 MiB,
        119.46 MiB and 3.02e6)."""
        for _ in range(MAX_FILLS):
            if (self.best is None or self.best.peak_bytes is None
                    or self.best.peak_bytes >= (1 - ROOM) * self.budget):
                return
            fitted = [shift for shift, peak in self.peaks.items() if peak <= self.budget]
            if not fitted:
                return
            least = min(fitted)
            over = [shift for shift, peak in self.peaks.items()
                    if peak > self.budget and shift < least]
            if not over:
                return
            middle = (least + max(over)) // 2
            if middle in self.tried:
                return
            try:
                self._attempt(middle, bracketing=True)
            except InfeasibleBudgetError:
                return

    def _chase(self, shift: int, rounds: int,
               after: Callable[[Solution, int, int], int | None],
               before: tuple[int, int] | None = None) -> None:
        """Solve at ``shift``, then at the shift ``after(answer, delta, shift)`` names, at
        most ``rounds`` solves; stop at a shift tried already, where none fits, or where
        the chase stalls: a plan solved at a greater shift than the one before (``before``:
        its shift and measured peak) measuring no lower and over the budget. There the peak
        is set by what the solver's plans do not change (on the corpus's unrolled Llama, a
        block's working set: its plans measured 99.06 MiB at shifts 0 and 10.9 MiB, and
        each later round only recomputed more)."""
        for _ in range(rounds):
            if shift in self.tried or self.budget < shift:
                return
            try:
                attempt = self._attempt(shift)
            except InfeasibleBudgetError:
                return
            if attempt is None:
                return
            peak = attempt[0].peak_bytes
            assert peak is not None
            if (before is not None and shift > before[0] and peak >= before[1]
                    and peak > self.budget):
                return
            following = after(*attempt, shift)
            if following is None:
                return
            shift, before = following, (shift, peak)

    def _candidates(self, best: Solution | None) -> list[_Candidate]:
        """JAX's built-ins; each value the user named with ``checkpoint_name`` saved alone
        (a name's policy key); and the names saved together up to each one in program
        order, as LM libraries' presets save a layer's first projections (q, k and v;
        every dot but the MLP's).

        A named value saved can split a layer's backward pass in two and lower its
        working set, which the calibrated one cannot show: on an LM, saving the
        attention's out projection alone measures 18% under nothing_saveable's peak
        (tests/lm_models.py, bench/peak.py). So while no plan fits, the built-ins and the
        names alone are tried, the leanest as priced first (those are the ones a tight
        budget may take); once one fits, the leanest and the fewest FLOPs alternate: the
        leanest find the plans a budget at a preset's peak holds, the fewest FLOPs the
        presets that save more than the calibration suggests they fit (``best``: the best
        plan so far, None while none fits). Each is priced once here."""
        g = self.graph
        candidates = [*self.presets, *builtin_offered_saves(g).values()]
        # A name whose value is kept anyway (a layer's input) changes nothing saved.
        ordered = _names_in_order(g)
        idle = kept_anyway(g, ordered)
        alone = {key: _saving(g, {key}) for key in ordered if key not in idle}
        names = list(alone)[:MAX_NAMED]
        candidates += [alone[key] for key in names]
        # The names together are for FLOPs, once a plan fits: they hold more than the
        # names alone, which are the ones a budget nothing fits yet may take.
        if best is not None:
            candidates += [_saving(g, set(names[:end])) for end in range(2, len(names) + 1)]
        view = BudgetView.of(g, None)
        unique = {tuple(saves): saves for saves in candidates}.values()
        priced = [_Candidate(view.predicted(saves), recompute_flops(g, saves), saves)
                  for saves in unique]
        leanest = sorted(priced, key=lambda c: (c.predicted, c.flops))
        if best is None:
            return leanest
        fewest_flops = sorted(priced, key=lambda c: (c.flops, c.predicted))
        alternated = [c for pair in zip(leanest, fewest_flops, strict=True) for c in pair]
        return list({id(c.saves): c for c in alternated}.values())

    def _builtins(self) -> None:
        candidates = self._candidates(self.best)
        for at, candidate in enumerate(candidates):
            if not self._worth_measuring(candidate, self.best):
                continue
            self._compile_ahead(candidates[at + 1:],
                                lambda later: self._worth_measuring(later, self.best))
            offered, flops = candidate.saves, candidate.flops
            self.candidates_measured += 1
            keys, shift = self._candidate_shift(offered)
            if candidate.predicted + shift > self.budget:
                continue
            # It fits: it is the answer unless the solver's plans at its shift recompute
            # less. Taken first, so that those recomputing more are not compiled.
            builtin = self._measured(self._priced(offered, keys, self.budget - shift))
            if self._fits(builtin) and (self.best is None
                                        or flops < self.best.recompute_flops):
                self.best = builtin
            # The solver's plan there may hold a little more than the built-in does:
            # then tighten by what it overshot.
            self._chase(shift, MAX_TIGHTENINGS, self._tightened)

    def _worth_measuring(self, candidate: _Candidate, best: Solution | None) -> bool:
        """Whether a candidate is measured now, ``best`` the best plan so far: it
        recomputes less than ``best``, its floor is not over the budget, and the cap on
        candidates measured once a plan fits is not reached (a preset is always measured:
        the answer is never worse)."""
        if best is not None and candidate.flops >= best.recompute_flops:
            return False
        if self.floor_holds and candidate.predicted - self.unmeasured_share > self.budget:
            return False  # over the budget whatever its working sets
        return (candidate.saves in self.presets or best is None
                or self.candidates_measured < MAX_CANDIDATES_MEASURED)

    def _candidates_ahead(self, answer: Solution) -> None:
        """While the first plan solved, ``answer``, compiles: start compiling the
        candidate ``_builtins`` measures first where that plan fits as priced (the
        prediction is exact on most scans), on a spare worker thread. On the issue 39
        stack at 140.81 MiB that candidate's compile followed the answer's, 0.9 s on
        this thread."""
        assert answer.peak_bytes is not None and self.best is None
        if self._fits(answer):  # else a chase comes first, and what is worth measuring moves
            self._compile_ahead(self._candidates(answer),
                                functools.partial(self._worth_measuring, best=answer))

    def _compile_ahead(self, later: Sequence[_Candidate],
                       measured: Callable[[_Candidate], bool]) -> None:
        """Where the measure compiles the step, start compiling the next candidates of
        ``later`` to be ``measured`` (one per spare worker thread) while this one is."""
        for candidate in itertools.islice(filter(measured, later), COMPILE_WORKERS - 1):
            measure_ahead(self.measure, self._candidate_keys(candidate.saves))

    def _tightened(self, answer: Solution, delta: int, shift: int) -> int | None:
        assert answer.peak_bytes is not None
        return None if self._fits(answer) else shift + answer.peak_bytes - self.budget

    def _candidate_shift(self, offered: Sequence[bool]) -> tuple[frozenset[str], int]:
        """The policy keys of the candidate saving ``offered``, and how far its measured
        peak is from its price."""
        keys = self._candidate_keys(offered)
        return keys, self.measure.measure(offered, keys, None)[0]

    def _candidate_keys(self, offered: Sequence[bool]) -> frozenset[str]:
        """The policy keys of the candidate saving ``offered``."""
        g = self.graph
        return frozenset(k for k, s, m in zip(g.node_key, offered, g.node_mode, strict=True)
                         if s and m != NodeMode.RECOMPUTE)

    def _smallest_plan(self) -> Solution:
        """The solver's smallest plan (``nothing_saveable`` in every layer, whose working
        set is the calibrated one), measured."""
        try:
            smallest = self.solve_at(0)
        except InfeasibleBudgetError as err:
            smallest = self.solve_at(err.min_budget_bytes)
        return self._measured(smallest)

    def _smallest(self) -> Solution | None:
        """Every plan outgrew its shift: the smallest plan fits wherever one does (None:
        it does not)."""
        smallest = self._smallest_plan()
        return smallest if self._fits(smallest) else None

    def smallest_measured(self) -> int:
        """The least measured peak of the solver's smallest plan and of every candidate
        (those whose floor is over the least so far cannot be under it)."""
        smallest = self._smallest_plan().peak_bytes
        assert smallest is not None
        least = smallest

        def could_be_under(candidate: _Candidate, least: int) -> bool:
            return not self.floor_holds or (
                candidate.predicted - self.unmeasured_share < least)

        candidates = self._candidates(None)  # the leanest as priced first
        for at, candidate in enumerate(candidates):
            if not could_be_under(candidate, least):
                continue
            self._compile_ahead(candidates[at + 1:], functools.partial(could_be_under, least=least))
            least = min(least, candidate.predicted + self._candidate_shift(candidate.saves)[1])
        return least

    def _priced(self, offered: Sequence[bool], keys: frozenset[str], budget: int) -> Solution:
        """The plan saving exactly ``offered`` (the policy keys ``keys``), priced by the cost
        model itself (``semantics.evaluate``, the step's ``BudgetView``): what a solve with
        every free node's mode forced answers, with no solve. Not searched: no optimality
        claimed. The solver and options named are those of the last solve."""
        assert self.solved is not None
        g = self.graph
        saves = effective_saves(g, offered)
        full = evaluate(g, saves)
        flops = full.backward_flops - baseline_backward_flops(g)
        return Solution(
            graph_hash=g.content_hash, budget_bytes=budget, options=self.solved.options,
            status=SolveStatus.FEASIBLE, residual_bytes=full.residual_bytes,
            recompute_flops=flops, lower_bound_flops=0, gap=1.0 if flops else 0.0,
            saved_keys=sorted(keys),
            node_decisions=[Decision.SAVE if s else Decision.RECOMPUTE for s in saves],
            solver=self.solved.solver, solver_version=self.solved.solver_version,
            peak_bytes=BudgetView.of(g, None).predicted(saves))

    def _measured(self, answer: Solution) -> Solution:
        """``answer`` with its own working set and the peak it makes."""
        assert answer.peak_bytes is not None
        saves = answer.kept()
        delta, working = self.measure.measure(saves, frozenset(answer.saved_keys),
                                              answer.groups)
        return answer.model_copy(update={"budget_bytes": self.budget, "working_bytes": working,
                                         "peak_bytes": answer.peak_bytes + delta})

    def _fits(self, answer: Solution) -> bool:
        assert answer.peak_bytes is not None
        return answer.peak_bytes <= self.budget


class _Candidate(NamedTuple):
    """A plan refinement tries besides the solver's (``_Refinement._candidates``), priced:
    its peak as the calibrated phases predict it and the FLOPs it recomputes."""

    predicted: int
    flops: int
    saves: list[bool]


def _names_in_order(graph: CostGraph) -> list[str]:
    """The policy keys of the values named with ``checkpoint_name`` that the plan decides
    (a names-only plan may decide some names only), in program order."""
    keys = (k for k, p, m in zip(graph.node_key, graph.node_primitive, graph.node_mode,
                                 strict=True)
            if p == "name" and k and m == NodeMode.FREE)
    return list(dict.fromkeys(keys))


def _saving(graph: CostGraph, keys: set[str]) -> list[bool]:
    """Per node, whether a policy saving exactly the names ``keys`` saves it."""
    return [k in keys for k in graph.node_key]


def _better(a: Solution, b: Solution) -> bool:
    """Fewer recompute FLOPs, then the smaller peak: the solver's own order."""
    assert a.peak_bytes is not None and b.peak_bytes is not None
    return (a.recompute_flops, a.peak_bytes) < (b.recompute_flops, b.peak_bytes)
