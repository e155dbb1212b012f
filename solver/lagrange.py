"""Lagrangian bounds and plans for untied solves, by minimum cut.

Pricing bytes at ``lam`` FLOPs each, the best untied plan minimises
``backward_flops + lam * residual_bytes``, and that problem is a minimum cut.
Give each value a 0-1 ``needed`` and each node a 0-1 ``recomputed``; then

* a backward read is needed; a recomputed node needs its inputs; a needed
  ``carry_in`` needs its ``carry_out``; a forced recompute's needed output
  makes it run (implications ``x -> y``: infinite arcs ``x -> y``);
* a recomputed node costs its FLOPs (arc ``recomputed -> sink``);
* a needed value costs ``lam * bytes`` unless its producer is recomputed (arc
  ``needed -> recomputed[producer]``; for a graph input, ``needed -> sink``).

Every plan is such an assignment with exactly its cost, and every assignment,
read as "recompute the nodes marked recomputed", is a plan costing no more (its
true needed values and running nodes are subsets of the marked ones). So the
cut's optimum *is* the Lagrangian optimum ``L(lam)``, for any graph, and
``L(lam) - lam * budget`` bounds the FLOPs of every plan within ``budget``.
Capacities are rounded down to integers, which only lowers every plan's
price: the bound stays valid. ``bound_and_plans`` walks ``lam`` along the
lower convex hull of the (bytes, FLOPs) frontier to the edge over the budget,
so its bound is the LP bound of the covering formulation, at a few cuts' cost.
The plans it meets, and mixes of the two that straddle the budget, are starts
for the MILP.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from ortools.graph.python import max_flow  # type: ignore[import-untyped]

from optiremat.solver.graph import CostGraph, NodeMode
from optiremat.solver.semantics import evaluate

SCALE = 2**60  # finite capacities of one cut sum to at most this
INFINITE = 2**62
MAX_CUTS = 40  # a hull walk needs a handful; this only stops a pathological one


@dataclass(frozen=True)
class Point:
    saves: tuple[bool, ...]
    backward_flops: int
    residual_bytes: int

    @classmethod
    def priced(cls, graph: CostGraph, saves: list[bool]) -> Point:
        ev = evaluate(graph, saves)
        return cls(tuple(saves), ev.backward_flops, ev.residual_bytes)


@dataclass(frozen=True)
class Bound:
    """What the walk found for one budget."""

    backward_flops: int  # no plan within the budget runs fewer backward FLOPs
    best: Point | None  # the cheapest plan met within the budget
    cuts: int


class CutModel:
    """The network of one graph, built once; ``minimize`` prices it for one ``lam``."""

    def __init__(self, graph: CostGraph) -> None:
        self.graph = graph
        nv, nn = graph.num_values, graph.num_nodes
        source, sink, one = 0, 1, 2

        def needed(v: int) -> int:
            return 3 + v

        def recomputed(n: int) -> int:
            return 3 + nv + n

        tails: list[int] = [source]
        heads: list[int] = [one]
        idx = graph.value_index
        for v in graph.backward_reads:
            tails.append(one)
            heads.append(needed(idx[v]))
        for n in range(nn):
            for u in graph.node_inputs[n]:
                tails.append(recomputed(n))
                heads.append(needed(u))
        for cin, cout in zip(graph.carry_in, graph.carry_out, strict=True):
            tails.append(needed(idx[cin]))
            heads.append(needed(idx[cout]))
        modes = graph.node_mode
        for n in range(nn):
            if modes[n] == NodeMode.SAVE:
                tails.append(recomputed(n))
                heads.append(sink)
        fixed = len(tails)
        flop_arcs, byte_arcs = [], []
        for n in range(nn):
            if graph.node_flops[n]:
                tails.append(recomputed(n))
                heads.append(sink)
                flop_arcs.append(n)
        forced: list[tuple[int, int]] = []
        for v, p in enumerate(graph.producer):
            if p is not None and modes[p] == NodeMode.RECOMPUTE:
                forced.append((needed(v), recomputed(p)))
            elif graph.value_bytes[v]:
                tails.append(needed(v))
                heads.append(sink if p is None else recomputed(p))
                byte_arcs.append(v)
        for tail, head in forced:
            tails.append(tail)
            heads.append(head)

        self._flow = max_flow.SimpleMaxFlow()
        arcs = self._flow.add_arcs_with_capacity(
            np.array(tails, dtype=np.int32),
            np.array(heads, dtype=np.int32),
            np.full(len(tails), INFINITE, dtype=np.int64),
        )
        arcs = np.asarray(arcs, dtype=np.int32)
        self._flop_arcs = arcs[fixed:fixed + len(flop_arcs)]
        self._byte_arcs = arcs[fixed + len(flop_arcs):fixed + len(flop_arcs) + len(byte_arcs)]
        self._flops = [graph.node_flops[n] for n in flop_arcs]
        self._bytes = [graph.value_bytes[v] for v in byte_arcs]
        self._first_node = 3 + nv

    def minimize(self, lam: Fraction) -> tuple[Point, Fraction]:
        """The cut's plan for ``lam`` and a lower bound on ``L(lam)``."""
        n, d = lam.numerator, lam.denominator
        total = d * sum(self._flops) + n * sum(self._bytes)  # d * (flops + lam * bytes)
        total = max(total, 1)
        self._flow.set_arcs_capacity(
            self._flop_arcs,
            np.array([SCALE * d * f // total for f in self._flops], dtype=np.int64),
        )
        self._flow.set_arcs_capacity(
            self._byte_arcs,
            np.array([SCALE * n * b // total for b in self._bytes], dtype=np.int64),
        )
        status = self._flow.solve(0, 1)
        if status != self._flow.OPTIMAL:
            raise RuntimeError(f"max flow failed with status {status}")
        lower = Fraction(self._flow.optimal_flow() * total, SCALE * d)
        side = np.asarray(self._flow.get_source_side_min_cut())
        nodes = side[(side >= self._first_node)] - self._first_node
        saves = [True] * self.graph.num_nodes
        for m in nodes[nodes < self.graph.num_nodes]:
            saves[int(m)] = False
        return Point.priced(self.graph, saves), lower


def bound_and_plans(graph: CostGraph, budget: int, deadline: float | None = None,
                    model: CutModel | None = None) -> Bound:
    """The Lagrangian bound on backward FLOPs within ``budget``, and the best plan met."""
    model = model or CutModel(graph)
    cuts = 0
    best_bound = Fraction(0)
    fits: list[Point] = []

    def price(lam: Fraction) -> tuple[Point, Fraction]:
        nonlocal cuts, best_bound
        cuts += 1
        point, lower = model.minimize(lam)
        best_bound = max(best_bound, lower - lam * budget)
        if point.residual_bytes <= budget:
            fits.append(point)
        return point, lower

    def result() -> Bound:
        best = min(fits, key=lambda p: (p.backward_flops, p.residual_bytes), default=None)
        bound = -(-best_bound.numerator // best_bound.denominator)  # FLOPs are integers
        if best is not None:
            bound = min(bound, best.backward_flops)
        return Bound(bound, best, cuts)

    low, _ = price(Fraction(0))  # fewest FLOPs: everything saved that helps
    if low.residual_bytes <= budget:
        return result()
    # A byte dearer than every FLOP: the fewest bytes.
    high, _ = price(Fraction(sum(graph.node_flops) + 1))
    if high.residual_bytes > budget:
        return result()  # no plan fits; the caller reports the budget infeasible
    while cuts < MAX_CUTS and (deadline is None or time.monotonic() < deadline):
        if high.backward_flops <= low.backward_flops:
            break
        # The slope between the two: a plan below that line is a hull point between.
        lam = Fraction(high.backward_flops - low.backward_flops,
                       low.residual_bytes - high.residual_bytes)
        point, lower = price(lam)
        line = low.backward_flops + lam * low.residual_bytes
        if lower >= line or point in (low, high):
            break  # low-high is an edge of the hull: the bound at ``lam`` is final
        if point.residual_bytes > budget:
            low = point
        else:
            high = point
    fits.extend(_mixes(graph, low, high, budget, deadline))
    return result()


def _mixes(graph: CostGraph, low: Point, high: Point, budget: int,
           deadline: float | None) -> list[Point]:
    """Plans between the hull's two ends: ``high`` with a prefix of the pieces in
    which ``low`` differs switched to ``low``'s choice.

    Hull points are sparse: on a stack of identical layers, neighbouring ones
    differ in the same change made in every layer. Switching the changes piece
    by piece (pieces: the differing nodes, connected through the graph's edges,
    in program order) walks from one to the other in small steps; a binary
    search finds the longest prefix that fits, every candidate priced exactly.
    """
    differ = [n for n in range(graph.num_nodes) if low.saves[n] != high.saves[n]]
    if not differ:
        return []
    parent = {n: n for n in differ}

    def root(n: int) -> int:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    producer = graph.producer
    for n in differ:
        for v in graph.node_inputs[n]:
            p = producer[v]
            if p is not None and p in parent:
                parent[root(n)] = root(p)
    pieces: dict[int, list[int]] = {}
    for n in differ:
        pieces.setdefault(root(n), []).append(n)
    order = sorted(pieces.values(), key=lambda nodes: nodes[0])

    def mixed(count: int) -> Point:
        saves = list(high.saves)
        for nodes in order[:count]:
            for n in nodes:
                saves[n] = low.saves[n]
        return Point.priced(graph, saves)

    found: list[Point] = []
    lo, hi = 0, len(order)  # the prefix of length lo fits (it is ``high``)
    while hi - lo > 1 and (deadline is None or time.monotonic() < deadline):
        mid = (lo + hi) // 2
        point = mixed(mid)
        if point.residual_bytes <= budget:
            found.append(point)
            lo = mid
        else:
            hi = mid
    return found
