"""FastAPI dependencies and the request checks shared by several routes."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
from typing import Annotated, Any, TypeVar

import pydantic_core
from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ValidationError

from optiremat.service.api.api_keys import ApiKeys
from optiremat.service.api.problems import HTTPProblem
from optiremat.service.core.config import Settings
from optiremat.service.core.front import Front
from optiremat.service.core.limits import FailureThrottle, RateLimiter
from optiremat.solver.graph import CostGraph
from optiremat.solver.solution import SolveOptions
from optiremat.solver.wire import GRAPH_TOO_LARGE, RATE_LIMITED

Body = TypeVar("Body", bound=BaseModel)

_bearer = HTTPBearer(
    auto_error=False,
    description="Enforced only when the server sets OPTIREMAT_API_KEYS.",
)


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_front(request: Request) -> Front:
    front: Front = request.app.state.front
    return front


SettingsDep = Annotated[Settings, Depends(get_settings)]
FrontDep = Annotated[Front, Depends(get_front)]


async def require_api_key(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """With keys configured, a valid bearer key; its ``key_id`` becomes
    ``request.state.owner`` (None with authentication off)."""
    keys: ApiKeys = request.app.state.api_keys
    request.state.owner = None
    if not keys.enabled:
        return
    if credentials is None:
        raise HTTPProblem(
            401, "Unauthorized",
            "this server requires an API key: send the header 'Authorization: Bearer <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    throttle: FailureThrottle | None = request.app.state.auth_failures
    address = request.client.host if request.client else "unknown"
    if throttle is not None and (wait_s := throttle.blocked_s(address)) > 0:
        request.app.state.metrics.rejected.labels(reason="auth_failures").inc()
        retry_after = math.ceil(wait_s)
        raise HTTPProblem.of(
            RATE_LIMITED, 429,
            f"too many requests with a wrong API key from {address} (more than "
            f"{get_settings(request).auth_failures_per_minute} a minute, "
            f"OPTIREMAT_AUTH_FAILURES_PER_MINUTE); retry in {retry_after} s",
            headers={"Retry-After": str(retry_after)})
    request.state.owner = keys.owner(credentials.credentials)
    if request.state.owner is None:
        if throttle is not None:
            throttle.record(address)
        raise HTTPProblem(
            401, "Unauthorized", "the API key is not valid for this server",
            headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
        )


async def require_metrics_key(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """An API key for /metrics when ``OPTIREMAT_METRICS_REQUIRE_KEY`` is set."""
    if get_settings(request).metrics_require_key:
        await require_api_key(request, credentials)


def client_of(request: Request) -> str:
    """Who sent the request, for its rate limit and its turn at the workers: its API
    key (by key id), or its address with keys off."""
    owner = request.state.owner
    address = request.client.host if request.client else "unknown"
    return f"key {owner}" if owner else f"address {address}"


async def limit_rate(request: Request) -> None:
    """Count a request that may start solver work against its client's rate limit: its
    API key (by key id), or its address with keys off."""
    limiter: RateLimiter | None = request.app.state.rate_limiter
    if limiter is None:
        return
    client = client_of(request)
    wait_s = await limiter.wait_s(client)
    if wait_s > 0:
        request.app.state.metrics.rejected.labels(reason="rate_limit").inc()
        retry_after = math.ceil(wait_s)
        raise HTTPProblem.of(
            RATE_LIMITED, 429,
            f"this client ({client}) sent more than {get_settings(request).rate_limit_per_minute}"
            " requests a minute that may start a solve (OPTIREMAT_RATE_LIMIT_PER_MINUTE; "
            f"answers from the cache do not count); retry in {retry_after} s",
            headers={"Retry-After": str(retry_after)})


# The graph's columns that hold one entry per node or per value, or a value id per use
# (the edges), and the setting that caps each: (columns, what their entries are,
# setting, its variable, entries beyond the count). A column longer than its cap is
# either over the cap or invalid, so every one of them can be refused before validation.
_CAPPED = (
    (tuple(f for f in CostGraph.model_fields if f.startswith("node_")),
     "nodes", "max_graph_nodes", "OPTIREMAT_MAX_GRAPH_NODES", 0),
    (("input_ptr", "output_ptr"), "nodes", "max_graph_nodes", "OPTIREMAT_MAX_GRAPH_NODES", 1),
    (tuple(f for f in CostGraph.model_fields if f.startswith("value_")),
     "values", "max_graph_values", "OPTIREMAT_MAX_GRAPH_VALUES", 0),
    (("input_ids", "output_ids", "inputs", "backward_reads", "carry_in", "carry_out"),
     "value references", "max_graph_edges", "OPTIREMAT_MAX_GRAPH_EDGES", 0),
)
_CAP_OF = {column: (what, setting, variable, extra)
           for columns, what, setting, variable, extra in _CAPPED for column in columns}


def _too_large(column: str, entries: int, settings: Settings,
               at_least: bool = False) -> HTTPProblem | None:
    what, setting, variable, extra = _CAP_OF[column]
    cap: int = getattr(settings, setting)
    if entries - extra <= cap:
        return None
    of = "" if column in ("node_id", "value_id") else f" ({column} has {entries} entries)"
    return HTTPProblem.of(
        GRAPH_TOO_LARGE, 413,
        f"the graph has {'at least ' if at_least else ''}{entries - extra} {what}{of}; this "
        f"server accepts at most {cap} ({variable})")


def check_parsed_size(data: object, settings: Settings) -> None:
    """The exact check, on the parsed JSON before validation: every capped column."""
    graph = data.get("graph") if isinstance(data, dict) else None
    if not isinstance(graph, dict):
        return
    for column in _CAP_OF:
        entries = graph.get(column)
        if isinstance(entries, list):
            problem = _too_large(column, len(entries), settings)
            if problem is not None:
                raise problem


# Where an array follows a colon: a key's array, or bytes inside a string. Searching
# for the colon is memchr-fast; the key is then read backwards and decoded as JSON.
_ARRAY_AFTER_KEY = re.compile(rb":[ \t\r\n]*\[")
_LONGEST_KEY = 6 * max(map(len, _CAP_OF))  # every character escaped as \uXXXX
# Colons followed by "[" inside strings cost a step each: past this many, the scan stops
# and the exact check after the parse decides (a legit graph has about 20).
_MOST_ARRAYS = 10_000
# One array entry: a string, a number or literal, or an array of those without strings
# (value_shape's). Atomic, so a failed match never backtracks into an entry.
_ENTRY = rb'(?>"(?:[^"\\]|\\.)*+"|[^\s,\[\]{}"]++|\[[^\[\]{}"]*+\])'
_EMPTY = re.compile(rb"\s*\]")


def _escaped(raw: bytes, quote: int) -> bool:
    """Whether the quote at ``quote`` is escaped: an odd run of backslashes before it."""
    run = 0
    while quote - run - 1 >= 0 and raw[quote - run - 1] == 0x5C:
        run += 1
    return run % 2 == 1


def _key_before(raw: bytes, colon: int) -> str | None:
    """The decoded key whose colon is at ``colon``, if a capped column's could be there.

    Its closing quote is the last byte before the colon but whitespace, and not escaped;
    its opening quote the first unescaped one before that (inside a JSON string every
    quote is escaped). A colon inside a string yields no key or a key that is no column.
    """
    close = colon - 1
    while close >= 0 and raw[close] in b" \t\r\n":
        close -= 1
    if close < 0 or raw[close] != 0x22 or _escaped(raw, close):
        return None
    start = raw.rfind(b'"', max(0, close - _LONGEST_KEY - 1), close)
    while start >= 0 and _escaped(raw, start):
        start = raw.rfind(b'"', max(0, close - _LONGEST_KEY - 1), start)
    if start < 0:
        return None
    key = raw[start:close + 1]
    if b"\\" not in key:
        return key[1:-1].decode("latin-1")
    try:
        decoded = json.loads(key)  # "node\u005fid" is node_id
    except ValueError:
        return None
    return decoded if isinstance(decoded, str) else None


@functools.lru_cache(maxsize=8)
def _more_than(entries: int) -> re.Pattern[bytes]:
    """Matches an array's opening bracket only when more than ``entries`` entries follow."""
    return re.compile(rb"\s*" + _ENTRY + rb"(?:\s*,\s*" + _ENTRY + rb"){%d}" % entries)


