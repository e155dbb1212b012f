"""Repeated blocks of straight-line code planned apart, so that a plan fills its budget.

Layers a Python loop unrolled are blocks of straight-line code (``BlockRegion``), one
region each, but equal blocks have equal policy keys, so the solver's tied plan gives
every block the same saves and its peak moves in steps of the run's length x a
tensor, as one policy per ``lax.scan`` does (``client.peak.mixing``). Here the blocks
of the longest run of equal ones take saves of their own: the last ``k`` blocks those
of a one-policy plan recomputing less, the others the refined answer's. Each block is
its own ``jax.checkpoint`` already, so placing a mix is giving each its own policy
(``Placement``'s ``layer_policies``, one group of one per block), and nothing about
the program's structure changes.

A block's nodes are its own in the step's graph, so a mix's saves are exact per node
(each block's nodes as its plan decides them): its recompute FLOPs and residual bytes
are the graph's, not an estimate. Its peak is priced as the answer's measured peak
plus the residual bytes the mix adds, at a level learnt per heavier plan from the mixes
measured (the backward of the last blocks runs first, and saves there can shrink their
recomputation's working set as much as they add). Every mix answered is measured:
rounds compile the mix recomputing least that the line puts within the budget, and
learn, ``MAX_MIX_COMPILES`` compiles at most.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import NamedTuple

from optiremat.client.peak.block_region import BlockRegion
from optiremat.client.peak.measures import BlockSplit, StepMeasure
from optiremat.client.peak.mixing import MAX_MIX_COMPILES, layer_counts, price_shift
from optiremat.client.peak.refine import SolveAt
from optiremat.client.peak.regions import Region
from optiremat.solver.graph import CostGraph
from optiremat.solver.semantics import baseline_backward_flops, evaluate
from optiremat.solver.solution import InfeasibleBudgetError, LayerGroup, Solution, SolveStatus
from optiremat.solver.solve import max_useful_budget


def repeated_run(regions: Sequence[Region]) -> list[BlockRegion]:
    """The longest run of equal blocks (the same program), in program order; empty
    where no two blocks are equal."""
    runs: dict[tuple, list[BlockRegion]] = {}
    for region in regions:
        if isinstance(region, BlockRegion):
            runs.setdefault(region.program, []).append(region)
    longest = max(runs.values(), key=len, default=[])
    return longest if len(longest) >= 2 else []


def block_mixable(regions: Sequence[Region], answer: Solution, measure: object) -> bool:
    """Whether ``answer``'s step can take its repeated blocks planned apart."""
    return (bool(repeated_run(regions)) and isinstance(measure, StepMeasure)
            and measure.blocks_peak_of is not None and answer.planned
            and not answer.no_checkpoint and answer.offload is None
            and not answer.layer_groups and all(k == 1 for k in answer.groups or [1])
            and answer.peak_bytes is not None and answer.peak_bytes < answer.budget_bytes)


class _Mix(NamedTuple):
    """The run's last ``heavier`` blocks taking ``plan``'s saves, the others the
    answer's; the mix's recompute FLOPs and residual bytes."""

    heavier: int
    plan: Solution
    flops: int
    residual_bytes: int


def mixed_blocks(graph: CostGraph, regions: Sequence[Region], answer: Solution,
                 solve_at: SolveAt, measure: StepMeasure) -> Solution:
    """``answer`` (refined, within its budget) or, where it recomputes less and fits as
    measured, a plan giving the last blocks of its longest run of equal blocks the saves
    of a plan recomputing less (the module docstring)."""
    run = repeated_run(regions)
    lean = evaluate(graph, answer.kept())
    mixes = _mixes(graph, run, answer, _plans_above(graph, answer, solve_at, len(run)))
    # Per heavier plan (its saved keys), what its mixes measured beyond the line (the
    # answer's measured peak plus the residual bytes a mix adds): the highest stands; a
    # plan not yet measured takes the highest of any.
    levels: dict[tuple[str, ...], int] = {}
    best: tuple[_Mix, int] | None = None

    def line(mix: _Mix) -> int:
        assert answer.peak_bytes is not None
        return answer.peak_bytes + mix.residual_bytes - lean.residual_bytes

    def predicted(mix: _Mix) -> int:
        level = levels.get(tuple(mix.plan.saved_keys), max(levels.values(), default=0))
        return line(mix) + level

    for _ in range(MAX_MIX_COMPILES):
        bound = best[0].flops if best is not None else answer.recompute_flops
        choice = next((m for m in mixes
                       if m.flops < bound and predicted(m) <= answer.budget_bytes), None)
        if choice is None:
            break
        mixes.remove(choice)
        peak = _measured(measure, run, answer, choice)
        if peak is None:
            break
        keys = tuple(choice.plan.saved_keys)
        levels[keys] = max(peak - line(choice), levels.get(keys, peak - line(choice)))
        if peak <= answer.budget_bytes:
            best = (choice, peak)
    return answer if best is None else _mixed(answer, run, *best, lean.residual_bytes)


