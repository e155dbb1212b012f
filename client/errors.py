"""What ``RematClient`` raises: the connection failed, or the server said no.

Each error carries the ``request`` it made and the ``response`` it got (``None``
where there was none), as httpx's errors do. A server error carries its RFC 9457
problem detail (``type``, ``title``, ``detail``, ``status`` and any extension
members) as the server sent it. An infeasible budget is also a
``optiremat.solver.solution.InfeasibleBudgetError``, so code written against the
local ``optimize`` catches it unchanged.
"""

from __future__ import annotations

from typing import Any

import httpx

from optiremat.solver.errors import OptirematError
from optiremat.solver.solution import InfeasibleBudgetError
from optiremat.solver.wire import INFEASIBLE_BUDGET


class RemoteError(OptirematError):
    """Base of every error about the service or the way to it. ``request`` is the HTTP
    request that failed (its ``url`` names the server; by default the ``response``'s),
    ``response`` the answer it got: ``None`` when no answer came, and both ``None`` for
    an error read from a ``Job`` the caller passed in."""

    def __init__(self, message: str, *, request: httpx.Request | None = None,
                 response: httpx.Response | None = None) -> None:
        # Not super(): in RemoteInfeasibleBudget the next class would be
        # InfeasibleBudgetError, whose constructor takes other arguments.
        Exception.__init__(self, message)
        self.request = response.request if request is None and response is not None else request
        self.response = response


class ConnectionFailed(RemoteError):
    """The server could not be reached (after retries), or did not answer in time."""


class ProblemError(RemoteError):
    """The server answered with an error; ``problem`` is its problem+json body."""

    def __init__(self, status: int, problem: dict[str, Any], *,
                 request: httpx.Request | None = None,
                 response: httpx.Response | None = None) -> None:
        self.status = status
        self.problem = problem
        self.type: str = str(problem.get("type", "about:blank"))
        self.title: str = str(problem.get("title", httpx.codes.get_reason_phrase(status)))
        self.detail: str = str(problem.get("detail", ""))
        super().__init__(f"{self.title} (HTTP {status}): {self.detail}", request=request,
                         response=response)


class RequestRejected(ProblemError):
    """A 4xx: the request is wrong as sent; resending it will not help."""


class Unauthorized(RequestRejected):
    """401: the server wants an API key (``RematClient(url, api_key=...)``) or a valid one."""


class NotFound(RequestRejected):
    """404: no such job, or no such endpoint (is the URL the service's root?)."""


class ServerError(ProblemError):
    """A 5xx, after retries for the transient ones (502, 503, 504)."""


class RemoteInfeasibleBudget(RequestRejected, InfeasibleBudgetError):
    """422 infeasible budget: ``min_budget_bytes`` is the smallest feasible budget."""

    def __init__(self, status: int, problem: dict[str, Any], budget_bytes: int, *,
                 request: httpx.Request | None = None,
                 response: httpx.Response | None = None) -> None:
        super().__init__(status, problem, request=request, response=response)
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = int(problem["min_budget_bytes"])


class JobCancelled(RemoteError):
    """The job was cancelled before it found any plan."""


def problem_error(status: int, problem: dict[str, Any], budget_bytes: int | None = None, *,
                  response: httpx.Response | None = None) -> ProblemError:
    """The exception for one problem detail: an error ``response``'s, or a failed job's
    (``response`` is then the one that reported the job, if any)."""
    if (problem.get("type") == INFEASIBLE_BUDGET.uri and problem.get("min_budget_bytes") is not None
            and budget_bytes is not None):
        return RemoteInfeasibleBudget(status, problem, budget_bytes, response=response)
    kinds: dict[int, type[ProblemError]] = {401: Unauthorized, 404: NotFound}
    kind = kinds.get(status, RequestRejected if status < 500 else ServerError)
    return kind(status, problem, response=response)


def response_error(response: httpx.Response, budget_bytes: int | None = None) -> ProblemError:
    """The exception for an error response, problem+json or not (a proxy's HTML page)."""
    try:
        problem = response.json()
    except ValueError:
        problem = None
    if not isinstance(problem, dict):
        text = response.text.strip()
        problem = {"title": response.reason_phrase or "HTTP error",
                   "detail": text[:500] or f"{response.request.method} {response.request.url}"}
    return problem_error(response.status_code, problem, budget_bytes, response=response)
