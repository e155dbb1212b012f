"""What a compiled SPMD step moves between devices, read from its optimised HLO.

The ground truth the graph's ``node_collective_bytes`` is checked against
(``tests/mesh_checks.py``, ``bench/sharded.py``): every collective XLA's
partitioner placed, in bytes one device moves, each loop body's counted as
many times as the loop's known trip count says it runs. Per collective, with
``k`` the devices of its group and ``r`` the bytes of its result on one device:

* all-reduce ``2 (k - 1) / k * r`` (a ring's reduce-scatter, then all-gather);
* all-gather and all-to-all ``(k - 1) / k * r`` (the blocks it receives);
* reduce-scatter ``(k - 1) * r``; collective-permute ``r``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

import jax

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
               "c128": 16}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_OP = re.compile(r"=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<kind>" + "|".join(KINDS)
                 + r")(?:-start)?\(")
_ARRAY = re.compile(r"(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_WHILE = re.compile(r"\swhile\(.*body=%?(?P<body>[\w.\-]+).*?known_trip_count"
                    r"\D*(?P<n>\d+)")
_CALL = re.compile(r"(?:to_apply|calls|branch_computations|true_computation|"
                   r"false_computation)=\{?%?(?P<names>[\w.\-, %]+)\}?")


@dataclass(frozen=True)
class Collectives:
    bytes: int  # per device, over the whole step
    counts: dict[str, int]  # per kind, runs over the whole step


def _result_bytes(shape: str) -> int:
    total = 0
    for m in _ARRAY.finditer(shape):
        dims = [int(d) for d in m["dims"].split(",") if d]
        total += DTYPE_BYTES.get(m["dtype"], 0) * math.prod(dims)
    return total


def _group_size(line: str, devices: int) -> int:
    iota = re.search(r"replica_groups=\[(?P<dims>[\d,]+)\]<=", line)
    if iota:
        return int(iota["dims"].split(",")[-1])
    listed = re.search(r"replica_groups=\{\{(?P<first>[\d,]*)\}", line)
    if listed:
        return len(listed["first"].split(","))
    pairs = re.search(r"source_target_pairs=", line)
    return 2 if pairs else devices


def _moved(kind: str, k: int, result: int) -> int:
    if kind == "all-reduce":
        return 2 * (k - 1) * result // k
    if kind in ("all-gather", "all-to-all"):
        return (k - 1) * result // k
    if kind == "reduce-scatter":
        return (k - 1) * result
    return result


def collectives(compiled: jax.stages.Compiled, devices: int) -> Collectives:
    """The collectives of one run of ``compiled``, a step partitioned over ``devices``."""
    computations: dict[str, list[str]] = {}
    entry = ""
    name = ""
    for line in (compiled.as_text() or "").splitlines():
        if line and not line[0].isspace() and "{" in line:
            head = line.split("(")[0].split()
            name = head[-1].lstrip("%") if head else ""
            if line.startswith("ENTRY"):
                entry = name
            computations[name] = []
        elif name:
            computations[name].append(line)

    def run(comp: str, seen: frozenset[str]) -> tuple[int, Counter[str]]:
        moved, counts = 0, Counter[str]()
        for line in computations.get(comp, ()):
            if (op := _OP.search(line)) is not None:
                kind = op["kind"]
                moved += _moved(kind, _group_size(line, devices), _result_bytes(op["shape"]))
                counts[kind] += 1
            if (loop := _WHILE.search(line)) is not None and loop["body"] not in seen:
                inner, inner_counts = run(loop["body"], seen | {loop["body"]})
                n = int(loop["n"])
                moved += n * inner
                counts.update({kind: n * c for kind, c in inner_counts.items()})
            elif (call := _CALL.search(line)) is not None:
                for callee in re.split(r"[,\s%]+", call["names"]):
                    if callee and callee not in seen:
                        inner, inner_counts = run(callee, seen | {callee})
                        moved += inner
                        counts.update(inner_counts)
        return moved, counts

    moved, counts = run(entry, frozenset({entry}))
    return Collectives(moved, dict(counts))
