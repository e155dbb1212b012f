"""Handing the memory of a large request back to the system (issue 31, item 5).

A graph of 200k nodes is a 17 MiB body that becomes hundreds of MiB of Python
objects while it is parsed, validated and hashed. Python frees them when the request
ends, but glibc's malloc kept most of it: four such graphs at once, twice, left the
API process at 448 MiB against 61 MiB idle (``bench/service_caps.py --phases rss``).
Three glibc habits hold on to freed memory, and this module switches them off:

- the mmap threshold floats: after a large block is freed, glibc raises the size
  above which it maps blocks of their own (up to 32 MiB), so the next bodies and
  lists land in the heaps, which are not unmapped on free;
- the trim threshold floats with it (twice the mmap threshold), so up to 64 MiB at
  the top of each heap stays;
- each thread that allocates under contention gets an arena of its own (up to eight
  per core), and every arena keeps its own free memory. The threads that parse
  (``asyncio.to_thread``) made seven of them.

``tune_malloc`` fixes both thresholds at glibc's own defaults and bounds the arenas;
``MemoryReleaser`` calls ``malloc_trim(0)``, which returns the free pages inside every
arena, once the last large request in flight has ended. Both do nothing where the C
library is not glibc (musl, macOS), which has neither knob.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import platform
from functools import cache

log = logging.getLogger("optiremat.service")

# mallopt parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

# Blocks from 4 MiB up (bodies, their JSON, the arrays of a large graph's lists) are
# mapped on their own and unmapped when freed; a heap whose free top passes 4 MiB
# gives it back. Not glibc's starting 128 KiB: the 256 KiB chunks a body arrives in
# were then mapped and unmapped one by one, and draining four 51 MiB bodies took
# 1.1 s of CPU instead of 0.45 s with glibc's floating thresholds, 0.15 s with these.
MMAP_THRESHOLD_BYTES = 4 << 20
TRIM_THRESHOLD_BYTES = 4 << 20
# The API process's threads mostly wait on the GIL or on I/O, so they rarely contend
# in malloc; two arenas keep what they hold in two places.
ARENA_MAX = 2
# A request whose body is at least this large asks for a trim once it ends.
LARGE_BODY_BYTES = 1 << 20


@cache
def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def tune_malloc() -> bool:
    """Fix glibc's thresholds and bound its arenas; call before threads start.

    Returns whether it could (glibc only)."""
    libc = _glibc()
    if libc is None:
        return False
    done = all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (_M_ARENA_MAX, ARENA_MAX)))
    if not done:
        log.warning("could not tune malloc (mallopt refused a parameter)")
    return done


def trim() -> None:
    """Free what requests left in reference cycles, then return the free pages of every
    malloc arena to the system (glibc only)."""
    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class MemoryReleaser:
    """Trims once no large request is in flight: trimming while others still run would
    hand back pages they are about to take again."""

    def __init__(self) -> None:
        self._in_flight = 0
        self.enabled = _glibc() is not None

    def begin(self) -> None:
        self._in_flight += 1

    async def end(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0 and self.enabled:
            await asyncio.to_thread(trim)  # walks every arena: off the loop