def _longer_than(raw: bytes, start: int, entries: int) -> int | None:
    """How many entries the array whose first entry may start at ``start`` holds, if more
    than ``entries``; None if not, or if it cannot tell without parsing.

    An array of numbers counts as its commas and one, read at memchr speed. One with
    strings or inner arrays (whose commas are not its own) is matched entry by entry
    by a regex, up to one entry past the cap.
    """
    end = raw.find(b"]", start)
    end = len(raw) if end < 0 else end
    if raw.find(b'"', start, end) < 0 and raw.find(b"[", start, end) < 0:
        count = 0 if _EMPTY.match(raw, start) else raw.count(b",", start, end) + 1
        return count if count > entries else None
    if _more_than(entries).match(raw, start):
        return entries + 1
    return None


def _check_counts(raw: bytes, settings: Settings) -> None:
    """Refuse a graph over the node or value caps before parsing it: a 40 MiB body of
    600k nodes took 6 s of CPU to validate and 0.4 s just to parse, and this scan takes
    milliseconds. It reads keys as JSON does (escapes decoded), and every column that
    holds an entry per node or per value. A body it cannot read this way still meets
    ``check_parsed_size`` after the parse, before validation."""
    for seen, match in enumerate(_ARRAY_AFTER_KEY.finditer(raw)):
        if seen >= _MOST_ARRAYS:
            return
        column = _key_before(raw, match.start())
        if column not in _CAP_OF:
            continue
        setting, extra = _CAP_OF[column][1], _CAP_OF[column][3]
        entries = _longer_than(raw, match.end(), getattr(settings, setting) + extra)
        if entries is not None:
            problem = _too_large(column, entries, settings, at_least=True)
            if problem is not None:
                raise problem


