"""Validating a request body off the event loop: small ones in a thread, large ones in a
parse process.

Checking a 100k-node graph takes seconds of Python; meanwhile the loop must keep
answering other requests and health probes, so no body is validated on it. (Routes
read their body themselves instead of letting FastAPI validate it; ``request_body``
in ``deps`` documents it.)

A body of ``LARGE_BODY_BYTES`` or more is validated in a parse process, which sends
back the route's ``valid()`` form of it: the graph as a ``GraphText``. Parsing such a
graph in the API process made millions of small objects there; freed, they left
the allocator's arenas pinned by the few objects other requests had made among
them, and the process kept a third to a half more than its idle size for good.
A parse process does nothing else, so nothing pins its arenas: it hands its memory
back after each body. It also holds the GIL for those seconds, not the API
process: /healthz stays quick while graphs are validated.

At most ``OPTIREMAT_MAX_CONCURRENT_PARSES`` bodies are validated at once (and that
many parse processes exist): more would only share the same cores, and hold every
parsed graph in memory together.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Generic, Protocol, TypeVar

import pydantic_core
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from optiremat.service.api.caps import check_parsed_size
from optiremat.service.api.problems import HTTPProblem
from optiremat.service.core.config import Settings
from optiremat.service.core.errors import Unavailable
from optiremat.service.core.memory import LARGE_BODY_BYTES, trim, tune_malloc

Valid = TypeVar("Valid", covariant=True)
Kept = TypeVar("Kept")


class RequestModel(Protocol[Valid]):
    """A request body's pydantic model, and what a route keeps of it (``valid()``)."""

    @classmethod
    def model_validate(cls, obj: Any) -> RequestModel[Valid]: ...

    def valid(self) -> Valid: ...


# What a parse process sends back instead of raising: neither FastAPI's
# RequestValidationError nor HTTPProblem survives pickling.
@dataclass(frozen=True, slots=True)
class _Invalid:
    errors: list[dict[str, Any]]  # as RequestValidationError takes them


@dataclass(frozen=True, slots=True)
class _Refused:
    status: int
    title: str
    detail: str
    type: str


@dataclass(frozen=True, slots=True)
class _Accepted(Generic[Kept]):
    valid: Kept


def _plain(error: dict[str, Any]) -> dict[str, Any]:
    """A pydantic error with its location under ``body``, and its context as text (it
    may hold the exception a validator raised)."""
    error = {**error, "loc": ("body", *error["loc"])}
    if "ctx" in error:
        error["ctx"] = {key: str(value) for key, value in error["ctx"].items()}
    return error


def validate(model: type[RequestModel[Kept]], raw: bytes,
             settings: Settings) -> _Accepted[Kept] | _Invalid | _Refused:
    """Parse once, check the caps on what the JSON means, validate the parsed object
    (not the bytes again), and keep its ``valid()`` form."""
    try:
        data = pydantic_core.from_json(raw)
    except ValueError as exc:
        return _Invalid([{"type": "json_invalid", "loc": ("body",),
                          "msg": f"Invalid JSON: {exc}", "ctx": {"error": str(exc)}}])
    try:
        check_parsed_size(data, settings)
        return _Accepted(model.model_validate(data).valid())
    except HTTPProblem as problem:
        return _Refused(problem.status, problem.title, problem.detail, problem.type)
    except ValidationError as exc:
        return _Invalid([_plain(dict(e)) for e in exc.errors(include_url=False,
                                                             include_input=False)])


def _serve(conn: Connection) -> None:
    """A parse process: validate each ``(model, settings)`` and body sent down ``conn``,
    send back the result, and hand back what the parse held, until the pipe closes."""
    tune_malloc()
    while True:
        try:
            model, settings = conn.recv()
            raw = conn.recv_bytes()
        except (EOFError, OSError):
            return
        result = validate(model, raw, settings)
        del raw
        conn.send(result)
        del result
        trim()


class _ParseProcess:
    """One spawned parse process and its pipe. The body goes down the pipe as the bytes
    it is, not pickled: a pickled copy is what ``ProcessPoolExecutor`` sends, and its
    feeder thread held the last one (a whole body) until the next."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")  # not fork: this process has threads
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child,), daemon=True,
                                       name="optiremat-parse")
        self.process.start()
        child.close()

    def validate(self, model: type[RequestModel[Kept]], raw: bytes,
                 settings: Settings) -> _Accepted[Kept] | _Invalid | _Refused:
        """Blocking: run it in a thread."""
        self.conn.send((model, settings))
        self.conn.send_bytes(raw)
        result: _Accepted[Kept] | _Invalid | _Refused = self.conn.recv()
        return result

    def stop(self) -> None:
        """End it, whatever it is doing (a thread still reading its pipe gets EOF)."""
        self.process.kill()
        self.conn.close()


class BodyParsers:
    """The threads and parse processes that validate request bodies, at most
    ``settings.max_concurrent_parses`` at once. A parse process starts on a large body
    when none is idle, then waits for the next until ``close``."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._slots = asyncio.Semaphore(settings.max_concurrent_parses)
        self._idle: list[_ParseProcess] = []

    async def parse(self, model: type[RequestModel[Kept]], raw: bytes) -> Kept:
        """``model``'s ``valid()`` form of ``raw``; raises ``RequestValidationError``
        (400 or 422), ``HTTPProblem`` (413) or, should a parse process die,
        ``Unavailable`` (503)."""
        async with self._slots:
            if len(raw) < LARGE_BODY_BYTES:
                result = await asyncio.to_thread(validate, model, raw, self._settings)
            else:
                result = await self._in_process(model, raw)
        if isinstance(result, _Invalid):
            raise RequestValidationError(result.errors)
        if isinstance(result, _Refused):
            raise HTTPProblem(result.status, result.title, result.detail, type=result.type)
        return result.valid

    async def _in_process(self, model: type[RequestModel[Kept]],
                          raw: bytes) -> _Accepted[Kept] | _Invalid | _Refused:
        try:
            process = self._idle.pop() if self._idle else _ParseProcess()
        except OSError as exc:  # out of processes or files: a client may try again
            raise Unavailable("Parse failed", "no process could be started to validate "
                              f"this request body ({exc}); retry shortly") from None
        try:
            result = await asyncio.to_thread(process.validate, model, raw, self._settings)
        except (EOFError, OSError):  # it died (out of memory?): the next body gets another
            process.stop()
            raise Unavailable("Parse failed", "the process validating this request body "
                              "ended unexpectedly; retry shortly") from None
        except BaseException:  # cancelled mid-exchange: its pipe is out of step
            process.stop()
            raise
        self._idle.append(process)
        return result

    def close(self) -> None:
        for process in self._idle:
            process.stop()
        self._idle.clear()
