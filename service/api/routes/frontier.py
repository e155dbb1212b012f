"""POST /v1/frontier: recompute FLOPs against budget, one solve per budget."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from optiremat.service.api.deps import (
    FrontDep,
    SettingsDep,
    cap_time_limit,
    client_of,
    limit_rate,
    parse_body,
    request_body,
    require_api_key,
)
from optiremat.service.api.disconnect import unless_disconnected
from optiremat.service.api.models import FrontierRequest
from optiremat.service.api.problems import problem_responses, raise_for_outcome
from optiremat.solver.wire import Frontier

router = APIRouter(prefix="/v1", tags=["frontier"], dependencies=[Depends(require_api_key)])


@router.post(
    "/frontier",
    response_model=Frontier,
    responses=problem_responses(400, 401, 409, 413, 415, 422, 429, 500, 503),
    summary="Solve once per budget and return the trade-off curve",
    openapi_extra=request_body(FrontierRequest),
    dependencies=[Depends(limit_rate)],
)
async def frontier(request: Request, settings: SettingsDep,
                   front: FrontDep) -> Frontier | Response:
    """Solve once per budget (each cached like ``/v1/solve``, with the same time-limit
    cap). With ``count``, budgets are spaced evenly from the smallest feasible budget to
    the largest useful one. Infeasible budgets come back as points with status
    ``infeasible``; ``pareto`` marks the points no other point beats."""
    body = await parse_body(request, FrontierRequest, await request.body())
    options = cap_time_limit(body.options, settings.sync_time_limit_s)
    result = await unless_disconnected(request, front.frontier(
        body.graph, body.budgets, body.count, options, body.step_seconds,
        client=client_of(request)))
    if isinstance(result, Response):  # the client hung up: its solves were let go
        return result
    if not isinstance(result, Frontier):
        raise_for_outcome(result)
        raise AssertionError(f"unexpected outcome {result!r}")
    return result
