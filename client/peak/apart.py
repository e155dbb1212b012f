"""A refined plan, then its layers planned apart where one policy leaves room.

Refinement (``client.peak.refine``) answers a budget with one policy for every layer.
Where that answer leaves part of the budget unused, the layers of its step take saves
of their own: a ``lax.scan``'s layers in groups (``client.peak.mixing``), or the blocks
of a run of repeated blocks in straight-line code one by one
(``client.peak.block_mixing``). Either fills the budget finer than refinement's own
search for room, so refinement leaves that search to them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from optiremat.client.peak.block_mixing import block_mixable, mixed_blocks
from optiremat.client.peak.measures import PeakMeasure, StepMeasure
from optiremat.client.peak.mixing import mixable, mixed_layers
from optiremat.client.peak.refine import SolveAt, refined_solve
from optiremat.client.peak.regions import Region
from optiremat.client.peak.scan_region import ScanRegion
from optiremat.solver.graph import CostGraph
from optiremat.solver.solution import Solution


def refined_and_mixed(graph: CostGraph, regions: Sequence[Region], budget: int,
                      solve_at: SolveAt, solve_unnested: SolveAt, measure: PeakMeasure | None,
                      presets: Sequence[Sequence[bool]], layer_groups: bool) -> Solution:
    """The plan at ``budget`` refined against ``measure`` (``refine.refined_solve``) and,
    with ``layer_groups``, its layers planned apart (``with_layers_apart``), whose plans
    ``solve_unnested`` solves: as ``solve_at`` does, choosing no nesting."""
    answer = refined_solve(graph, regions, budget, solve_at, measure, presets,
                           _not_mixed(layer_groups, regions, measure))
    if not layer_groups:
        return answer
    return with_layers_apart(graph, regions, answer, solve_unnested, measure)


def with_layers_apart(graph: CostGraph, regions: Sequence[Region], answer: Solution,
                      solve_at: SolveAt, measure: object) -> Solution:
    """``answer`` (refined) with its scan's layers, or its repeated blocks, planned apart
    where that recomputes less and fits as measured; ``answer`` itself where its step
    cannot take it or no mix does better. ``solve_at`` solves the step's graph with the
    answer's options but nesting (a mix's plans checkpoint each layer): on the scan
    corpus's ViT a solve choosing nesting took 0.29 s, six solves of one plan each."""
    if mixable(regions, answer, measure):
        (region,) = regions
        assert isinstance(region, ScanRegion) and isinstance(measure, StepMeasure)
        return mixed_layers(graph, region, answer, solve_at, measure)
    if block_mixable(regions, answer, measure):
        assert isinstance(measure, StepMeasure)
        return mixed_blocks(graph, regions, answer, solve_at, measure)
    return answer


def _not_mixed(layer_groups: bool, regions: Sequence[Region],
               measure: object) -> Callable[[Solution], bool]:
    """Whether refinement should bisect for room (``refine._Refinement._fill``) under its
    answer so far: not where the answer's layers are mixed next, which fills the budget
    finer (``layer_groups``: they may be)."""
    return lambda answer: not (layer_groups and (mixable(regions, answer, measure)
                                                 or block_mixable(regions, answer, measure)))
