"""The embedded pool's waiting line: two lanes, and in each one client's turn at a time.

A run is in the ``SYNC`` lane when a client waits on it and in ``BACKGROUND`` when
it is a job (``tasks.Lane``). A worker takes from the lanes it serves in order,
so a sync run goes before any job waiting; the pool keeps workers that serve the
sync lane only (``OPTIREMAT_SYNC_WORKERS``), so that a client waiting on a small
solve is never stuck behind another client's hour of jobs.

Within a lane, clients (an API key's id, or an address with keys off) take turns:
each has its own first-in-first-out line, and after one of its runs is taken it
goes to the back of the turn order. A client that queues a hundred runs
delays another's one run by at most one run per worker, not by a hundred.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Generic, TypeVar

from optiremat.service.core.tasks import Lane

T = TypeVar("T")


class FairQueue(Generic[T]):
    def __init__(self) -> None:
        # lane -> client -> its waiting items; the OrderedDict's order is the turn order
        self._lines: dict[Lane, OrderedDict[str, deque[T]]] = {lane: OrderedDict()
                                                               for lane in Lane}
        self._size = 0
        self._getters: list[tuple[int, asyncio.Future[None]]] = []  # (lanes served, getter)

    def qsize(self) -> int:
        return self._size

    def put(self, item: T, lane: Lane, client: str) -> None:
        self._lines[lane].setdefault(client, deque()).append(item)
        self._size += 1
        # Wake every getter (a handful of workers): each looks at its own lanes. Those
        # serving fewer lanes first: a sync run goes to a sync worker when one is free,
        # leaving the others to jobs.
        for _, getter in sorted(self._getters, key=lambda entry: entry[0]):
            if not getter.done():
                getter.set_result(None)
        self._getters.clear()

    def take(self, lanes: tuple[Lane, ...]) -> T | None:
        """The next item from the first of ``lanes`` that has one, or None."""
        for lane in lanes:
            line = self._lines[lane]
            if not line:
                continue
            client, items = next(iter(line.items()))
            item = items.popleft()
            if items:
                line.move_to_end(client)  # the others' turn first
            else:
                del line[client]
            self._size -= 1
            return item
        return None

    async def get(self, lanes: tuple[Lane, ...]) -> T:
        while (item := self.take(lanes)) is None:
            entry = (len(lanes), asyncio.get_running_loop().create_future())
            self._getters.append(entry)
            try:
                await entry[1]
            finally:
                if entry in self._getters:
                    self._getters.remove(entry)
        return item

    def drain(self) -> Iterator[T]:
        """Every waiting item, emptying the queue (at shutdown)."""
        for line in self._lines.values():
            while line:
                _, items = line.popitem(last=False)
                yield from items
        self._size = 0
