"""FastAPI dependencies and the request checks shared by several routes."""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from optiremat.service.api.api_keys import ApiKeys
from optiremat.service.api.parsing import BodyParsers, Kept, RequestModel
from optiremat.service.api.problems import HTTPProblem
from optiremat.service.core.config import Settings
from optiremat.service.core.front import Front
from optiremat.service.core.limits import FailureThrottle, RateLimiter
from optiremat.solver.solution import SolveOptions
from optiremat.solver.wire import RATE_LIMITED

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


def cap_time_limit(options: SolveOptions, cap_s: float) -> SolveOptions:
    """Clamp the time limit; the capped value is part of the request hash and the answer."""
    if options.time_limit_s <= cap_s:
        return options
    return options.model_copy(update={"time_limit_s": cap_s})


async def parse_body(request: Request, model: type[RequestModel[Kept]], raw: bytes) -> Kept:
    """``model``'s validated ``valid()`` form of the body ``raw`` (``parsing``). The caps
    on its graph were checked as it arrived (``BodyDecodingMiddleware``)."""
    parsers: BodyParsers = request.app.state.parsers
    return await parsers.parse(model, raw)


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads ``model`` with ``parse_body``."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}
