"""The embedded executor's writes to its SQLite store, and what happens when they fail.

A write that fails (a full disk, a read-only one) rolls back whole (one SQLite
transaction) and puts the store in fault: the request that needed it is answered
503, new solves are refused with 503 until the store takes writes again, answers
already stored are still served, and ``/readyz`` says why it is not ready. How a
run ended is not lost meanwhile: the keeper holds what it could not record, serves
it to job views, and writes it once it can. While in fault it tries every
``RETRY_S``: ``SqliteStore.probe`` (free space, then a write) and the held records;
when they go through, the fault ends.

It also runs the store's upkeep (``SqliteStore.maintain``) every ``MAINTAIN_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from optiremat.service.core.errors import Unavailable
from optiremat.service.core.outcome import Outcome
from optiremat.service.core.runs import in_thread
from optiremat.service.core.store import SqliteStore
from optiremat.solver.wire import STORE_UNAVAILABLE, Progress

log = logging.getLogger("optiremat.service")
T = TypeVar("T")
# Writes bound the store's size as they happen; upkeep only ages entries out, for
# which a minute is fine-grained enough against a TTL of at least a minute.
MAINTAIN_S = 60.0
# In fault, a write is tried this often: a freed disk is noticed within a second.
RETRY_S = 1.0


class StoreKeeper:
    def __init__(self, store: SqliteStore) -> None:
        self.store = store
        self.fault: str | None = None  # why writes fail, until one succeeds
        self._unrecorded: dict[str, tuple[Outcome, Progress | None]] = {}
        self._wake = asyncio.Event()

    def _unavailable(self) -> Unavailable:
        return Unavailable.of(
            STORE_UNAVAILABLE,
            f"the result store ({self.store.path}) cannot be written: {self.fault}. Answers "
            "stored before are still served; retry later")

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        """A store write in a thread: all of it or, raising ``Unavailable``, none."""
        try:
            done = await in_thread(self.store, fn, *args)
        except Unavailable as exc:
            cause = exc.__cause__
            if self.fault is None:
                log.error("the store cannot be written: %s", cause)
                self._wake.set()
            self.fault = str(cause)
            raise self._unavailable() from cause
        if self.fault is not None:
            log.info("the store takes writes again")
            self.fault = None
        return done

    def refuse_new_work(self) -> None:
        """Raises ``Unavailable`` while the store cannot be written."""
        if self.fault is not None:
            raise self._unavailable()

    async def record(self, key: str, outcome: Outcome, progress: Progress | None) -> None:
        """How a run ended: recorded now, or as soon as the store takes writes."""
        try:
            await self.write(self.store.record, key, outcome, progress)
        except Unavailable:
            self._unrecorded[key] = (outcome, progress)

    def unrecorded(self, key: str) -> Outcome | None:
        """How a run ended that is not in the store yet."""
        held = self._unrecorded.get(key)
        return None if held is None else held[0]

    async def retry(self) -> None:
        """Probe the store, then write what it refused before; raises ``Unavailable``
        while it still cannot be written."""
        await self.write(self.store.probe)
        for key, (outcome, progress) in list(self._unrecorded.items()):
            await self.write(self.store.record, key, outcome, progress)
            del self._unrecorded[key]

    async def keep(self) -> None:
        """Upkeep every ``MAINTAIN_S``; in fault, a retry every ``RETRY_S``."""
        while True:
            with_fault = self.fault is not None or bool(self._unrecorded)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):  # woken early by a fault, or not
                await asyncio.wait_for(self._wake.wait(), RETRY_S if with_fault else MAINTAIN_S)
            try:
                if self.fault is not None or self._unrecorded:
                    await self.retry()
                else:
                    await self.write(self.store.maintain)
            except Unavailable:
                pass  # still in fault: logged when it began
            except Exception:  # keep upkeep going whatever one round hit
                log.exception("store upkeep failed")

    async def flush(self) -> None:
        """At shutdown: a last try for what is not recorded (a job not recorded runs
        again at the next start)."""
        if self._unrecorded:
            try:
                await self.retry()
            except Unavailable:
                log.error("%d finished runs could not be recorded", len(self._unrecorded))
