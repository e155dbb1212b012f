"""Baselines computed on the graph: JAX's built-in policies and a greedy knapsack.

Each baseline is a set of save decisions evaluated with ``semantics.evaluate``
(forced modes applied), so its bytes and FLOPs are in the same units as a
plan's and a Solution can say how far each is from the optimum.

* ``everything_saveable``, ``nothing_saveable``: save every free node, or none.
* ``dots_saveable``: save ``dot_general`` and ``conv_general_dilated`` nodes.
* ``dots_with_no_batch_dims_saveable``: save ``dot_general`` nodes without batch
  dimensions; needs the graph's optional ``node_batch_dims`` column and is left
  out when the graph lacks it.
* ``greedy_knapsack``: policy keys (what a stateless policy can express) in
  decreasing order of recompute FLOPs avoided per residual byte, each saved
  when the plan still fits the budget, judged by ``evaluate``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, StrictInt

from optiremat.solver.graph import CostGraph, NodeMode
from optiremat.solver.semantics import baseline_backward_flops, evaluate

DOTS = frozenset({"dot_general", "conv_general_dilated", "scaled_matmul_wrapper"})
# JAX's built-in policies (jax.checkpoint_policies), most memory first.
BUILTIN_POLICIES = ("everything_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
                    "nothing_saveable")
GREEDY_CANDIDATES = 512  # keys the greedy knapsack tries, best ratio first


class BaselineResult(BaseModel):
    """One baseline's cost on the graph, and how it compares with a plan."""

    model_config = ConfigDict(frozen=True)

    name: str
    residual_bytes: StrictInt
    recompute_flops: StrictInt
    fits_budget: bool
    # recompute FLOPs beyond the plan's (negative: the baseline recomputes less,
    # which it can only do with more bytes than the budget allows)
    extra_flops: StrictInt
    # extra_flops relative to the baseline's own recompute FLOPs (0 when both are 0)
    relative_gap: float


def policy_saves(graph: CostGraph) -> dict[str, list[bool]]:
    """Per built-in policy the graph can express, its save flag for every node."""
    prims = graph.node_primitive
    saves = {
        "everything_saveable": [True] * graph.num_nodes,
        "nothing_saveable": [False] * graph.num_nodes,
        "dots_saveable": [p in DOTS for p in prims],
    }
    if graph.node_batch_dims is not None:
        saves["dots_with_no_batch_dims_saveable"] = [
            p == "dot_general" and dims == 0
            for p, dims in zip(prims, graph.node_batch_dims, strict=True)
        ]
    return saves


def offered_saves(graph: CostGraph, saves: Sequence[bool]) -> list[bool]:
    """``saves`` restricted to what a policy is offered: a node without a policy key
    is never asked, so a policy applied to the step cannot save it; nor can the plan's
    policy save a node its graph recomputes whatever it decides (a names-only plan's
    unnamed values)."""
    return [s and bool(key) and mode != NodeMode.RECOMPUTE
            for s, key, mode in zip(saves, graph.node_key, graph.node_mode, strict=True)]


def builtin_offered_saves(graph: CostGraph) -> dict[str, list[bool]]:
    """Per built-in policy the graph can express, what it saves of what it is offered
    (``policy_saves`` through ``offered_saves``): the built-in applied to the step."""
    return {name: offered_saves(graph, saves) for name, saves in policy_saves(graph).items()}


def builtin_named_saves(graph: CostGraph) -> dict[str, list[bool]]:
    """Per built-in policy, where the plan decides named values only (a names-only graph:
    every other node recomputed whatever it decides), the names it would keep: a name
    saved where the equation whose value it names is saved by the built-in, as MaxText's
    ``minimal`` names the dots ``dots_with_no_batch_dims_saveable`` saves."""
    producer, inputs = graph.producer, graph.node_inputs

    def named(n: int, saves: Sequence[bool]) -> bool:
        return (graph.node_primitive[n] == "name" and graph.node_mode[n] == NodeMode.FREE
                and any(p is not None and saves[p] for p in (producer[v] for v in inputs[n])))

    return {name: [named(n, saves) for n in range(graph.num_nodes)]
            for name, saves in policy_saves(graph).items()}


def greedy_saves(graph: CostGraph, budget_bytes: int) -> list[bool]:
    """The greedy FLOPs-per-byte knapsack over policy keys (key-less nodes alone)."""
    groups: dict[str, list[int]] = {}
    for n in range(graph.num_nodes):
        if graph.node_mode[n] == NodeMode.FREE and graph.node_flops[n] > 0:
            groups.setdefault(graph.node_key[n] or f"#node {graph.node_id[n]}", []).append(n)
    outs = graph.node_outputs

    def ratio(item: tuple[str, list[int]]) -> tuple[float, str]:
        nodes = item[1]
        flops = sum(graph.node_flops[n] for n in nodes)
        nbytes = sum(graph.value_bytes[v] for n in nodes for v in outs[n])
        return (-flops / max(nbytes, 1), item[0])

    saved = [False] * graph.num_nodes
    if evaluate(graph, saved).residual_bytes > budget_bytes:
        return saved
    for _, nodes in sorted(groups.items(), key=ratio)[:GREEDY_CANDIDATES]:
        trial = list(saved)
        for n in nodes:
            trial[n] = True
        if evaluate(graph, trial).residual_bytes <= budget_bytes:
            saved = trial
    return saved


def compare(
    graph: CostGraph,
    budget_bytes: int,
    plan_recompute_flops: int,
    names: Sequence[str] | None = None,
) -> list[BaselineResult]:
    """Every baseline the graph can express against a plan's recompute FLOPs, by name."""
    saves = policy_saves(graph)
    saves["greedy_knapsack"] = greedy_saves(graph, budget_bytes)
    base = baseline_backward_flops(graph)
    results = []
    for name in sorted(saves):
        if names is not None and name not in names:
            continue
        ev = evaluate(graph, saves[name])
        flops = ev.backward_flops - base
        extra = flops - plan_recompute_flops
        results.append(BaselineResult(
            name=name,
            residual_bytes=ev.residual_bytes,
            recompute_flops=flops,
            fits_budget=ev.residual_bytes <= budget_bytes,
            extra_flops=extra,
            relative_gap=extra / flops if flops else 0.0,
        ))
    return results
