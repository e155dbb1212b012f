"""Byte budgets as users write them: ``12MiB``, ``1.5GB``, ``800_000``."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(budget: int | str) -> int:
    """Bytes from an int or a string with an optional unit (KB = 1000 B, KiB = 1024 B)."""
    if isinstance(budget, bool):
        raise TypeError("a byte budget must be an int or a string like '12MiB', not a bool")
    if isinstance(budget, int):
        if budget < 0:
            raise ValueError(f"a byte budget cannot be negative: {budget}")
        return budget
    if not isinstance(budget, str):
        raise TypeError(f"a byte budget must be an int or a string like '12MiB', not {budget!r}")
    match = _PATTERN.match(budget)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(
            f"cannot read {budget!r} as bytes; write an int or a number with one of the units "
            "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    number = match.group(1).replace("_", "")
    if "." not in number:  # exact: a float would round 10**29 to 99999999999999991433150857216
        return int(number) * _UNITS[unit]
    return int(float(number) * _UNITS[unit])


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
