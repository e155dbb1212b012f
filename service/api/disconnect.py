"""A request's work, stopped when its client hangs up.

uvicorn does not cancel a handler whose client went away: it lets it finish and
drops the response. A synchronous solve would keep its worker for up to the sync
time limit for nobody. ``unless_disconnected`` runs the work beside a watch on the
connection and cancels the work when the client leaves, so that the front lets go
of its share of the solve (and the solve stops if nobody else waits on it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import Response

T = TypeVar("T")
# nginx's "client closed request": logged and counted, never sent (nobody reads it).
CLIENT_CLOSED = 499
# A server that answers receive() with something other than the disconnect once the
# body is read (none does today) is looked at again this often, not in a busy loop.
_RECHECK_S = 0.5


async def _disconnected(request: Request) -> None:
    """Returns once the client has hung up. The body has been read: the next message
    from the server is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(_RECHECK_S)


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | Response:
    """``work``'s result, or a 499 that nobody will read once ``work`` has been
    cancelled because the client hung up first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done and watch.exception() is not None:
            return await task  # the watch itself failed: no word of a hang-up
    finally:  # also when this handler is cancelled (the server stops)
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # its clean-up runs: the front lets go of the solve
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED)
    return task.result()
