"""Liveness, readiness and Prometheus metrics: never behind the API key, but /metrics
when ``OPTIREMAT_METRICS_REQUIRE_KEY`` is set."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from optiremat.service.api.deps import FrontDep, require_metrics_key
from optiremat.service.api.models import Health
from optiremat.service.api.problems import problem_responses
from optiremat.service.core.models import Readiness

router = APIRouter(tags=["health"])


# HEAD too, as load balancers and uptime checkers often probe (left out of the schema,
# where it would repeat GET's operation).
@router.head("/healthz", include_in_schema=False)
@router.get("/healthz", response_model=Health, summary="The process is up")
async def healthz() -> Health:
    return Health()


@router.head("/readyz", include_in_schema=False)
@router.get(
    "/readyz",
    response_model=Readiness,
    responses=problem_responses(503),
    summary="Ready to take requests",
)
async def readyz(front: FrontDep) -> Readiness:
    """Embedded: the store answers and takes writes, and every worker process has started.
    Cluster: Redis answers (workers are counted, not required: jobs wait in the queue for
    them). Never while the server is stopping."""
    return await front.readiness()


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                     "description": "Prometheus text exposition format"},
               **problem_responses(401)},
    summary="Prometheus metrics",
    dependencies=[Depends(require_metrics_key)],
)
async def metrics(request: Request) -> Response:
    registry = request.app.state.metrics
    return Response(registry.render(), media_type=registry.content_type)
