"""A scan's layers planned apart, so that a plan fills the budget one policy leaves.

One policy per ``lax.scan`` moves the peak in steps of L x a tensor: on the
8-layer Llama of issue 39 a budget of 150 MiB was answered by a plan measuring
138.69 MiB, the next step up measuring 159.47. With the layers in groups
(``client.peak.layer_groups``), some taking the saves of plans that recompute
less, the peak moves in steps of one layer's difference.

A mix is one group of layers or two, each taking the saves of the refined answer
``a`` or of a plan between it and the plan recomputing least, the leaner first
(the last group's backward runs first, with every residual live: 162.63 against
178.42 MiB the other way round on that stack), and mostly the scan's last layer
alone saving what the plan recomputing least saves: (L - 1 - k, ``a``), (k,
``b``), (1, least). The last layer's residuals cost no peak on a scan without a
head (a loop of one trip is straight-line code to XLA, and its backward runs
first); a group of one layer in front or between is off the line the others make,
so it is not mixed.

A mix's peak is a line in the residual bytes its layers stack, at a level learnt
per plan of its last group (``_Line``): one mix measured puts every count of the
same plans on it, to the byte on the stacks measured. Each round compiles the mix
recomputing least that the line puts within the budget, over the plans the solver
gives between ``a`` and the plan recomputing least (``_plans_between``), and
learns its level; the next round chooses again, four compiles at most, one to
three on the budgets of ``bench/layer_groups.py``. Refinement leaves its fill
(``refine._Refinement._fill``) to the mix, which fills the budget finer.

A backend may hold more for a scan split into two loops. On a TPU v5e (jax 0.10.2) it
holds the smaller loop's stacked residuals again: 4 + 4 layers of one plan measured
1506.55 MiB against 1187.95 in one loop, 6 + 2 1340.58, 2 + 6 1357.25, where on CPU
all measure the same; XLA's buffer assignment of the two programs is the same size
(741 and 743 MiB of temporaries), so the bytes are the backend's own, after HLO. The
line learns it from the step: where a mix of two loops measures over its line by
half its smaller loop's bytes or more, one more compile measures the refined
answer's own saves split as the mix's loops are, and the line prices a split at that
fraction of the smaller loop's bytes (``_Line.split``; 0.94-1.08 on the TPU, where
the next mixes landed within 14 MiB of it). On a backend known to hold it
(``SPLITS_HELD_AGAIN``: a TPU), that compile comes before the first mix, with the
answer's layers halved, rather than after a first mix spent over its line.

A backend may also hold the last layer alone's saves, in a backward phase of its own.
On the TPU at 1292.06 MiB, 7 + 1 layers measured 1121.38-1129.45 MiB with the last
layer saving 80.80 to 144.80 MiB and 1380.01 with it saving what the plan recomputing
least saves (424.55 MiB). Where a mix with the last layer alone measures over its line
by half that layer's bytes or more, one compile of the same mix with a lighter last
layer (the saves of the group before it) sets the family's level, the mix's excess
over it is that phase's (``_Line.tail``), and from then on the last layer may take any
plan's saves.

Only a step with one region, a scan running forward and not nested in groups, is
mixed; the solver's graph keeps one decision per key, so FLOPs and residuals of
the mix are its plans' per-layer figures weighted by their layers (every free node
of such a step is in its layers), each group hoisting its own loop-invariant
residuals.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from fractions import Fraction
from typing import NamedTuple

import jax

from optiremat.client.peak.measures import StepMeasure
from optiremat.client.peak.refine import SolveAt
from optiremat.client.peak.regions import Region
from optiremat.client.peak.scan_region import ScanRegion
from optiremat.solver.breakdown import residual_parts
from optiremat.solver.graph import CostGraph
from optiremat.solver.peak import BudgetView
from optiremat.solver.solution import InfeasibleBudgetError, LayerGroup, Solution, SolveStatus
from optiremat.solver.solve import max_useful_budget

# Compiles of mixes, at most.
MAX_MIX_COMPILES = 4

# Backends found to hold a scan split into two loops' smaller loop again (a TPU v5e,
# jax 0.10.2: 0.94-1.08 of its stacked bytes). There the split is measured before the
# first mix, rather than after a first mix is chosen as if splits were free and lands
# hundreds of MiB over its line.
SPLITS_HELD_AGAIN = frozenset({"tpu"})


def mixable(regions: Sequence[Region], answer: Solution, measure: object) -> bool:
    """Whether ``answer``'s step can take its scan's layers planned apart."""
    return (len(regions) == 1 and isinstance(regions[0], ScanRegion)
            and regions[0].nestable and regions[0].length > 1
            and isinstance(measure, StepMeasure) and measure.split_peak_of is not None
            and answer.offload is None and all(k == 1 for k in answer.groups or [1])
            and answer.peak_bytes is not None and answer.peak_bytes < answer.budget_bytes)


# A mix's groups: per group of consecutive layers, its count and the plan whose saves
# it takes.
Parts = tuple[tuple[int, Solution], ...]


class Mix(NamedTuple):
    """A scan's layers in groups, each a count of layers and the plan whose saves they
    take (first layers first), and the step's measured peak."""

    parts: Parts
    peak: int


