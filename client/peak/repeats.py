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
3. of the offsets where the copies may start, the one whose boundaries cross
   the fewest bytes (the residual stream, not a layer's insides) is taken;
4. the longest run is kept and the rest of the sequence searched again.

It knows nothing of JAX: signatures are hashables, ``crossing[b]`` the bytes
live across the boundary before position ``b`` (``len(crossing) == n + 1``).
Positions that must not be part of a block (scans, the user's checkpoints)
carry signatures no other position has.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

# Periods tried per stretch of the sequence: the most frequent anchor distances.
CANDIDATE_PERIODS = 3


@dataclass(frozen=True)
class Run:
    """``count`` consecutive copies of a unit of ``period`` positions from ``start``."""

    start: int
    period: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.period * self.count

    def units(self) -> list[tuple[int, int]]:
        """Each copy's positions, as ``(start, end)``."""
        return [(self.start + k * self.period, self.start + (k + 1) * self.period)
                for k in range(self.count)]


def repeated_runs(signatures: Sequence[Hashable], anchors: Sequence[bool],
                  crossing: Sequence[int]) -> list[Run]:
    """The runs of at least two copies of a unit holding an anchor, in order, disjoint."""
    if len(crossing) != len(signatures) + 1 or len(anchors) != len(signatures):
        raise ValueError("one anchor flag per signature and one crossing per boundary")
    found: list[Run] = []
    stack = [(0, len(signatures))]
    while stack:
        lo, hi = stack.pop()
        run = _longest_run(signatures, anchors, crossing, lo, hi)
        if run is None:
            continue
        found.append(run)
        stack.extend([(lo, run.start), (run.end, hi)])
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


def _longest_run(signatures: Sequence[Hashable], anchors: Sequence[bool],
                 crossing: Sequence[int], lo: int, hi: int) -> Run | None:
    best: Run | None = None
    for p in _candidate_periods(signatures, anchors, lo, hi):
        i = lo
        while i + p < hi:
            if signatures[i] != signatures[i + p]:
                i += 1
                continue
            a = i
            while i + p < hi and signatures[i] == signatures[i + p]:
                i += 1
            run = _placed(a, i - a, p, anchors, crossing)
            if run is not None and (best is None or run.count * run.period
                                    > best.count * best.period):
                best = run
    return best


def _placed(a: int, matches: int, p: int, anchors: Sequence[bool],
            crossing: Sequence[int]) -> Run | None:
    """The copies in the stretch ``[a, a + matches + p)``: as many as fit, starting where
    the boundaries cross the fewest bytes."""
    covered = matches + p
    if covered < 2 * p:
        return None
    options = []
    for offset in range(p):
        count = (covered - offset) // p
        if count < 2:
            break
        start = a + offset
        options.append((-count, crossing[start] + crossing[start + count * p], offset,
                        Run(start, p, count)))
    _, _, _, run = min(options, key=lambda o: o[:3])
    if not any(anchors[run.start:run.start + p]):
        return None
    return run


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

