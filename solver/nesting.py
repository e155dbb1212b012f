"""Nested checkpoints: a region's layers in k rematerialised groups.

With a checkpoint per layer, a scan of L layers still holds L layer inputs
for the backward pass, and a peak can fall no lower than that plus one
layer's working set. An outer scan over k groups of L/k layers, each group
rematerialised and each layer keeping its own policy inside, holds k group
inputs and, while a group's backward pass runs, that group's layers:

    peak(k, plan) = held + working set + residuals outside the region
                    + k x one layer's input                     (the groups' inputs)
                    + 1/k x the region's stacked residuals     (one group's)
                    + L/k x one layer's parameters and gradients (the outer scan
                      copies a group's slice of them)

and each group's forward pass runs once more: + the region's forward FLOPs.
Measured on 64 Llama-style layers (bench/peak.py): 122.2 MiB of temp bytes
with a checkpoint per layer, 100.4 / 85.3 / 83.8 MiB in 4 / 8 / 16 groups,
each predicted to 0.01 MiB by the sum above. A group count must divide L: a
remainder group is a slice of the stacked parameters, which XLA copies (45
to 58 MiB on that stack, more than nesting saves).

For every group count a region can take (``candidate_groups``) the search is
the same MILP on a view of the graph (``BudgetView.of(graph, memory, groups)``);
the plan with the fewest FLOPs, the extra forward pass included, is the answer,
ties to fewer groups. Regions are nested one at a time (the others per layer):
a step with several scans of layers is searched region by region, not jointly.

With offload (``solver.offload``) the levers are chosen together: the plan per
layer may offload, nested groups do not (``lever_options``: a group's
checkpoint recomputes its layers' residuals, so there is nothing per layer to
offload across its boundary), and the answer is the candidate that adds the
fewest estimated seconds, a nested one priced at its FLOPs over the device's
rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from optiremat.solver.graph import CostGraph
from optiremat.solver.offload import OffloadReport
from optiremat.solver.semantics import evaluate
from optiremat.solver.solution import InfeasibleBudgetError, Solution, SolveOptions, SolveStatus
from optiremat.solver.step import Memory

Groups = tuple[int, ...]


def candidate_groups(graph: CostGraph) -> list[Groups]:
    """Per layer everywhere first, then each nestable region in each group count it takes
    (divisors of its length from 2 to half of it: smaller or larger gain nothing)."""
    step = graph.step
    assert step is not None
    plain = (1,) * len(step.regions)
    candidates = [plain]
    for r, region in enumerate(step.regions):
        if not region.nestable:
            continue
        for k in range(2, region.length // 2 + 1):
            if region.length % k == 0:
                candidates.append(plain[:r] + (k,) + plain[r + 1:])
    return candidates


def nests(graph: CostGraph, memory: Memory, options: SolveOptions) -> bool:
    """Whether a solve of ``graph`` has group counts to choose from: a peak budget,
    with ``options.nest`` on."""
    return (options.nest and memory == Memory.PEAK and graph.step is not None
            and len(candidate_groups(graph)) > 1)


def lever_options(options: SolveOptions, groups: Sequence[int]) -> SolveOptions:
    """What the candidate ``groups`` is solved with: nested groups offload nothing."""
    if options.offload is not None and any(k != 1 for k in groups):
        return options.model_copy(update={"offload": None})
    return options


def nested_nodes(graph: CostGraph, groups: Sequence[int]) -> list[int]:
    """The nodes the extra forward pass of nested groups runs: every one of a nested region."""
    regions = graph.node_region or [-1] * graph.num_nodes
    nested = {r for r, k in enumerate(groups) if k != 1}
    return [n for n, r in enumerate(regions) if r in nested]


def forward_flops(graph: CostGraph, groups: Sequence[int]) -> int:
    """The FLOPs of the extra forward pass nested groups run."""
    return sum(graph.node_flops[n] for n in nested_nodes(graph, groups))


def choose_groups(graph: CostGraph, budget: int, options: SolveOptions,
                  solve_with: Callable[[Groups], Solution]) -> Solution:
    """The cheapest of the solves at every candidate group count.

    Each candidate is solved as ``solve_with(groups)`` with ``lever_options``
    (raising InfeasibleBudgetError when nothing fits); its recompute FLOPs and
    bound count the extra forward pass, and with offload requested (``options``)
    it is priced in estimated seconds. The answer is proven optimal only when no
    other candidate's bound is lower.
    """
    answers: list[tuple[Groups, Solution]] = []
    smallest: int | None = None
    for groups in candidate_groups(graph):
        try:
            answer = solve_with(groups)
        except InfeasibleBudgetError as err:
            smallest = err.min_budget_bytes if smallest is None \
                else min(smallest, err.min_budget_bytes)
            continue
        answers.append((groups, _as_requested(_with_groups(graph, answer, groups), options)))
    if not answers:
        assert smallest is not None
        raise InfeasibleBudgetError(budget, smallest)
    planned = [(g, a) for g, a in answers if a.planned]
    if not planned:  # every search stopped before a plan
        return answers[0][1]
    groups, best = min(planned, key=lambda ga: (_cost(ga[1]), sum(ga[0])))
    bound = min(_bound(a) for _, a in planned)
    if bound < _bound(best):
        cost = _cost(best)
        gap = (cost - bound) / cost if cost else 0.0
        status = SolveStatus.OPTIMAL if bound >= cost else SolveStatus.FEASIBLE
        update: dict[str, object] = {"gap": gap, "status": status}
        if options.offload is None or best.offload is None:
            update["lower_bound_flops"] = int(bound)
        else:  # the bound is in seconds: lower_bound_flops in FLOP-equivalents
            update["lower_bound_flops"] = math.floor(bound * options.offload.device_flop_rate)
            update["offload"] = best.offload.model_copy(update={"lower_bound_seconds": bound})
        best = best.model_copy(update=update)
    return best


def _cost(answer: Solution) -> float:
    """What the choice minimises: estimated seconds with offload, else recompute FLOPs."""
    return answer.offload.estimated_seconds if answer.offload else answer.recompute_flops


def _bound(answer: Solution) -> float:
    return answer.offload.lower_bound_seconds if answer.offload else answer.lower_bound_flops


def _as_requested(answer: Solution, options: SolveOptions) -> Solution:
    """A candidate solved without offload, reported as the offload request it answers:
    nothing on the host, its FLOPs at the device's rate (no transfers to overlap)."""
    offload = options.offload
    if offload is None or answer.offload is not None:
        return answer
    rate = offload.device_flop_rate
    return answer.model_copy(update={"options": options, "offload": OffloadReport(
        host_bytes=0, transfer_bytes=0, estimated_seconds=answer.recompute_flops / rate,
        lower_bound_seconds=answer.lower_bound_flops / rate)})