def cap_time_limit(options: SolveOptions, cap_s: float) -> SolveOptions:
    """Clamp the time limit; the capped value is part of the request hash and the answer."""
    if options.time_limit_s <= cap_s:
        return options
    return options.model_copy(update={"time_limit_s": cap_s})


def _parse_check_validate(model: type[Body], raw: bytes, settings: Settings) -> Body:
    """Parse once, check the caps on what the JSON means, then validate the parsed
    object (not the bytes again)."""
    try:
        data = pydantic_core.from_json(raw)
    except ValueError as exc:
        raise RequestValidationError([{
            "type": "json_invalid", "loc": ("body",), "msg": f"Invalid JSON: {exc}",
            "ctx": {"error": str(exc)}}]) from None
    check_parsed_size(data, settings)
    body = model.model_validate(data)
    del data  # the validated model holds what it needs
    graph = getattr(body, "graph", None)
    if isinstance(graph, CostGraph):
        graph.content_hash  # noqa: B018  (cached: hash here, off the loop, not in a route)
    return body


async def parse_body(request: Request, model: type[Body], raw: bytes) -> Body:
    """Validate a JSON body in a thread, not in the event loop, after the cheap caps.

    Checking a 100k-node graph takes seconds of Python; meanwhile the loop must keep
    answering other requests and health probes. (Routes therefore read the body
    themselves instead of letting FastAPI validate it; ``request_body`` documents it.)
    At most ``OPTIREMAT_MAX_CONCURRENT_PARSES`` bodies are validated at once: more
    would only share the same cores, and hold every parsed graph in memory together.
    """
    settings = get_settings(request)
    await asyncio.to_thread(_check_counts, raw, settings)
    slots: asyncio.Semaphore = request.app.state.parse_slots
    try:
        async with slots:
            return await asyncio.to_thread(_parse_check_validate, model, raw, settings)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in errors]
        ) from None


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads ``model`` with ``parse_body``."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}
