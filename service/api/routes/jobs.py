"""Background solves: submit, list, poll, cancel. A job's id is its request hash."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
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
from optiremat.service.api.models import SolveRequest
from optiremat.service.api.problems import HTTPProblem, problem_responses
from optiremat.solver.wire import INVALID_REQUEST, Job, JobPage, JobStatus

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(require_api_key)])


MAX_PAGE = 100


def _not_found(job_id: str) -> HTTPProblem:
    return HTTPProblem(404, "Not found",
                        f"no job {job_id!r}: job ids come from POST /v1/jobs, and a finished "
                        "job left unused is dropped in time (submit the request again)")


@router.post(
    "",
    status_code=202,
    response_model=Job,
    responses={
        200: {"model": Job, "description": "The same request succeeded before: its job"},
        **problem_responses(400, 401, 413, 415, 422, 429, 500, 503),
    },
    summary="Submit a solve as a background job",
    dependencies=[Depends(limit_rate)],
    response_description="The job, queued or running",
    openapi_extra=request_body(SolveRequest),
)
async def submit_job(request: Request, response: Response, settings: SettingsDep,
                     front: FrontDep) -> Job:
    """Queue the solve; ``Location`` names the job. Submitting the same request again
    returns the same job (a failed or cancelled one is started again); each API key
    has its own submission of it (its ``created_at``, its cancel)."""
    body = await parse_body(request, SolveRequest, await request.body())
    options = cap_time_limit(body.options, settings.job_time_limit_s)
    job = await front.submit_job(body.graph, body.budget_bytes, options,
                                 owner=request.state.owner, client=client_of(request))
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    if job.status == JobStatus.SUCCEEDED:
        response.status_code = 200
    return job


@router.get(
    "",
    response_model=JobPage,
    responses=problem_responses(401, 422, 500, 503),
    summary="The jobs, newest first",
)
async def list_jobs(
    request: Request,
    front: FrontDep,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description="Jobs on a page at most.")] = 20,
    cursor: Annotated[str | None, Query(description="``next_cursor`` of the page before.")]
    = None,
    status: Annotated[JobStatus | None, Query(description="Only jobs with this status.")]
    = None,
) -> JobPage:
    """With API keys configured, the jobs this key submitted (a job submitted with two
    keys is listed for both); without, every job. Follow ``next_cursor`` for the next
    page."""
    try:
        return await front.list_jobs(request.state.owner, status, limit, cursor)
    except ValueError as exc:
        raise HTTPProblem.of(INVALID_REQUEST, 422, f"cursor: {exc}") from exc


@router.get(
    "/{job_id}",
    response_model=Job,
    responses=problem_responses(401, 404, 500),
    summary="A job's status, progress, and solution or error",
)
async def get_job(job_id: str, request: Request, front: FrontDep) -> Job:
    """With API keys configured, only the keys that submitted the job see it; for any
    other key it does not exist (404)."""
    job = await front.get_job(job_id, request.state.owner)
    if job is None:
        raise _not_found(job_id)
    return job


@router.delete(
    "/{job_id}",
    response_model=Job,
    responses=problem_responses(401, 404, 500),
    summary="Cancel a job",
)
async def cancel_job(job_id: str, request: Request, front: FrontDep) -> Job:
    """Withdraw this key's submission. When nothing else wants the solve (another
    key's submission, a client waiting on the same request), a queued job is dropped
    and a running solve stops, the job keeping the best plan found so far as its
    solution; else the solve goes on for them and this key's job is cancelled at once.
    A finished job is returned unchanged. As for GET, another key's job is not found."""
    job = await front.cancel_job(job_id, request.state.owner)
    if job is None:
        raise _not_found(job_id)
    return job
