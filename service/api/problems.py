"""RFC 9457 problem details: every error the service sends is ``application/problem+json``."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from optiremat.service.core.errors import Unavailable
from optiremat.service.core.outcome import Cancelled, Failed, Infeasible, Interrupted, Outcome
from optiremat.solver.wire import (
    INVALID_REQUEST,
    SOLVE_CANCELLED,
    Problem,
    ProblemType,
    ValidationIssue,
)

PROBLEM_MEDIA_TYPE = "application/problem+json"

log = logging.getLogger("optiremat.service")


class HTTPProblem(Exception):
    """Raise anywhere in a request to answer with this problem."""

    def __init__(self, status: int, title: str, detail: str, *, type: str = "about:blank",
                 headers: dict[str, str] | None = None, **extensions: Any) -> None:
        super().__init__(detail)
        self.status, self.title, self.detail, self.type = status, title, detail, type
        self.headers = headers or {}
        self.extensions = extensions

    @classmethod
    def of(cls, kind: ProblemType, status: int, detail: str, *,
           headers: dict[str, str] | None = None, **extensions: Any) -> HTTPProblem:
        """A problem of one of the types the service defines, with that type's title."""
        return cls(status, kind.title, detail, type=kind.uri, headers=headers, **extensions)


def raise_for_outcome(outcome: Outcome) -> None:
    """Turn anything but a solution into the problem the client should see."""
    if isinstance(outcome, Infeasible):
        problem = Problem.infeasible(outcome.budget_bytes, outcome.min_budget_bytes, outcome.memory)
    elif isinstance(outcome, Failed):
        problem = Problem.failed(outcome.message, outcome.invalid)
    elif isinstance(outcome, Cancelled):
        raise HTTPProblem.of(SOLVE_CANCELLED, 409,
                              "an identical job was cancelled (DELETE /v1/jobs/{id}) while "
                              "this request waited for it; send the request again")
    elif isinstance(outcome, Interrupted):
        raise Unavailable("Shutting down", "the server is shutting down; retry shortly")
    else:
        return
    raise HTTPProblem(problem.status, problem.title, problem.detail, type=problem.type,
                       min_budget_bytes=problem.min_budget_bytes)


def problem_body(status: int, title: str, detail: str, *, type: str = "about:blank",
                 request_id: str | None = None, instance: str | None = None,
                 **extensions: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"type": type, "title": title, "status": status, "detail": detail}
    if instance is not None:
        body["instance"] = instance
    if request_id is not None:
        body["request_id"] = request_id
    body.update({k: v for k, v in extensions.items() if v is not None})
    return body


def problem_response(status: int, title: str, detail: str, *,
                     headers: dict[str, str] | None = None, **fields: Any) -> Response:
    return Response(
        content=json.dumps(problem_body(status, title, detail, **fields)).encode(),
        status_code=status,
        media_type=PROBLEM_MEDIA_TYPE,
        headers=headers,
    )


def problem_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for error codes (``optiremat.service.api.openapi``
    files them under ``application/problem+json``)."""
    descriptions = {
        400: "Malformed request (bad JSON, bad gzip)",
        401: "Missing or wrong API key",
        404: "Unknown resource",
        409: "Conflict with the resource's state",
        413: "Body or graph over the configured limits",
        415: "Body is not JSON, or its Content-Encoding is not gzip",
        422: "Request fails validation, or the budget is infeasible",
        429: "Over the client's rate limit; Retry-After says when to try again",
        500: "Internal error",
        503: "Unavailable for now (not ready, shutting down, the store down or full); "
             "Retry-After says when to try again",
    }
    return {code: {"model": Problem, "description": descriptions[code]} for code in codes}


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


def _loc(loc: tuple[Any, ...]) -> list[str | int]:
    return [p if isinstance(p, int) else str(p) for p in loc]


def _validation_message(err: dict[str, Any]) -> str:
    where = ".".join(str(p) for p in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


async def _on_validation_error(request: Request, exc: RequestValidationError) -> Response:
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        err = next(e for e in errors if e.get("type") == "json_invalid")
        reason = (err.get("ctx") or {}).get("error", err.get("msg"))
        return problem_response(
            400, "Malformed JSON", f"the request body is not valid JSON: {reason}",
            type=INVALID_REQUEST.uri, request_id=_request_id(request), instance=request.url.path,
        )
    shown = "; ".join(_validation_message(e) for e in errors[:3])
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    issues = [
        ValidationIssue(loc=_loc(tuple(e["loc"])), msg=str(e["msg"]), type=str(e["type"]))
        .model_dump() for e in errors[:50]
    ]
    return problem_response(
        422, INVALID_REQUEST.title, shown + more, type=INVALID_REQUEST.uri,
        request_id=_request_id(request), instance=request.url.path, errors=issues,
    )


async def _on_problem(request: Request, exc: HTTPProblem) -> Response:
    return problem_response(
        exc.status, exc.title, exc.detail, type=exc.type, headers=exc.headers,
        request_id=_request_id(request), instance=request.url.path, **exc.extensions,
    )


async def _on_unavailable(request: Request, exc: Unavailable) -> Response:
    return problem_response(
        503, exc.title, exc.detail, headers={"Retry-After": str(exc.retry_after_s)},
        type=exc.type, request_id=_request_id(request), instance=request.url.path,
    )


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
    titles = {404: "Not found", 405: "Method not allowed"}
    detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    if exc.status_code == 404 and detail == "Not Found":
        detail = f"no resource at {request.method} {request.url.path}"
    if exc.status_code == 405:
        detail = f"{request.method} is not allowed on {request.url.path}"
    return problem_response(
        exc.status_code, titles.get(exc.status_code, "HTTP error"), detail,
        headers=dict(exc.headers or {}), request_id=_request_id(request),
        instance=request.url.path,
    )


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", extra={"request_id": _request_id(request)})
    return problem_response(
        500, "Internal error",
        "the server failed on this request; report the request_id to the operator",
        request_id=_request_id(request), instance=request.url.path,
    )


def install_problem_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPProblem, _on_problem)  # type: ignore[arg-type]
    app.add_exception_handler(Unavailable, _on_unavailable)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _on_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _on_unexpected)


__all__ = [
    "PROBLEM_MEDIA_TYPE",
    "HTTPProblem",
    "install_problem_handlers",
    "problem_body",
    "problem_response",
    "problem_responses",
    "raise_for_outcome",
]
