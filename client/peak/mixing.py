"""A scan's layers planned apart, so that a plan fills the budget one policy leaves.

One policy per ``lax.scan`` moves the peak in steps of L x a tensor: on the
8-layer Llama of issue 39 a budget of 150 MiB was answered by a plan measuring
138.69 MiB, the next step up measuring 159.47. With the layers in two groups
(``client.peak.layer_groups``), k layers taking the heavier plan's saves and the
rest the lighter's, the peak moves in steps of one layer's difference.

Over the frontier of one-policy plans (per layer, residual bytes against
recompute FLOPs) the best mix within a budget is, as in any such knapsack over
counts, on the lower convex hull: two neighbouring plans, k layers of one and L - k
of the other. So the mix keeps the refined answer (``a``: fits, leaves room r) for
the first layers and, for k over 1, 2, 3, 4, 6, 8, ... up to L, asks the solver for
the plan ``b`` that would fit if k layers took it (priced at ``a``'s measured peak
+ rL/k, less ``a``'s shift between price and measurement); the ``b`` whose mix
recomputes least as priced gives the last layers its saves. The mix is compiled
and k moved by the measured peak per layer (a secant between mixes; the solver's
price per layer until two are measured), up while a layer more fits, down while it
does not, always strictly between the most layers measured to fit and the fewest measured
not to: four compiles at most, the first spent on the last layer alone, which takes
the saves of the plan recomputing least as a group of its own (on every stack
measured its residuals cost no peak: below), so that a mix has three groups, (L - 1 - k,
``a``), (k, ``b``), (1, that plan). Where the mix that fits gives every layer before the
last ``b``'s saves, ``b`` may leave room too, and those layers are mixed again from it
with the compiles left. The group that saves less goes first: the last
group's backward runs first, with every residual live (measured: 162.63 against
178.42 MiB the other way round on that stack). Giving the last layers more saves
can lower the peak (that backward's working set is smaller), and a group of one
layer is a loop XLA runs as straight-line code, off the line the other mixes make:
each mix is measured, never extrapolated from the one-policy plan.

Its price is the step compiled, as refinement's (``StepMeasure.measured_split``): one
to four compiles more than the one-policy plan. Only a step with one region, a scan
running forward and not nested in groups, is mixed; the solver's graph keeps one
decision per key, so FLOPs and residuals of the mix are its plans' per-layer
figures weighted by their layers (every free node of such a step is in its layers),
each group hoisting its own loop-invariant residuals.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import NamedTuple

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


def with_layers_apart(graph: CostGraph, regions: Sequence[Region], answer: Solution,
                      solve_at: SolveAt, measure: object) -> Solution:
    """``answer`` (refined) with its scan's layers planned apart where that recomputes
    less and fits as measured; ``answer`` itself where its step cannot take it
    (``mixable``) or no mix does better."""
    if not mixable(regions, answer, measure):
        return answer
    (region,) = regions
    assert isinstance(region, ScanRegion) and isinstance(measure, StepMeasure)
    return mixed_layers(graph, region, answer, solve_at, measure)


def mixable(regions: Sequence[Region], answer: Solution, measure: object) -> bool:
    """Whether ``answer``'s step can take its scan's layers planned apart."""
    return (len(regions) == 1 and isinstance(regions[0], ScanRegion)
            and regions[0].nestable and regions[0].length > 1
            and isinstance(measure, StepMeasure) and measure.split_peak_of is not None
            and answer.offload is None and all(k == 1 for k in answer.groups or [1])
            and answer.peak_bytes is not None and answer.peak_bytes < answer.budget_bytes)


class Mix(NamedTuple):
    """A scan's layers in groups, each a count of layers and the plan whose saves they
    take (first layers first), and the step's measured peak."""

    parts: tuple[tuple[int, Solution], ...]
    peak: int


