"""Liveness, readiness and Prometheus metrics (never behind the API key)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from starlette.responses import Response

from service.models import Health, Readiness
from service.problems import ProblemError, problem_responses

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="The process is up")
async def healthz() -> Health:
    return Health()


@router.get(
    "/readyz",
    response_model=Readiness,
    responses=problem_responses(503),
    summary="The store answers and every worker process has started",
)
async def readyz(request: Request) -> Readiness:
    state = request.app.state
    pool = state.pool
    try:
        await asyncio.to_thread(state.store.ping)
    except Exception as exc:
        raise ProblemError(503, "Not ready", f"the result store does not answer: {exc}") from exc
    if pool.ready_workers < pool.size:
        raise ProblemError(503, "Not ready",
                           f"{pool.ready_workers} of {pool.size} worker processes are ready")
    return Readiness(workers=pool.size, queue_depth=pool.queue_depth)


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                     "description": "Prometheus text exposition format"}},
    summary="Prometheus metrics",
)
async def metrics(request: Request) -> Response:
    registry = request.app.state.metrics
    return Response(registry.render(), media_type=registry.content_type)
