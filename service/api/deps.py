"""FastAPI dependencies and the request checks shared by several routes."""

from __future__ import annotations

import asyncio
import math
import re
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ValidationError

from optiremat.service.api.api_keys import ApiKeys
from optiremat.service.api.problems import HTTPProblem
from optiremat.service.core.config import Settings
from optiremat.service.core.front import Front
from optiremat.service.core.limits import RateLimiter
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
    request.state.owner = keys.owner(credentials.credentials)
    if request.state.owner is None:
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


async def limit_rate(request: Request) -> None:
    """Count a request that may start solver work against its client's rate limit: its
    API key (by key id), or its address with keys off."""
    limiter: RateLimiter | None = request.app.state.rate_limiter
    if limiter is None:
        return
    owner = request.state.owner
    address = request.client.host if request.client else "unknown"
    client = f"key {owner}" if owner else f"address {address}"
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


# (id column, what its entries are, the setting that caps them, its variable)
_CAPPED = (("node_id", "nodes", "max_graph_nodes", "OPTIREMAT_MAX_GRAPH_NODES"),
           ("value_id", "values", "max_graph_values", "OPTIREMAT_MAX_GRAPH_VALUES"))


def _too_large(what: str, count: int, settings: Settings, setting: str, variable: str,
               at_least: bool = False) -> HTTPProblem | None:
    cap: int = getattr(settings, setting)
    if count <= cap:
        return None
    return HTTPProblem.of(
        GRAPH_TOO_LARGE, 413,
        f"the graph has {'at least ' if at_least else ''}{count} {what}; this server accepts "
        f"at most {cap} ({variable})")


def check_graph_size(graph: CostGraph, settings: Settings) -> None:
    """The exact check, on the validated graph."""
    for column, what, setting, variable in _CAPPED:
        problem = _too_large(what, len(getattr(graph, column)), settings, setting, variable)
        if problem is not None:
            raise problem


def _largest_array(raw: bytes, field: str) -> int:
    """The most entries of any ``"field": [...]`` array in ``raw``, counted without
    parsing: ids are integers, so an array's entries are its commas and one. (Inside
    a JSON string a quote is escaped, so the pattern only matches a key.)"""
    most = 0
    for match in re.finditer(rb'"' + field.encode() + rb'"\s*:\s*\[', raw):
        end = raw.find(b"]", match.end())
        entries = raw[match.end():end if end >= 0 else len(raw)]
        most = max(most, entries.count(b",") + (1 if entries.strip() else 0))
    return most


def _check_counts(raw: bytes, settings: Settings) -> None:
    """Refuse a graph over the node or value caps before parsing it: a 40 MiB body of
    600k nodes took 6 s of CPU to validate, and this scan takes milliseconds. A body
    written so that the scan misses its arrays still meets ``check_graph_size``."""
    for column, what, setting, variable in _CAPPED:
        problem = _too_large(what, _largest_array(raw, column), settings, setting, variable,
                             at_least=True)
        if problem is not None:
            raise problem


def cap_time_limit(options: SolveOptions, cap_s: float) -> SolveOptions:
    """Clamp the time limit; the capped value is part of the request hash and the answer."""
    if options.time_limit_s <= cap_s:
        return options
    return options.model_copy(update={"time_limit_s": cap_s})


def _validate_and_hash(model: type[Body], raw: bytes) -> Body:
    body = model.model_validate_json(raw)
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
            return await asyncio.to_thread(_validate_and_hash, model, raw)
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