def mixed_layers(graph: CostGraph, region: ScanRegion, answer: Solution, solve_at: SolveAt,
                 measure: StepMeasure) -> Solution:
    """``answer`` (refined, within its budget) or, where it recomputes less and fits as
    measured, a plan giving the scan's last layers the saves of plans that recompute
    less.

    The last layer first takes the saves of the plan that recomputes least, as a group of
    its own: its residuals do not reach the peak (a loop of one trip is straight-line
    code to XLA, and the last group's backward runs first), and on every stack measured
    the step dipped below ``answer``'s peak (issue 39's stack at 172.46 MiB, jax 0.12.1:
    152.34 MiB against 161.91, whichever of five plans the last layer took, where 6 + 2
    layers measured 180.66). The layers before it are then mixed in the room that
    leaves.

    Where the mix that fits gives every layer (but a last one alone) the heavier plan's
    saves, that is a plan the refinement's prices had kept out of reach, and it may leave
    room in turn: the layers are mixed again from it, within the same compiles (before
    the last layer went alone, on the 8-layer stack of tests/test_layer_groups.py at 23
    MiB, jax 0.10.2: every layer's heavier plan measured 21.37 MiB and 3.50e8 FLOPs, more
    than 22.5 MiB's answer recomputed; a mix from it, 22.91 MiB and 2.72e8)."""
    budget, lean, compiles, base = answer.budget_bytes, answer, MAX_MIX_COMPILES, answer.peak_bytes
    assert base is not None
    best: Mix | None = None
    tail: tuple[tuple[int, Solution], ...] = ()
    alone = _last_layer_alone(graph, region, answer, solve_at, measure)
    if alone is not None:
        compiles -= 1
        if alone.peak <= budget:
            best, tail, base = alone, alone.parts[-1:], alone.peak
    while compiles > 0:
        mix, used = _mix_from(graph, region, lean, tail, (base, budget), solve_at, measure,
                              compiles)
        compiles -= used
        if mix is None:
            break
        best = mix
        head = mix.parts[:len(mix.parts) - len(tail)]
        if mix.peak >= budget:
            break
        if len(head) == 1:
            # Every layer (before the tail) took the heavier plan, mixed from in turn.
            lean = head[0][1].model_copy(update={"peak_bytes": mix.peak})
        elif len(head) == 2 and head[-1][0] == 1 and not tail:
            lean, tail = head[0][1], head[-1:]
        else:
            break
        base = mix.peak
    return answer if best is None else _mixed(graph, budget, region, best)


def _last_layer_alone(graph: CostGraph, region: ScanRegion, answer: Solution,
                      solve_at: SolveAt, measure: StepMeasure) -> Mix | None:
    """The scan's layers but the last taking ``answer``'s saves, the last those of the
    plan that recomputes least, as measured; None where no plan recomputes less than
    ``answer`` or the step cannot be placed so."""
    try:
        least = solve_at(max_useful_budget(graph))
    except InfeasibleBudgetError:
        return None
    if least.recompute_flops >= answer.recompute_flops or least.groups not in (None, [1]):
        return None
    length = region.length
    peak = _measured(measure, region, ((length - 1, frozenset(answer.saved_keys)),
                                       (1, frozenset(least.saved_keys))))
    return None if peak is None else Mix(((length - 1, answer), (1, least)), peak)