def _plans_above(graph: CostGraph, answer: Solution, solve_at: SolveAt,
                 length: int) -> list[Solution]:
    """One-policy plans recomputing less than ``answer`` that k of the ``length`` blocks
    could take within the budget's room (k = 1, 2, 3, 4, 6, 8, ... length), and the plan
    recomputing least (solved at the graph's largest useful budget)."""
    assert answer.peak_bytes is not None
    room = answer.budget_bytes - answer.peak_bytes
    shift = price_shift(graph, answer)
    counts = sorted({1, *layer_counts(length)})
    budgets = [answer.peak_bytes + room * length // k - shift for k in counts]
    found: dict[tuple[str, ...], Solution] = {}
    for budget in [*budgets, max_useful_budget(graph)]:
        try:
            plan = solve_at(budget)
        except InfeasibleBudgetError:
            continue
        if (plan.planned and plan.recompute_flops < answer.recompute_flops
                and plan.groups in (None, [1]) and plan.offload is None):
            found.setdefault(tuple(plan.saved_keys), plan)
    return list(found.values())


def _mixes(graph: CostGraph, run: Sequence[BlockRegion], answer: Solution,
           plans: Sequence[Solution]) -> list[_Mix]:
    """Every mix of ``plans`` over the run's last 1 .. len(run) blocks (all of them:
    what refinement's search for room would try, left to the mix), recomputing less
    than ``answer``: cheapest first (of equal FLOPs, fewer bytes)."""
    node_region = graph.node_region or [-1] * graph.num_nodes
    lean = answer.kept()
    baseline = baseline_backward_flops(graph)
    mixes = []
    for plan in plans:
        heavy = plan.kept()
        for k in range(1, len(run) + 1):
            last = {region.index for region in run[len(run) - k:]}
            kept = tuple(heavy[n] if node_region[n] in last else lean[n]
                         for n in range(graph.num_nodes))
            evaluation = evaluate(graph, kept)
            flops = evaluation.backward_flops - baseline
            if flops < answer.recompute_flops:
                mixes.append(_Mix(k, plan, flops, evaluation.residual_bytes))
    return sorted(mixes, key=lambda m: (m.flops, m.residual_bytes))


def block_split(plan: Solution) -> BlockSplit:
    """A plan whose blocks are planned apart (``layer_groups``), as the step's measure
    takes it: its own keys for every other region, and each block's."""
    return _split_of(plan.saved_keys, plan.layer_groups or [])


def _split_of(keys: Sequence[str], groups: Sequence[LayerGroup]) -> BlockSplit:
    return frozenset(keys), tuple((g.region, frozenset(g.saved_keys)) for g in groups)


def _groups(answer: Solution, run: Sequence[BlockRegion], mix: _Mix) -> list[LayerGroup]:
    """One group of one layer per block of the run, in program order: the answer's saves,
    then the last ``mix.heavier`` blocks' those of ``mix.plan``."""
    first = len(run) - mix.heavier
    return [LayerGroup(region=region.index, layers=1,
                       saved_keys=list((answer if i < first else mix.plan).saved_keys))
            for i, region in enumerate(run)]


def _measured(measure: StepMeasure, run: Sequence[BlockRegion], answer: Solution,
              mix: _Mix) -> int | None:
    """The step's peak with ``mix`` placed; None, with a warning, where it cannot be."""
    try:
        return measure.measured_blocks(_split_of(answer.saved_keys, _groups(answer, run, mix)))
    except Exception as err:  # the one-policy plan stands; say why it was kept
        warnings.warn(f"the repeated blocks ({run[0].describe()} and the rest) could not be "
                      f"planned apart ({type(err).__name__}: {err}); the plan keeps one "
                      "policy for them", RuntimeWarning, stacklevel=5)
        return None


def _mixed(answer: Solution, run: Sequence[BlockRegion], mix: _Mix, peak: int,
           lean_residual_bytes: int) -> Solution:
    """The plan giving the run's blocks the saves of ``mix`` (``_groups``), whose step
    measured ``peak``, for ``answer``'s budget and options. The record is the answer's,
    with the mix's figures over it (its residual bytes moved by what the mix adds to the
    answer's own in the graph, ``lean_residual_bytes``: in the answer's terms)."""
    added = mix.residual_bytes - lean_residual_bytes
    return answer.model_copy(update={
        "status": SolveStatus.FEASIBLE, "recompute_flops": mix.flops,
        "residual_bytes": answer.residual_bytes + added, "lower_bound_flops": 0,
        "gap": 1.0 if mix.flops else 0.0, "peak_bytes": peak, "working_bytes": None,
        "layer_groups": _groups(answer, run, mix)})