def _with_groups(graph: CostGraph, answer: Solution, groups: Groups) -> Solution:
    if all(k == 1 for k in groups):
        return answer
    extra = forward_flops(graph, groups)
    update: dict[str, object] = {
        "groups": list(groups), "recompute_flops": answer.recompute_flops + extra,
        "lower_bound_flops": answer.lower_bound_flops + extra}
    if answer.planned:
        update["residual_bytes"] = nested_residual_bytes(
            graph, answer.kept(), groups)
    return answer.model_copy(update=update)


def nested_residual_bytes(graph: CostGraph, saves: Sequence[bool], groups: Sequence[int]) -> int:
    """What the nested step's forward pass leaves for its backward pass: a nested
    region keeps only its groups' inputs; inside a group, everything is recomputed."""
    step = graph.step
    assert step is not None
    stacked_by = graph.value_region or [-1] * graph.num_values
    node_region = graph.node_region or [-1] * graph.num_nodes

    def inside_a_nested_region(v: int) -> bool:
        producer = graph.producer[v]
        regions = {stacked_by[v], -1 if producer is None else node_region[producer]}
        return any(r >= 0 and groups[r] != 1 for r in regions)

    kept = {v for v in evaluate(graph, saves).residuals if not inside_a_nested_region(v)}
    # A group's checkpoint keeps every argument its layers' equations read (their
    # parameters; the first group's input is among the groups' inputs below).
    arguments = {graph.value_index[v] for v in graph.inputs}
    for n, inputs in enumerate(graph.node_inputs):
        if graph.node_key[n] and node_region[n] >= 0 and groups[node_region[n]] != 1:
            kept |= arguments.intersection(inputs)
    return sum(graph.value_bytes[v] for v in kept) + sum(
        k * region.carry_bytes for region, k in zip(step.regions, groups, strict=True) if k != 1)


def min_budget_over_groups(graph: CostGraph, least_with: Callable[[Groups], int]) -> int:
    """The smallest budget any candidate group count fits."""
    return min(least_with(groups) for groups in candidate_groups(graph))
