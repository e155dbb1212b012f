"""Repeated blocks in straight-line code: layers a Python loop unrolled.

A model whose layers run in a Python loop traces to one long run of equations
in which the same unit (a layer's equations: the same primitives on values of
the same types) comes back to back ``n`` times. This module finds such runs in
a sequence of equation signatures, in time near-linear in its length:

1. candidate periods come from the *anchors* (equations that hold a matmul or
   a convolution, what makes a layer worth checkpointing): per signature, the
   most frequent distance between consecutive occurrences, rarest first;
2. for a period ``p``, one pass finds the maximal stretches where
   ``signature[i] == signature[i + p]``; a stretch of ``L >= p`` matches is
   ``(L + p) // p`` copies of a unit of ``p`` equations;
3. a run may gain a copy at either end that is alike only in its anchors (the
   first block of a decoder reads the embedding through a transpose the others
   do not need; the last feeds the final norm): the positions just before (after)
   it holding the unit's anchors in order, from (to) the nearest boundary that
   crosses no more than the run's own boundaries do;
4. of the offsets where the copies may start, the one giving the most copies,
   extensions included, is taken, then the one whose boundaries cross the fewest
   bytes (the residual stream, not a layer's insides: a pre-norm layer's midpoint
   crosses as little as its ends, and only its ends let the first layer extend),
   then the one whose boundaries cut the fewest name scopes (a module's path);
5. the longest run is kept and the rest of the sequence searched again.

It knows nothing of JAX: signatures are hashables, ``crossing[b]`` the bytes
live across the boundary before position ``b`` (``len(crossing) == n + 1``),
``shared[b]`` how many name scopes the positions either side of it share.
Positions that must not be part of a block (scans, the user's checkpoints)
carry signatures no other position has, and ``free`` false.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

# Periods tried per stretch of the sequence: the most frequent anchor distances.
CANDIDATE_PERIODS = 3


@dataclass(frozen=True)
class Run:
    """``count`` consecutive copies of a unit of ``period`` positions from ``start``, with
    a copy alike only in its anchors of ``head`` positions just before them and one of
    ``tail`` positions just after (0: none)."""

    start: int
    period: int
    count: int
    head: int = 0
    tail: int = 0

    @property
    def begin(self) -> int:
        return self.start - self.head

    @property
    def end(self) -> int:
        return self.start + self.period * self.count + self.tail

    def units(self) -> list[tuple[int, int]]:
        """Each copy's positions, as ``(start, end)``, the head and tail included."""
        exact = [(self.start + k * self.period, self.start + (k + 1) * self.period)
                 for k in range(self.count)]
        head = [(self.begin, self.start)] if self.head else []
        tail = [(exact[-1][1], self.end)] if self.tail else []
        return head + exact + tail


def repeated_runs(signatures: Sequence[Hashable], anchors: Sequence[bool],
                  crossing: Sequence[int], free: Sequence[bool] | None = None,
                  shared: Sequence[int] | None = None) -> list[Run]:
    """The runs of at least two copies of a unit holding an anchor, in order, disjoint;
    no copy holds a position ``free`` marks false (all are free by default). Where
    boundaries cross bytes alike, those cutting fewest scopes (``shared[b]``: how many
    the positions either side of boundary ``b`` share, a module path's depth) bound the
    copies."""
    n = len(signatures)
    if (len(crossing) != n + 1 or len(anchors) != n or (free is not None and len(free) != n)
            or (shared is not None and len(shared) != n + 1)):
        raise ValueError("one anchor (and free) flag per signature and one crossing per "
                         "boundary (and one count of shared scopes)")
    seq = _Sequence(signatures, anchors, crossing, [True] * n if free is None else free,
                    [0] * (n + 1) if shared is None else shared)
    found: list[Run] = []
    stack = [(0, len(signatures))]
    while stack:
        lo, hi = stack.pop()
        run = seq.longest_run(lo, hi)
        if run is None:
            continue
        found.append(run)
        stack.extend([(lo, run.begin), (run.end, hi)])
    return sorted(found, key=lambda r: r.start)


