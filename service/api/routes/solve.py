"""POST /v1/solve: one graph, one budget, answered while the client waits."""

from __future__ import annotations

import hashlib

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
from optiremat.service.api.models import SolveRequest
from optiremat.service.api.problems import problem_responses, raise_for_outcome
from optiremat.service.core.outcome import Solved
from optiremat.solver.solution import Solution

router = APIRouter(prefix="/v1", tags=["solve"], dependencies=[Depends(require_api_key)])


@router.post(
    "/solve",
    response_model=Solution,
    responses=problem_responses(400, 401, 409, 413, 415, 422, 429, 500, 503),
    summary="Solve one graph for one budget, synchronously",
    openapi_extra=request_body(SolveRequest),
)
async def solve(request: Request, settings: SettingsDep, front: FrontDep) -> Response:
    """The plan minimising recompute FLOPs within ``budget_bytes``.

    ``options.time_limit_s`` is capped at the server's ``OPTIREMAT_SYNC_TIME_LIMIT_S``;
    use ``/v1/jobs`` for longer solves. Answers are cached by request hash and
    identical concurrent requests share one solve, which stops when every client
    waiting on it has hung up.
    """
    raw = await request.body()
    # A body seen before (byte for byte) maps to its request hash: answer from the
    # store without parsing and validating the graph again.
    body_digest = hashlib.sha256(raw).digest()
    outcome = await front.stored_answer(body_digest)
    if outcome is None:
        await limit_rate(request)  # answers from the store above are not counted
        body = await parse_body(request, SolveRequest, raw)
        options = cap_time_limit(body.options, settings.sync_time_limit_s)
        answer = await unless_disconnected(request, front.solve(
            body.graph, body.budget_bytes, options, body_digest=body_digest,
            client=client_of(request)))
        if isinstance(answer, Response):  # the client hung up: the solve was let go
            return answer
        outcome = answer
    raise_for_outcome(outcome)
    assert isinstance(outcome, Solved)
    # The stored bytes, as they are: every client gets the identical answer.
    return Response(outcome.solution_json, media_type="application/json")
