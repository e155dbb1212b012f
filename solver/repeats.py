"""Identical repeated layers, solved once with a multiplicity (tied plans only).

(Just over 400 lines on purpose: finding the copies, checking every condition below
and folding the graph are one proof, read top to bottom.)

An unrolled stack of identical layers is a chain of copies ``C_1 .. C_K`` of
one subgraph between a prefix and a suffix (which may hold a first or last
layer that differs). Under a tied plan every copy makes the same decisions, so
a copy behaves like its neighbours except through the values that cross
between them. When exactly one value crosses into each copy (a transformer's
residual stream; or none at all), whether a copy's outgoing value is needed outside it is one
bit, and the copy turns that bit into the bit it passes back (its incoming
value needed) by a monotone function ``F`` of one bit, the same for every copy:
constant 0, constant 1 or the identity. Every such ``F`` has
``F(F(x)) == F(x)``: whatever the suffix needs of ``C_K``, the copies
``C_1 .. C_{K-1}`` are all told the same bit, the one ``C_K`` passes back.
Their needed values, recomputes and residuals are then the same, and ``C_1``
with its FLOPs and bytes multiplied by ``K - 1`` stands for all of them
*exactly*, for every tied decision vector. The folded graph keeps the prefix,
that representative, ``C_K`` (now reading the representative) and the suffix;
the tied MILP on it has the optimum and bound of the full one. ``FoldedSearch``
searches it and prices the answer on the full graph again, where the two prices
must agree to the byte and FLOP.

The conditions are checked, not assumed: the copies are identical node for
node (policy key, primitive, FLOPs, mode, output bytes, backward reads, and
where every input comes from), each reads exactly one value from before it
(for ``C_2 .. C_K``, the same value of the copy before) and nothing of any
other copy or of the prefix, values of ``C_1 .. C_{K-1}`` are read only by
their own copy and the next, a graph input a copy reads is its own (read by
nothing outside it) or read by the backward pass anyway, no loop carry touches
a copy, and every free node in a copy has a policy key (a keyless node decides
per node even when tied).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from optiremat.solver.baselines import compare
from optiremat.solver.graph import CostGraph, NodeMode
from optiremat.solver.offload import evaluate_offload
from optiremat.solver.semantics import baseline_backward_flops
from optiremat.solver.solution import Solution

if TYPE_CHECKING:
    from optiremat.solver.search import Search

T = TypeVar("T")

RECENT_FOLDS = 4  # graphs whose fold is kept for the next request
MIN_COPIES = 3  # with two, the folded graph keeps both
PERIOD_CANDIDATES = 6  # most frequent distances between equal nodes, tried as the period
CUTS_TRIED = 3  # where a copy begins: the narrowest cuts through the repeated stretch
MAX_STRIDE = 4  # a node found up to this many times per copy still reveals the period


@dataclass(frozen=True)
class Repeats:
    """``copies`` identical copies of ``period`` nodes, the first at node position ``start``."""

    start: int
    period: int
    copies: int

    def copy_of(self, n: int) -> int | None:
        i = (n - self.start) // self.period
        return i if n >= self.start and i < self.copies else None

    @property
    def multiplicity(self) -> int:
        """Copies the representative (the first copy) stands for: all but the last."""
        return self.copies - 1


@dataclass(frozen=True)
class Compressed:
    graph: CostGraph
    kept: tuple[int, ...]  # original node position of each compressed node
    repeats: Repeats

    def restrict(self, saves: list[bool]) -> list[bool]:
        """Per node saves of the full graph, on the compressed one."""
        return [saves[n] for n in self.kept]

    def expand(self, decisions: Sequence[T]) -> list[T]:
        """Per node decisions of the compressed graph, on the full one: a dropped
        copy decides as the representative (the first copy) does."""
        r = self.repeats
        full: list[T | None] = [None] * (len(self.kept) + (r.copies - 2) * r.period)
        for n, d in zip(self.kept, decisions, strict=True):
            full[n] = d
        for n, decided in enumerate(full):
            if decided is None:
                full[n] = full[r.start + (n - r.start) % r.period]
        return cast(list[T], full)


def compress(graph: CostGraph) -> Compressed | None:
    """The graph with its repeated layers folded into one, or None when it has none
    that fold exactly (see the module docstring).

    The last few answers are kept by content hash: a frontier sweep asks for the
    same graph once per budget.
    """
    key = graph.content_hash
    if key not in _RECENT:
        repeats = find_repeats(graph)
        _RECENT[key] = None if repeats is None else Compressed(*_fold(graph, repeats), repeats)
        while len(_RECENT) > RECENT_FOLDS:
            del _RECENT[next(iter(_RECENT))]
    return _RECENT[key]


_RECENT: dict[str, Compressed | None] = {}


# ---- finding the copies ---------------------------------------------------------


def _signatures(graph: CostGraph) -> list[int]:
    """Per node, an id equal for nodes that look the same apart from their edges."""
    reads = set(graph.backward_reads)
    ids: dict[tuple[object, ...], int] = {}
    out = []
    for n in range(graph.num_nodes):
        outs = graph.node_outputs[n]
        sig = (
            graph.node_key[n],
            graph.node_primitive[n],
            graph.node_flops[n],
            graph.node_mode[n],
            len(graph.node_inputs[n]),
            tuple((graph.value_bytes[v], graph.value_id[v] in reads) for v in outs),
        )
        out.append(ids.setdefault(sig, len(ids)))
    return out


def _longest_run(sig: list[int], p: int) -> tuple[int, int]:
    """(length, first position) of the longest run of ``sig[n] == sig[n + p]``."""
    best, best_at, run = 0, 0, 0
    for n in range(len(sig) - p):
        run = run + 1 if sig[n] == sig[n + p] else 0
        if run > best:
            best, best_at = run, n - run + 1
    return best, best_at


def _periods(sig: list[int]) -> list[tuple[int, int, int]]:
    """Candidate (period, first node, nodes covered), longest periodic stretch first."""
    # A node that occurs c times in each copy recurs after the period every c-th time.
    seen: dict[int, list[int]] = {}
    gaps: Counter[int] = Counter()
    for n, s in enumerate(sig):
        before = seen.setdefault(s, [])
        for stride in range(1, min(len(before), MAX_STRIDE) + 1):
            gaps[n - before[-stride]] += 1
        before.append(n)
    found = []
    for p, _ in sorted(gaps.items(), key=lambda item: (-item[1], item[0]))[:PERIOD_CANDIDATES]:
        run, at = _longest_run(sig, p)
        found.append((p, at, run + p))
    return sorted(found, key=lambda f: (-f[2], f[0]))


def _narrowest_cuts(graph: CostGraph, lo: int, hi: int, period: int) -> list[int]:
    """Cut positions in ``[lo, lo + period)``, those the fewest values cross first."""
    last_read = [-1] * graph.num_values
    for n in range(graph.num_nodes):
        for v in graph.node_inputs[n]:
            last_read[v] = n
    crossing = [0] * (graph.num_nodes + 1)
    for v, p in enumerate(graph.producer):
        if p is not None and last_read[v] > p:
            crossing[p + 1] += 1
            crossing[last_read[v] + 1] -= 1
    width, widths = 0, []
    for c in range(hi):
        width += crossing[c]
        widths.append(width)
    cuts = sorted(range(lo, min(lo + period, hi)), key=lambda c: (widths[c], c))[:CUTS_TRIED]
    # And where the repetition begins, last: a layer whose insides nothing reads is
    # narrowest inside itself (a property test's [a(x), a, a, z] layers folded nowhere).
    return cuts if lo in cuts else [*cuts, lo]


def find_repeats(graph: CostGraph) -> Repeats | None:
    """The copies of a repeated layer that fold exactly, or None."""
    for period, first, covered in _periods(_signatures(graph)):
        for start in _narrowest_cuts(graph, first, first + covered, period):
            copies = (first + covered - start) // period
            # The first or last layer often differs in its wiring (it reads a graph
            # input, or the loss reads it): then leave it to the prefix or suffix.
            for skip_first, skip_last in ((0, 0), (1, 0), (0, 1), (1, 1)):
                repeats = Repeats(start + skip_first * period, period,
                                  copies - skip_first - skip_last)
                if repeats.copies >= MIN_COPIES and why_not_folded(graph, repeats) is None:
                    return repeats
    return None


def _input_readers(graph: CostGraph, r: Repeats) -> dict[int, set[int | None]]:
    """Graph input -> the copies reading it (None: a node outside the copies).

    An input read by exactly one copy is that copy's own; any other input is
    shared, and folding keeps it as it is.
    """
    readers: dict[int, set[int | None]] = {}
    for n in range(graph.num_nodes):
        for v in graph.node_inputs[n]:
            if graph.producer[v] is None:
                readers.setdefault(v, set()).add(r.copy_of(n))
    return readers


def _own_input(readers: dict[int, set[int | None]], v: int) -> int | None:
    """The copy an input belongs to, or None when it is shared or read by no copy."""
    copies = readers.get(v, set())
    return next(iter(copies)) if len(copies) == 1 else None


def why_not_folded(graph: CostGraph, r: Repeats) -> str | None:
    """Why the copies do not fold exactly (see the module docstring), or None."""
    producer, ins, outs = graph.producer, graph.node_inputs, graph.node_outputs
    carried = {graph.value_index[v] for v in (*graph.carry_in, *graph.carry_out)}
    reads = set(graph.backward_reads)
    end = r.start + r.copies * r.period
    readers = _input_readers(graph, r)
    crossing: dict[int, set[int]] = {}  # copy -> the values from before it that it reads
    entry: set[tuple[int, int]] = set()  # where in the copy before, for copies 2 .. K
    shape: list[tuple[tuple[object, ...], ...]] = []  # the first copy's inputs, per offset
    for n in range(r.start, end):
        i, j = divmod(n - r.start, r.period)
        if graph.node_mode[n] == NodeMode.FREE and not graph.node_key[n]:
            return f"node {graph.node_id[n]} in copy {i} is free without a policy key"
        if any(v in carried for v in (*ins[n], *outs[n])):
            return f"node {graph.node_id[n]} in copy {i} touches a loop carry"
        described: list[tuple[object, ...]] = []
        for v in ins[n]:
            p = producer[v]
            if p is None:
                read = graph.value_id[v] in reads
                described.append(("own", graph.value_bytes[v], read)
                                 if _own_input(readers, v) is not None else ("shared", v))
                continue
            source = r.copy_of(p)
            if source == i:
                described.append(("copy", p - n, outs[p].index(v)))
            elif (i == 0 and p < r.start) or (i > 0 and source == i - 1):
                crossing.setdefault(i, set()).add(v)
                if i > 0:
                    entry.add(((p - r.start) % r.period, outs[p].index(v)))
                described.append(("crossing",))
            else:
                return (f"node {graph.node_id[n]} in copy {i} reads node {graph.node_id[p]}, "
                        "outside its copy and the one before")
        if i == 0:
            shape.append(tuple(described))
        elif shape[j] != tuple(described):
            return f"node {graph.node_id[n]} in copy {i} is wired unlike its twin in copy 0"
    # A shared graph input is needed if any of its readers needs it, unless the
    # backward pass reads it anyway: then it is needed whatever the copies do.
    for v, copies in readers.items():
        inside = [c for c in copies if c is not None]
        if inside and len(copies) > 1 and graph.value_id[v] not in reads:
            where = " and outside them" if None in copies else ""
            return f"graph input {graph.value_id[v]} is read by copies {sorted(inside)}{where}"
    # One bit crossing per copy (or none: the copies do not interact at all).
    counts = {len(crossing.get(i, ())) for i in range(r.copies)}
    if counts not in ({0}, {1}):
        return f"the copies read {sorted(counts)} values from before them, not one each"
    if len(entry) > 1:
        return "the copies read different values of the copy before them"
    # Values of every copy but the last may be read only by their own copy and the next.
    for n in range(end, graph.num_nodes):
        for v in ins[n]:
            p = producer[v]
            source = None if p is None else r.copy_of(p)
            if source is not None and source != r.copies - 1:
                return f"node {graph.node_id[n]} after the copies reads copy {source}"
    return None


# ---- the compressed graph -------------------------------------------------------


def _fold(graph: CostGraph, r: Repeats) -> tuple[CostGraph, tuple[int, ...]]:
    """Copies 1 .. K-2 dropped, copy 0 scaled by ``K - 1``, copy K-1 reading copy 0.

    (Long on purpose: every column of the graph is rewritten in one pass over the
    same maps of dropped nodes and values, so that no column can disagree.)"""
    k = r.multiplicity

    def dropped(copy: int | None) -> bool:
        return copy is not None and 1 <= copy <= r.copies - 2

    producer = graph.producer
    # The last copy reads the crossing value of the copy before it; the
    # representative's stands in for it.
    last = r.start + (r.copies - 1) * r.period
    rewire: dict[int, int] = {}
    for n in range(last, last + r.period):
        for v in graph.node_inputs[n]:
            p = producer[v]
            if p is not None and r.copy_of(p) == r.copies - 2:
                q = p - (r.copies - 2) * r.period
                rewire[v] = graph.node_outputs[q][graph.node_outputs[p].index(v)]

    keep_nodes = [n for n in range(graph.num_nodes) if not dropped(r.copy_of(n))]
    # A value belongs to its producer's copy, a graph input to the one copy reading it.
    readers = _input_readers(graph, r)
    keep_value = [True] * graph.num_values
    value_scale = [1] * graph.num_values
    for v in range(graph.num_values):
        p = producer[v]
        copy = r.copy_of(p) if p is not None else _own_input(readers, v)
        if dropped(copy):
            keep_value[v] = False
        elif copy == 0:
            value_scale[v] = k
    kept_values = [v for v in range(graph.num_values) if keep_value[v]]

    ids = graph.value_id
    input_ptr, output_ptr = [0], [0]
    input_ids: list[int] = []
    output_ids: list[int] = []
    for n in keep_nodes:
        input_ids.extend(ids[rewire.get(v, v)] for v in graph.node_inputs[n])
        input_ptr.append(len(input_ids))
        output_ids.extend(ids[v] for v in graph.node_outputs[n])
        output_ptr.append(len(output_ids))
    kept_ids = {ids[v] for v in kept_values}
    folded = CostGraph(
        name=graph.name,
        value_id=[ids[v] for v in kept_values],
        value_bytes=[graph.value_bytes[v] * value_scale[v] for v in kept_values],
        value_shape=[graph.value_shape[v] for v in kept_values],
        value_dtype=[graph.value_dtype[v] for v in kept_values],
        node_id=[graph.node_id[n] for n in keep_nodes],
        node_primitive=[graph.node_primitive[n] for n in keep_nodes],
        node_key=[graph.node_key[n] for n in keep_nodes],
        node_flops=[graph.node_flops[n] * (k if r.copy_of(n) == 0 else 1) for n in keep_nodes],
        node_mode=[graph.node_mode[n] for n in keep_nodes],
        node_repeat=[graph.node_repeat[n] for n in keep_nodes],
        node_source=[graph.node_source[n] for n in keep_nodes],
        input_ptr=input_ptr,
        input_ids=input_ids,
        output_ptr=output_ptr,
        output_ids=output_ids,
        inputs=[v for v in graph.inputs if v in kept_ids],
        backward_reads=[v for v in graph.backward_reads if v in kept_ids],
        carry_in=list(graph.carry_in),
        carry_out=list(graph.carry_out),
        node_batch_dims=(
            None if graph.node_batch_dims is None
            else [graph.node_batch_dims[n] for n in keep_nodes]
        ),
    )
    return folded, tuple(keep_nodes)


# ---- searching the folded graph -------------------------------------------------


class FoldedSearch:
    """A tied search on the folded graph that answers for the full one.

    A start plan is restricted to the folded graph; the answer is expanded onto
    the full graph and priced there again, where the two prices must agree to
    the byte and FLOP (device and host bytes alike).
    """

    def __init__(self, graph: CostGraph, folded: Compressed, inner: Search) -> None:
        self.graph = graph
        self.folded = folded
        self.baseline = baseline_backward_flops(graph)
        self.inner = inner

    def restart_clock(self, started: float) -> None:
        self.inner.restart_clock(started)

    def solve(self, budget: int, start: Sequence[bool] | None = None) -> Solution:
        inner_start = None if start is None else self.folded.restrict(list(start))
        return self._unfold(self.inner.solve(budget, inner_start), budget)

    def min_budget(self) -> int:
        return self.inner.min_budget()

    def _unfold(self, answer: Solution, budget: int) -> Solution:
        update: dict[str, Any] = {"graph_hash": self.graph.content_hash}
        if answer.planned:
            unfolded = answer.model_copy(
                update={"node_decisions": self.folded.expand(answer.node_decisions)})
            plan = evaluate_offload(self.graph, unfolded.kept(), unfolded.offloaded())
            recompute = plan.evaluation.backward_flops - self.baseline
            assert (plan.device_bytes, plan.host_bytes, recompute) == (
                answer.residual_bytes, answer.host_bytes, answer.recompute_flops,
            ), "the folded graph priced the plan differently from the full graph"
            update["node_decisions"] = unfolded.node_decisions
            if answer.baselines is not None:
                update["baselines"] = compare(self.graph, budget, recompute)
        return answer.model_copy(update=update)