def _candidate_periods(signatures: Sequence[Hashable], anchors: Sequence[bool],
                       lo: int, hi: int) -> list[int]:
    """Per anchor signature, its most frequent distance between consecutive occurrences;
    the rarest signatures' first: an equation that occurs once per layer (the output
    projection) spaces its occurrences by the layer, where three alike ones (the query,
    key and value projections) space theirs by less."""
    where: dict[Hashable, list[int]] = {}
    for i in range(lo, hi):
        if anchors[i]:
            where.setdefault(signatures[i], []).append(i)
    modal: list[tuple[int, int]] = []  # (occurrences, period)
    for positions in where.values():
        if len(positions) >= 2:
            distances = Counter(b - a for a, b in zip(positions, positions[1:], strict=False))
            modal.append((len(positions), distances.most_common(1)[0][0]))
    periods: list[int] = []
    for _, p in sorted(modal, key=lambda m: (m[0], -m[1])):
        if p not in periods:
            periods.append(p)
    return periods[:CANDIDATE_PERIODS]


@dataclass(frozen=True)
class _Sequence:
    signatures: Sequence[Hashable]
    anchors: Sequence[bool]
    crossing: Sequence[int]
    free: Sequence[bool]
    shared: Sequence[int]

    def longest_run(self, lo: int, hi: int) -> Run | None:
        best: Run | None = None
        for p in _candidate_periods(self.signatures, self.anchors, lo, hi):
            i = lo
            while i + p < hi:
                if self.signatures[i] != self.signatures[i + p]:
                    i += 1
                    continue
                a = i
                while i + p < hi and self.signatures[i] == self.signatures[i + p]:
                    i += 1
                run = self.placed(a, i - a, p, lo, hi)
                if run is not None and (best is None or run.end - run.begin
                                        > best.end - best.begin):
                    best = run
        return best

    def placed(self, a: int, matches: int, p: int, lo: int, hi: int) -> Run | None:
        """The copies in the stretch ``[a, a + matches + p)`` and the near copies next to
        them: the most there are, starting where the boundaries cross the fewest bytes."""
        covered = matches + p
        options = []
        for offset in range(min(p, covered - 2 * p + 1)):
            start = a + offset
            run = Run(start, p, (covered - offset) // p)
            if not any(self.anchors[start:start + p]):
                continue
            run = self.extended(run, lo, hi)
            units = run.units()
            options.append((-len(units), self.crossing[run.begin] + self.crossing[run.end],
                            sum(self.shared[b] for b, _ in units) + self.shared[run.end],
                            offset, run))
        return min(options, key=lambda o: o[:4])[4] if options else None

    def extended(self, run: Run, lo: int, hi: int) -> Run:
        """``run`` with a near copy before and after it, where there is one: the positions
        holding the unit's anchors in order (signatures equal), every position free, out to
        the nearest boundary crossing no more bytes than the run's own widest boundary."""
        unit = range(run.start, run.start + run.period)
        wanted = [self.signatures[i] for i in unit if self.anchors[i]]
        widest = max(self.crossing[b] for b in range(run.start, run.end + 1, run.period))
        reach = 2 * run.period  # a near copy is no longer than two copies
        head = self._near_copy(range(run.start - 1, max(lo, run.start - reach) - 1, -1),
                               wanted[::-1], widest)
        tail = self._near_copy(range(run.end, min(hi, run.end + reach)), wanted, widest)
        return Run(run.start, run.period, run.count,
                   head=0 if head is None else run.start - head,
                   tail=0 if tail is None else tail - run.end)

    def _near_copy(self, positions: range, wanted: list[Hashable], widest: int) -> int | None:
        """Walking ``positions`` away from a run, the boundary where a copy holding the
        anchors ``wanted`` (in walking order) ends: None where the anchors differ, a
        position is not free, or no boundary past the last anchor is narrow enough."""
        step = positions.step
        met = 0
        for i in positions:
            if not self.free[i]:
                return None
            if self.anchors[i]:
                if met == len(wanted) or self.signatures[i] != wanted[met]:
                    return None
                met += 1
            if met == len(wanted):
                # the boundary on the far side of position i
                boundary = i if step < 0 else i + 1
                if self.crossing[boundary] <= widest:
                    return boundary
        return None


def crossing_bytes(defined: Sequence[int], last_read: Sequence[int], nbytes: Sequence[int],
                   n: int) -> list[int]:
    """Per boundary ``b`` (before position ``b``, ``0..n``), the bytes of the values made
    at a position ``< b`` and read at one ``>= b``: value ``k`` is made at
    ``defined[k]`` and last read at ``last_read[k]`` (``n`` for an output)."""
    delta = [0] * (n + 2)
    for d, u, size in zip(defined, last_read, nbytes, strict=True):
        if u > d:
            delta[d + 1] += size
            delta[u + 1] -= size
    out, live = [], 0
    for b in range(n + 1):
        live += delta[b]
        out.append(live)
    return out

