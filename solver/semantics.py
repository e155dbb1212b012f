"""The executable definition of what a plan costs under JAX's remat rules.

``evaluate`` is the one place that turns decisions into residual bytes and
recompute FLOPs. The MILP is a formulation of it; tests check the two agree and
that both agree with ``jax.ad_checkpoint.saved_residuals``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from optiremat.solver.graph import CostGraph, NodeMode


@dataclass(frozen=True)
class Evaluation:
    residual_bytes: int
    backward_flops: int  # FLOPs of every node that runs in the backward pass
    residuals: tuple[int, ...]  # value positions
    active: tuple[int, ...]  # node positions that run in the backward pass
    needed: tuple[int, ...] = ()  # value positions the backward pass needs (residual or rebuilt)


def effective_saves(graph: CostGraph, saved: Sequence[bool]) -> list[bool]:
    """Apply forced modes on top of the per-node choice."""
    out = []
    for mode, s in zip(graph.node_mode, saved, strict=True):
        out.append(True if mode == NodeMode.SAVE else False if mode == NodeMode.RECOMPUTE
                   else bool(s))
    return out


def evaluate(graph: CostGraph, saved: Sequence[bool]) -> Evaluation:
    """Residuals and backward FLOPs when node ``n`` is saved iff ``saved[n]``."""
    return _propagate(graph, effective_saves(graph, saved))


def _propagate(graph: CostGraph, save: Sequence[bool]) -> Evaluation:
    producer = graph.producer
    carry_of: dict[int, list[int]] = {}
    for cin, cout in zip(graph.carry_in, graph.carry_out, strict=True):
        carry_of.setdefault(graph.value_index[cin], []).append(graph.value_index[cout])

    needed = [False] * graph.num_values
    active = [False] * graph.num_nodes
    stack = [graph.value_index[v] for v in graph.backward_reads]
    while stack:
        v = stack.pop()
        if needed[v]:
            continue
        needed[v] = True
        stack.extend(carry_of.get(v, ()))
        p = producer[v]
        if p is not None and not save[p] and not active[p]:
            active[p] = True
            stack.extend(graph.node_inputs[p])

    residuals = tuple(v for v in range(graph.num_values)
                      if needed[v] and ((p := producer[v]) is None or save[p]))
    active_nodes = tuple(n for n in range(graph.num_nodes) if active[n])
    return Evaluation(
        residual_bytes=sum(graph.value_bytes[v] for v in residuals),
        backward_flops=sum(graph.node_flops[n] for n in active_nodes),
        residuals=residuals,
        active=active_nodes,
        needed=tuple(v for v in range(graph.num_values) if needed[v]),
    )


def baseline_backward_flops(graph: CostGraph) -> int:
    """Backward FLOPs under JAX's ``everything_saveable`` (``baseline_evaluation``)."""
    return baseline_evaluation(graph).backward_flops


def baseline_evaluation(graph: CostGraph) -> Evaluation:
    """The plan of JAX's ``everything_saveable``.

    That policy saves every equation it is offered (every node with a key, even
    one a names policy would force to recompute); nodes without a key are fixed
    by JAX itself and stay as they are. Recompute FLOPs of a plan are its
    backward FLOPs minus this: the work the plan adds over saving everything.
    """
    save = [bool(key) or mode != NodeMode.RECOMPUTE
            for key, mode in zip(graph.node_key, graph.node_mode, strict=True)]
    return _propagate(graph, save)


def kept_anyway(graph: CostGraph, keys: Iterable[str]) -> frozenset[str]:
    """Those of ``keys`` that, saved alone, cost what saving nothing costs: the same
    residual bytes and backward FLOPs (a checkpoint's own input, named: the value or its
    name kept in its place). Saving one buys nothing, and JAX adds an op on each value a
    policy saves (a ``reduce_precision``)."""
    def cost(saved: Sequence[bool]) -> tuple[int, int]:
        ev = evaluate(graph, saved)
        return ev.residual_bytes, ev.backward_flops

    nothing = cost([False] * graph.num_nodes)
    return frozenset(key for key in keys
                     if cost([k == key for k in graph.node_key]) == nothing)


def recompute_flops(graph: CostGraph, saved: Sequence[bool]) -> int:
    return evaluate(graph, saved).backward_flops - baseline_backward_flops(graph)