def _mix_from(graph: CostGraph, region: ScanRegion, answer: Solution,
              tail: tuple[tuple[int, Solution], ...], within: tuple[int, int],
              solve_at: SolveAt, measure: StepMeasure, compiles: int) -> tuple[Mix | None, int]:
    """The mix (``mixed_layers``) that recomputes least and fits the budget as measured,
    its first layers taking ``answer``'s saves (``answer``'s measured peak one policy's)
    and the last ``tail``'s groups as they are; ``within`` is the step's measured peak
    with no layer taking the heavier saves, and the budget. At most ``compiles`` mixes
    measured; how many were. None where no mix fits."""
    assert answer.peak_bytes is not None
    (base, budget), length = within, region.length
    most = length - sum(layers for layers, _ in tail)
    # The solver's price of ``answer`` is this much under what it measured; the heavier
    # plans are taken to be too (each mix is measured before it is answered).
    shift = answer.peak_bytes - BudgetView.of(graph, None).predicted(answer.kept())
    # A group of one layer between others is straight-line code too, and measured far off
    # the line (the stack at 119.62 MiB, jax 0.12.1: 6 + 1 + 1 layers 138.04 MiB,
    # 5 + 2 + 1 123.62): before a tail, the heavier group has two layers at least.
    fewest = 2 if tail else 1
    choice = _heavier(answer, solve_at, length, (fewest, most), budget - base, shift)
    if choice is None:
        return None, 0
    heavier, layers, predicted_slope = choice
    lean, heavy = frozenset(answer.saved_keys), frozenset(heavier.saved_keys)
    tail_keys = tuple((n, frozenset(plan.saved_keys)) for n, plan in tail)
    best: Mix | None = None
    measured: dict[int, int] = {}  # layers given the heavier saves -> the step's peak
    fits, over = fewest - 1, most + 1  # the most layers measured to fit, the fewest not to
    used, chosen_again = 0, False
    while used < compiles:
        # A secant may overshoot on a peak that is not linear in k: keep k strictly
        # between what was measured to fit and what was not.
        layers = max(fits + 1, min(over - 1, layers))
        if layers >= over or layers in measured:
            break
        peak = _measured(measure, region, ((most - layers, lean), (layers, heavy), *tail_keys))
        used += 1
        if peak is None:
            break
        measured[layers] = peak
        slope = _slope(measured, layers, most, predicted_slope)
        if peak <= budget:
            parts = tuple((n, plan) for n, plan in ((most - layers, answer), (layers, heavier))
                          if n)
            best, fits = Mix(parts + tail, peak), layers
            more = int((budget - peak) // slope)
            if more < 1 or (layers == 1 and not tail):
                # A last group of one layer is off the line (``_slope``): the layers
                # before it are mixed apart from it (``mixed_layers``).
                break
            layers += more
        elif layers == fewest and best is None and not chosen_again:
            # Even the fewest layers of this plan overshoot: its price per layer was low
            # by the measured ratio. Choose again with the room scaled by it (on the
            # issue's stack at 119.62 MiB, jax 0.12.1: priced 5.75 MiB a layer, measured
            # 7.98).
            ratio = (peak - base) / layers / predicted_slope
            choice = _heavier(answer, solve_at, length, (fewest, most),
                              int((budget - base) / ratio), shift) if ratio > 1 else None
            if choice is None:
                break
            heavier, layers, predicted_slope = choice
            heavy, predicted_slope = frozenset(heavier.saved_keys), predicted_slope * ratio
            measured, fits, over, chosen_again = {}, fewest - 1, most + 1, True
        else:
            over = layers
            layers -= max(1, -int(-(peak - budget) // slope))
    return best, used


def _slope(measured: dict[int, int], layers: int, length: int, predicted: float) -> float:
    """The peak per layer given the heavier saves, from the mix measured nearest
    ``layers``; the predicted one until two are measured (or where they disagree in
    sign). Mixes with a group of one layer are not used: XLA runs a loop of one trip as
    straight-line code, and it measured off the line the others make (on the issue's
    stack, nothing_saveable then dots_saveable per layer: 110.92 MiB for 8 + 0 layers,
    109.92 for 7 + 1, then +16.9 MiB a layer from 6 + 2 to 2 + 6, and 258.71 for 1 + 7)."""
    def on_line(k: int) -> bool:
        return 2 <= k <= length - 2

    others = [k for k in measured if k != layers and on_line(k)]
    if others and on_line(layers):
        near = min(others, key=lambda k: abs(k - layers))
        slope = (measured[layers] - measured[near]) / (layers - near)
        if slope > 0:
            return slope
    return max(1.0, predicted)


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


def _heavier(answer: Solution, solve_at: SolveAt, length: int, counts: tuple[int, int],
             room: int, shift: int) -> tuple[Solution, int, float] | None:
    """The plan whose saves the last layers take, how many of them, and its predicted
    peak per layer over ``answer``'s: of the plans the solver gives where k layers of it
    would fit the ``room`` (k over a geometric series within ``counts``, the fewest and
    most layers of the scan's ``length`` it may take), the one whose mix recomputes least
    as priced."""
    fewest, most = counts
    assert answer.peak_bytes is not None
    best: tuple[float, Solution, int, float] | None = None
    seen: set[tuple[str, ...]] = set()
    for k in [k for k in _layer_counts(most) if k >= fewest]:
        try:
            heavier = solve_at(answer.peak_bytes + room * length // k - shift)
        except InfeasibleBudgetError:
            continue
        keys = tuple(heavier.saved_keys)
        if (not heavier.planned or heavier.peak_bytes is None or keys in seen
                or heavier.recompute_flops >= answer.recompute_flops
                or heavier.groups not in (None, [1])):
            continue
        seen.add(keys)
        per_layer = (heavier.peak_bytes + shift - answer.peak_bytes) / length
        if per_layer <= 0:
            continue
        layers = min(most, int(room // per_layer))
        if layers < fewest:
            continue
        flops = answer.recompute_flops + layers * (
            heavier.recompute_flops - answer.recompute_flops) / length
        if best is None or flops < best[0]:
            best = (flops, heavier, layers, per_layer)
    return None if best is None else best[1:]


def _layer_counts(length: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... up to the scan's length: how many layers a heavier
    plan may be given."""
    counts, k = [1, 2, 3], 4
    while k < length:
        counts += [k, k * 3 // 2]
        k *= 2
    return sorted({c for c in [*counts, length] if c <= length})


def _mixed(graph: CostGraph, budget: int, region: ScanRegion, mix: Mix) -> Solution:
    """The plan giving the scan's layers the saves of ``mix``'s groups (every layer one
    plan's, placed as groups are, where it has one group), whose step measured its peak."""
    length, parts = region.length, mix.parts
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
        "budget_bytes": budget, "status": SolveStatus.FEASIBLE,
        "recompute_flops": flops, "residual_bytes": outside + hoisted + stacked // length,
        "lower_bound_flops": 0, "gap": 1.0 if flops else 0.0, "peak_bytes": mix.peak,
        "working_bytes": None, "layer_groups": groups})