def mixed_layers(graph: CostGraph, region: ScanRegion, answer: Solution, solve_at: SolveAt,
                 measure: StepMeasure) -> Solution:
    """``answer`` (refined, within its budget) or, where it recomputes less and fits as
    measured, a plan giving the scan's layers the saves of plans that recompute less: one
    plan's or two plans' in groups (``_Line``), mostly the last layer alone taking those
    of the plan recomputing least.

    Each round compiles the mix recomputing least that the line puts within the budget,
    over the plans the solver gives between ``answer`` and the plan recomputing least; its
    measured peak sets the line's level for the mixes of its family and last plan, and
    the next round chooses again, until the mix chosen was measured or none is left.
    Where the next mix's last plan is one measured, it lands where the line says. A mix of
    two loops far over its line is followed by the answer's saves in the same two loops,
    which prices what a split holds (``_Line.learn_split``; first of all on a backend in
    ``SPLITS_HELD_AGAIN``), and a mix with its last layer alone far over its line by the
    same mix with a lighter last layer, which prices that layer's own phase
    (``_Line.learn_tail``); compiles of each kind count toward ``MAX_MIX_COMPILES``."""
    least = _least(graph, answer, solve_at)
    if least is None:
        return answer
    line = _Line(graph, region, answer, least)
    budget = answer.budget_bytes
    room = line.room(answer, budget)
    plans = _plans_between(answer, solve_at, line, room)
    best: Mix | None = None
    measured: set[tuple[tuple[int, tuple[str, ...]], ...]] = set()
    compiles = 0
    if jax.default_backend() in SPLITS_HELD_AGAIN and region.length >= 4:
        compiles += 1
        if not _learn_split(line, measure, region, region.length // 2):
            return answer
    while compiles < MAX_MIX_COMPILES:
        choice = line.cheapest(plans, budget, best)
        if choice is None:
            break
        named = tuple((layers, tuple(plan.saved_keys)) for layers, plan in choice)
        if named in measured:
            break
        measured.add(named)
        compiles += 1
        peak = _measured(measure, region, _keys(choice))
        if peak is None:
            break
        k = line.loop_to_probe(choice, peak)
        if k is not None and compiles < MAX_MIX_COMPILES:
            # Over its line by half the smaller loop's bytes or more: the level, or a
            # backend holding a split loop's group again. The answer's own saves split
            # as the mix's loops are says which, against its one loop measured.
            compiles += 1
            if not _learn_split(line, measure, region, k):
                break
        if line.tail_to_probe(choice, peak) and compiles < MAX_MIX_COMPILES:
            # Over its line by half what its last layer alone stacks or more: the level,
            # or a backend holding that layer's saves in its own backward. The same mix
            # with its last layer taking its last group's saves says which.
            compiles += 1
            probe = _measured(measure, region, _keys(line.with_lighter_tail(choice)))
            if probe is None:
                break
            line.learn_tail(choice, peak, probe)
        line.learn(choice, peak)
        if peak <= budget:
            best = Mix(choice, peak)
        if (now := line.room(answer, budget)) > room:
            # The level fell under its first guess: heavier plans than those solved for
            # may fit.
            room, plans = now, _plans_between(answer, solve_at, line, now, plans)
    return answer if best is None else _mixed(graph, answer, region, best)


def _learn_split(line: _Line, measure: StepMeasure, region: ScanRegion, layers: int) -> bool:
    """``line.learn_split`` from the answer's own saves in two loops, the second of
    ``layers`` layers; False where they cannot be placed."""
    answer = line.answer
    probe = _measured(measure, region, _keys(((region.length - layers, answer),
                                              (layers, answer))))
    if probe is not None:
        line.learn_split(layers, probe)
    return probe is not None


def _keys(parts: Parts) -> tuple[tuple[int, frozenset[str]], ...]:
    """``parts`` as ``_measured`` takes them: each group's layers and saved keys."""
    return tuple((layers, frozenset(plan.saved_keys)) for layers, plan in parts)


def _least(graph: CostGraph, answer: Solution, solve_at: SolveAt) -> Solution | None:
    """The plan recomputing least (saving all it may), whose saves the last layer takes
    (unless it holds them, ``_Line.tail``);
    None where it recomputes no less than ``answer`` or is not a one-policy plan."""
    try:
        least = solve_at(max_useful_budget(graph))
    except InfeasibleBudgetError:
        return None
    if least.recompute_flops >= answer.recompute_flops or least.groups not in (None, [1]):
        return None
    return least


class _Line:
    """The peak of a mix as a line in the residuals its layers stack.

    A mix is one group of layers or two, each taking one plan's saves, the leaner
    first, then (the family most mixes take) the scan's last layer alone saving what the
    plan recomputing least saves. A group of one layer in front or between is
    straight-line code to XLA and measured off the line, so the groups before the last
    layer have two layers at least.

    With the last layer alone, the step peaks in its backward, which runs first with
    every residual live: at a level plus the residual bytes the layers before it stack.
    Measured on the issue's stack (jax 0.10.2, CPU) over 5 + 2 + 1 .. 2 + 5 + 1 and 7 + 1
    layers, from two leaner plans and with three heavier ones, the level was one figure
    to 32 KiB (93.28 MiB); on the scan corpus's ViT (12 layers) one figure to the byte
    across 9 + 2 + 1 .. 2 + 9 + 1 with two heavier plans. It is one figure per plan of the
    group before the last layer, though, where that group's own backward peaks higher
    (102.88 MiB on the issue's stack for plans stacking under 4.6 MiB a layer) and on
    jax 0.12.1 (81.44 MiB for one plan, 83.13 for a heavier one), so a level is kept per
    that plan, one not yet measured taking the level of the plan measured nearest in
    bytes.

    Where the step's head peaks last, with every residual live (an LM's logits), the last
    layer's saves cost what they stack (lm_V8k at 151.72 MiB: 7 + 1 154.46 MiB, over the
    budget), and a mix without the last layer alone is on the one-policy plan's own line:
    its measured peak less what its layers stack, to the byte (6 + 2 .. 4 + 4 layers,
    107.83 MiB). Those mixes are the second family, their levels kept apart. Every mix
    answered is measured."""

    def __init__(self, graph: CostGraph, region: ScanRegion, answer: Solution,
                 least: Solution) -> None:
        assert answer.peak_bytes is not None
        self.graph, self.region, self.least = graph, region, least
        self.before_last = region.length - 1
        self._stacked: dict[tuple[str, ...], int] = {}
        # Per family (the last layer alone or not) and plan of the group before the last
        # layer (the last group), the level measured.
        self._levels: dict[tuple[bool, tuple[str, ...]], int] = {}
        # Before a mix of a family is measured: ``answer``'s measured peak less every
        # layer's residuals (the line of its own backward's phase; with the last layer
        # alone, where its plan is before it on jax 0.10.2: 102.88 MiB on the issue's
        # stack), and with the last layer alone where the step's head peaks (the phase
        # outside the regions, as priced), what that layer stacks too (lm_V8k: 125.18 MiB
        # against 119.50 measured).
        first = answer.peak_bytes - self.region.length * self.stacked(answer)
        phase = BudgetView.of(graph, None).peak_phase()
        head_last = phase is not None and phase.region < 0
        self._first = {False: first, True: first + (self.stacked(least) if head_last else 0)}
        self.answer = answer
        # Per byte the smaller of a mix's two loops stacks, what the step holds beyond
        # the line (``learn_split``; None until measured, priced as 0): none on CPU, about
        # all of it on a TPU v5e.
        self.split: Fraction | None = None
        # With the last layer alone, the level of that layer's own backward phase, where
        # the step holds its saves beside what the layers before it stack (``learn_tail``;
        # None until measured, the last layer's saves then free). On CPU its backward
        # runs first and costs nothing; on a TPU v5e (the bf16 stack at 1292.06 MiB) a
        # last layer saving what the plan recomputing least saves (424.55 MiB) measured
        # 1380.01 MiB where one saving 80.80 to 144.80 MiB measured 1121.38-1129.45.
        self.tail: int | None = None

    def stacked(self, plan: Solution) -> int:
        """The residual bytes ``plan`` stacks per layer of the scan."""
        keys = tuple(plan.saved_keys)
        if keys not in self._stacked:
            total, _, _ = residual_parts(self.graph, self.region.index, plan.kept())
            self._stacked[keys] = total // self.region.length
        return self._stacked[keys]

    def level(self, plan: Solution, alone: bool) -> int:
        """The level of mixes of the family ``alone`` (the last layer alone or not) whose
        last group before it takes ``plan``'s saves: as measured, else as measured for the
        plan of that family stacking nearest to it."""
        key = (alone, tuple(plan.saved_keys))
        if key in self._levels:
            return self._levels[key]
        stacked = self.stacked(plan)
        family = [(abs(self._stacked[keys] - stacked), -level)
                  for (measured_alone, keys), level in self._levels.items()
                  if measured_alone == alone]
        return -min(family)[1] if family else self._first[alone]

    def room(self, plan: Solution, budget: int) -> int:
        """What ``budget`` leaves over the mix giving every layer (before the last alone,
        in that family) ``plan``'s saves, in the family leaving more."""
        return budget - min(self.level(plan, True) + self.before_last * self.stacked(plan),
                            self.level(plan, False) + self.region.length * self.stacked(plan))

    def held(self, loops: Parts) -> int:
        """What a mix's groups before the last layer alone hold: the bytes they stack and,
        where they run as two loops, ``split`` of the smaller loop's again."""
        stacked = [n * self.stacked(plan) for n, plan in loops]
        return sum(stacked) + (self.split_bytes(*stacked) if len(stacked) == 2 else 0)

    def predicted(self, parts: Parts) -> int:
        """The line's peak of the mix ``parts``."""
        loops, alone = _loops(parts)
        level = self.level(loops[-1][1], alone)
        if alone and self.tail is not None:
            level = max(level, self.tail + self.stacked(parts[-1][1]))
        return level + self.held(loops)

    def loop_to_probe(self, parts: Parts, peak: int) -> int | None:
        """The layers of the smaller loop (by the bytes it stacks) of a mix of two loops
        that measured ``peak`` over its line by half that loop's bytes or more, while no
        split has been measured; None otherwise."""
        loops, _ = _loops(parts)
        if len(loops) != 2 or self.split is not None:
            return None
        layers, smaller = min(((n, n * self.stacked(plan)) for n, plan in loops),
                              key=lambda loop: loop[1])
        return layers if 0 < smaller <= 2 * (peak - self.predicted(parts)) else None

    def learn_split(self, layers: int, peak: int) -> None:
        """``split`` from the answer's step with its layers in two loops, the second of
        ``layers`` layers, measured ``peak``: what it measures beyond the answer's one
        loop, per byte its smaller loop stacks."""
        assert self.answer.peak_bytes is not None
        stacked = min(layers, self.region.length - layers) * self.stacked(self.answer)
        self.split = (Fraction(max(0, peak - self.answer.peak_bytes), stacked) if stacked
                      else Fraction(0))

    def tail_to_probe(self, parts: Parts, peak: int) -> bool:
        """Whether ``parts``, with its last layer alone, measured ``peak`` over its line by
        half what that layer stacks or more, while no ``tail`` has been measured."""
        stacked = self.stacked(parts[-1][1])
        return (_loops(parts)[1] and self.tail is None
                and 0 < stacked <= 2 * (peak - self.predicted(parts)))

    @staticmethod
    def with_lighter_tail(parts: Parts) -> Parts:
        """``parts`` (the last layer alone) with the last layer taking the saves of the
        group before it."""
        loops, _ = _loops(parts)
        return (*loops, (1, loops[-1][1]))

    def learn_tail(self, parts: Parts, peak: int, probe: int) -> None:
        """``tail`` from ``parts`` (the last layer alone) measured ``peak`` and the same
        mix with a lighter last layer (``with_lighter_tail``) measured ``probe``. The
        probe sets the level of the mix's family and last plan, and ``tail`` is what the
        mix measured with its own last layer's bytes: that phase's level where it peaked
        there, a bound over it where the probe measured as much (the level peaked)."""
        self.learn(self.with_lighter_tail(parts), probe)
        loops, _ = _loops(parts)
        self.tail = peak - self.held(loops) - self.stacked(parts[-1][1])

    def learn(self, parts: Parts, peak: int) -> None:
        """The level of ``parts``'s family and last plan before the last layer alone (or
        last plan), from the mix's peak; or ``tail``, where that phase was the line's."""
        loops, alone = _loops(parts)
        key = (alone, tuple(loops[-1][1].saved_keys))
        level = peak - self.held(loops)
        if (alone and self.tail is not None
                and self.tail + self.stacked(parts[-1][1]) >= self.level(loops[-1][1], alone)):
            self.tail = max(self.tail, level - self.stacked(parts[-1][1]))
            return
        # Two mixes of one level can differ by a few KiB (16 KiB a layer on the test
        # stack): the higher stands.
        self._levels[key] = max(level, self._levels.get(key, level))

    def split_bytes(self, first: int, second: int) -> int:
        """What two loops stacking ``first`` and ``second`` bytes hold again."""
        return int((self.split or 0) * min(first, second))

    def cheapest(self, plans: Sequence[Solution], budget: int, best: Mix | None) -> Parts | None:
        """Of the mixes from ``plans`` (leanest first), the one recomputing least that the
        line puts within ``budget``, and under what ``best`` (measured) recomputes; None
        where there is none."""
        length, before = self.region.length, self.before_last
        flops = [plan.recompute_flops / length for plan in plans]
        stacked = [self.stacked(plan) for plan in plans]
        levels = {alone: [self.level(plan, alone) for plan in plans] for alone in (True, False)}
        least = self.least.recompute_flops / length
        bound = _flops(best.parts, length) if best is not None else float("inf")
        chosen: tuple[float, int, Parts] | None = None

        def consider(cost: float, peak: int, parts: Parts) -> None:
            nonlocal chosen
            if peak <= budget and cost < bound and (chosen is None
                                                    or (cost, peak) < chosen[:2]):
                chosen = (cost, peak, parts)

        # The last layer alone takes what the plan recomputing least saves or, where it
        # costs a phase of its own (``tail``), any plan's, that phase then a floor under
        # its family's level.
        def floor(plan: Solution) -> int:
            return 0 if self.tail is None else self.tail + self.stacked(plan)

        tails = [(least, self.least, floor(self.least))]
        if self.tail is not None:
            tails += [(flops[t], plan, floor(plan)) for t, plan in enumerate(plans)
                      if plan.saved_keys != self.least.saved_keys]
        for i, lean in enumerate(plans):
            for tail_flops, tail, tail_floor in tails:
                consider(before * flops[i] + tail_flops,
                         max(levels[True][i], tail_floor) + before * stacked[i],
                         ((before, lean), (1, tail)))
            for j in range(i + 1, len(plans)):
                for tail_flops, tail, tail_floor in tails:
                    for k in range(2, before - 1):
                        consider((before - k) * flops[i] + k * flops[j] + tail_flops,
                                 max(levels[True][j], tail_floor) + (before - k) * stacked[i]
                                 + k * stacked[j]
                                 + self.split_bytes((before - k) * stacked[i], k * stacked[j]),
                                 ((before - k, lean), (k, plans[j]), (1, tail)))
                for k in range(2, length - 1):
                    consider((length - k) * flops[i] + k * flops[j],
                             levels[False][j] + (length - k) * stacked[i] + k * stacked[j]
                             + self.split_bytes((length - k) * stacked[i], k * stacked[j]),
                             ((length - k, lean), (k, plans[j])))
        return None if chosen is None else chosen[2]


def _loops(parts: Parts) -> tuple[Parts, bool]:
    """The groups of ``parts`` before the last layer alone (all of them where it is not
    alone), which run as loops, and whether it is alone."""
    alone = parts[-1][0] == 1
    return (parts[:-1] if alone else parts), alone


def _flops(parts: Sequence[tuple[int, Solution]], length: int) -> float:
    return sum(n * plan.recompute_flops for n, plan in parts) / length


def _plans_between(answer: Solution, solve_at: SolveAt, line: _Line, room: int,
                   known: Sequence[Solution] = ()) -> list[Solution]:
    """``answer``, ``known`` and the plans the solver gives where k of the layers before
    the last could take them in ``room`` (``_Line.room``; k over a geometric series),
    leanest first: one-policy plans stacking more than ``answer`` and recomputing less."""
    assert answer.peak_bytes is not None
    shift = price_shift(line.graph, answer)
    found = {tuple(p.saved_keys): p for p in (answer, *known)}
    length = line.region.length
    for k in layer_counts(line.before_last):  # two layers at least (``_Line``)
        try:
            plan = solve_at(answer.peak_bytes + max(0, room) * length // k - shift)
        except InfeasibleBudgetError:
            continue
        if (plan.planned and plan.recompute_flops < answer.recompute_flops
                and plan.groups in (None, [1])
                and line.stacked(plan) > line.stacked(answer)):
            found.setdefault(tuple(plan.saved_keys), plan)
    return sorted(found.values(), key=lambda p: -p.recompute_flops)


def _measured(measure: StepMeasure, region: ScanRegion,
              split: tuple[tuple[int, frozenset[str]], ...]) -> int | None:
    """The step's peak with the scan's layers in the groups of ``split`` (empty groups
    left out); None, with a warning, where they cannot be placed."""
    split = tuple((layers, keys) for layers, keys in split if layers)
    try:
        return measure.measured_split(split)
    except Exception as err:  # the one-policy plan stands; say why it was kept
        warnings.warn(f"the layers of the {region.describe()} could not be planned apart "
                      f"({type(err).__name__}: {err}); the plan keeps one policy per stack",
                      RuntimeWarning, stacklevel=5)
        return None


def price_shift(graph: CostGraph, answer: Solution) -> int:
    """How far the solver's price of ``answer`` is under what it measured. The heavier
    plans a mix may take are solved for budgets moved by as much (the mix chosen is
    measured before it is answered)."""
    assert answer.peak_bytes is not None
    return answer.peak_bytes - BudgetView.of(graph, None).predicted(answer.kept())


def layer_counts(length: int) -> list[int]:
    """2, 3, 4, 6, 8, 12, 16, ... up to ``length``: how many layers a heavier plan may be
    given."""
    counts, k = [2, 3], 4
    while k < length:
        counts += [k, k * 3 // 2]
        k *= 2
    return sorted({c for c in [*counts, length] if c <= length})


def _mixed(graph: CostGraph, answer: Solution, region: ScanRegion, mix: Mix) -> Solution:
    """The plan giving the scan's layers the saves of ``mix``'s groups, whose step
    measured its peak, for ``answer``'s budget and options."""
    length, parts, budget = region.length, mix.parts, answer.budget_bytes
    first = parts[0][1]
    flops = first.recompute_flops + sum(
        (plan.recompute_flops - first.recompute_flops) * n for n, plan in parts) // length
    stacked = hoisted = 0
    others: set[int] = set()
    for n, plan in parts:
        # Each group stacks its own residuals over its layers and hoists its own
        # loop-invariant ones (``layer_groups._Residuals``), as the one scan did; the
        # arguments and values outside the scan any group reads are kept once.
        group_stacked, group_hoisted, group_others = residual_parts(graph, region.index,
                                                                    plan.kept())
        stacked += group_stacked * n
        hoisted += group_hoisted
        others |= group_others
    outside = sum(graph.value_bytes[v] for v in others)
    groups = [LayerGroup(region=region.index, layers=n, saved_keys=list(plan.saved_keys))
              for n, plan in parts]
    # The record is the first group's plan (the one ``policy`` gives), with the mix's
    # figures written over it.
    return first.model_copy(update={
        "budget_bytes": budget, "options": answer.options, "status": SolveStatus.FEASIBLE,
        "recompute_flops": flops, "residual_bytes": outside + hoisted + stacked // length,
        "lower_bound_flops": 0, "gap": 1.0 if flops else 0.0, "peak_bytes": mix.peak,
        "working_bytes": None, "layer_groups": groups})
