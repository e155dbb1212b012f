"""A scan's layers planned apart, so that a plan fills the budget one policy leaves.

One policy per ``lax.scan`` moves the peak in steps of L x a tensor: on the
8-layer Llama of issue 39 a budget of 150 MiB was answered by a plan measuring
138.69 MiB, the next step up measuring 159.47. With the layers in two groups
(``client.peak.layer_groups``), k layers taking the heavier plan's saves and the
rest the lighter's, the peak moves in steps of one layer's difference.

Over the frontier of one-policy plans (per layer, residual bytes against
recompute FLOPs) the best mix within a budget is, as in any such knapsack over
counts, on the lower convex hull: two neighbouring plans, k layers of one and L - k
of the other. So the mix takes the refined answer (``a``, fits, leaves room) and
the plan the solver gives where L layers of that room would go (``b``, recomputes
less), measures ``b``, and gives the last k layers ``b``'s saves, k from the
measured difference per layer; the mix is compiled and k moved down while it does
not fit (and up while a layer more would). The group that saves less goes first:
the last group's backward runs first, with every residual live (measured: 162.63
against 178.42 MiB the other way round on that stack).

Its price is the step compiled, as refinement's (``StepMeasure.measured_split``): two
to four compiles more than the one-policy plan. Only a step with one region, a scan
running forward and not nested in groups, is mixed; the solver's graph keeps one
decision per key, so FLOPs and residuals of the mix are the two plans' per-layer
figures weighted by their layers (every free node of such a step is in its layers),
each group hoisting its own loop-invariant residuals.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from optiremat.client.peak.measures import StepMeasure
from optiremat.client.peak.refine import SolveAt
from optiremat.client.peak.regions import Region
from optiremat.client.peak.scan_region import ScanRegion
from optiremat.solver.graph import CostGraph
from optiremat.solver.peak import BudgetView
from optiremat.solver.semantics import evaluate
from optiremat.solver.solution import InfeasibleBudgetError, LayerGroup, Solution, SolveStatus

# Compiles of mixes, at most, after the heavier plan's.
MAX_MIX_COMPILES = 3


def mixable(regions: Sequence[Region], answer: Solution, measure: object) -> bool:
    """Whether ``answer``'s step can take its scan's layers planned apart."""
    return (len(regions) == 1 and isinstance(regions[0], ScanRegion)
            and regions[0].nestable and regions[0].length > 1
            and isinstance(measure, StepMeasure) and measure.split_peak_of is not None
            and answer.offload is None and all(k == 1 for k in answer.groups or [1])
            and answer.peak_bytes is not None and answer.peak_bytes < answer.budget_bytes)


def mixed_layers(graph: CostGraph, region: ScanRegion, answer: Solution, solve_at: SolveAt,
                 measure: StepMeasure) -> Solution:
    """``answer`` (refined, within its budget) or, where it recomputes less and fits as
    measured, a plan giving the scan's last layers the saves of a plan that recomputes
    less."""
    assert answer.peak_bytes is not None
    budget, length, lean_peak = answer.budget_bytes, region.length, answer.peak_bytes
    room = budget - lean_peak
    # The solver's price of ``answer`` is this much under what it measured; the heavier
    # plans are taken to be too (their mix is measured before it is answered).
    shift = lean_peak - BudgetView.of(graph, None).predicted(answer.kept())
    choice = _heavier(answer, solve_at, length, room, shift)
    if choice is None:
        return answer
    heavier, layers, per_layer = choice
    lean, heavy = frozenset(answer.saved_keys), frozenset(heavier.saved_keys)
    best: Solution | None = None
    best_layers = 0
    tried: set[int] = set()
    for _ in range(MAX_MIX_COMPILES):
        if not 0 < layers < length or layers in tried:
            break
        tried.add(layers)
        try:
            peak = measure.measured_split(((length - layers, lean), (layers, heavy)))
        except Exception as err:  # the one-policy plan stands; say why it was kept
            warnings.warn(f"the layers of the {region.describe()} could not be planned "
                          f"apart ({type(err).__name__}: {err}); the plan keeps one policy "
                          "per stack", RuntimeWarning, stacklevel=4)
            break
        per_layer = max(1.0, (peak - lean_peak) / layers)  # this compile's own slope
        if peak <= budget:
            if layers > best_layers:
                best = _mixed(graph, answer, heavier, region, layers, peak)
                best_layers = layers
            if peak + per_layer > budget:
                break
            layers += 1
        else:
            layers -= max(1, -int(-(peak - budget) // per_layer))
    return best if best is not None else answer


def _heavier(answer: Solution, solve_at: SolveAt, length: int, room: int,
             shift: int) -> tuple[Solution, int, float] | None:
    """The plan whose saves the last layers take, how many of them, and its predicted
    peak per layer over ``answer``'s: of the plans the solver gives where k layers of it
    would fit the room (k over a geometric series up to the scan's length), the one whose
    mix recomputes least as priced."""
    assert answer.peak_bytes is not None
    best: tuple[float, Solution, int, float] | None = None
    seen: set[tuple[str, ...]] = set()
    for k in _layer_counts(length):
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
        layers = min(length - 1, int(room // per_layer))
        if layers < 1:
            continue
        flops = answer.recompute_flops + layers * (
            heavier.recompute_flops - answer.recompute_flops) / length
        if best is None or flops < best[0]:
            best = (flops, heavier, layers, per_layer)
    return None if best is None else best[1:]


def _layer_counts(length: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ...: how many layers a heavier plan may be given."""
    counts, k = [1, 2, 3], 4
    while k < length:
        counts += [k, k * 3 // 2]
        k *= 2
    return sorted({c for c in counts if c < length})


def _mixed(graph: CostGraph, lean: Solution, heavy: Solution, region: ScanRegion,
           layers: int, peak: int) -> Solution:
    """The plan giving the last ``layers`` of the scan ``heavy``'s saves and the others
    ``lean``'s, whose step measured ``peak``."""
    length = region.length
    flops = lean.recompute_flops + (
        heavy.recompute_flops - lean.recompute_flops) * layers // length
    stacked_lean, hoisted_lean, outside = _residual_parts(graph, region.index, lean.kept())
    stacked_heavy, hoisted_heavy, _ = _residual_parts(graph, region.index, heavy.kept())
    # Each group stacks its own residuals over its layers and hoists its own
    # loop-invariant ones (``layer_groups._Residuals``), as the one scan did.
    residual_bytes = (outside + hoisted_lean + hoisted_heavy
                      + (stacked_lean * (length - layers) + stacked_heavy * layers) // length)
    groups = [LayerGroup(region=region.index, layers=length - layers,
                         saved_keys=list(lean.saved_keys)),
              LayerGroup(region=region.index, layers=layers, saved_keys=list(heavy.saved_keys))]
    return lean.model_copy(update={
        "status": SolveStatus.FEASIBLE, "recompute_flops": flops,
        "residual_bytes": residual_bytes, "lower_bound_flops": 0,
        "gap": 1.0 if flops else 0.0, "peak_bytes": peak, "working_bytes": None,
        "layer_groups": groups})


def _residual_parts(graph: CostGraph, region: int, kept: list[bool]) -> tuple[int, int, int]:
    """The residual bytes of the plan keeping ``kept``: stacked over the region's layers,
    made in the region once (loop-invariant, hoisted), and the rest."""
    stacked = hoisted = other = 0
    value_region = graph.value_region or [-1] * graph.num_values
    node_region = graph.node_region or [-1] * graph.num_nodes
    for v in evaluate(graph, kept).residuals:
        producer = graph.producer[v]
        if value_region[v] == region:
            stacked += graph.value_bytes[v]
        elif producer is not None and node_region[producer] == region:
            hoisted += graph.value_bytes[v]
        else:
            other += graph.value_bytes[v]
    return stacked, hoisted, other
