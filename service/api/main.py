"""Wires the app: settings, lifespan (the executor), middleware, handlers, routes."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from optiremat.service.api.middleware import BodyDecodingMiddleware, RequestContextMiddleware
from optiremat.service.api.openapi import install_openapi
from optiremat.service.api.problems import install_problem_handlers
from optiremat.service.api.routes import frontier, health, jobs, solve
from optiremat.service.core.config import Settings, redact_url
from optiremat.service.core.executor import start_executor
from optiremat.service.core.metrics import Metrics

log = logging.getLogger("optiremat.service")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.executor = executor = await start_executor(settings, metrics)
        where = ({"redis": redact_url(settings.redis_url)} if settings.redis_url
                 else {"data_dir": str(settings.data_dir), "workers": settings.workers})
        log.info("serving", extra={**where, "auth": bool(settings.api_keys)})
        try:
            yield
        finally:
            await executor.stop()

    app = FastAPI(
        title="optiremat",
        summary="Optimal activation-checkpointing plans for JAX, as a service.",
        version=_version(),
        lifespan=lifespan,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    install_problem_handlers(app)
    # Added last runs first: the request id exists before the body is read.
    app.add_middleware(BodyDecodingMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)
    for module in (solve, jobs, frontier, health):
        app.include_router(module.router)
    install_openapi(app)
    return app


def _version() -> str:
    from optiremat.service.core.front import solver_version

    return solver_version().split("+")[0].removeprefix("optiremat-")


def serve(settings: Settings) -> None:
    """Run the embedded service in this process until interrupted."""
    import uvicorn

    from optiremat.service.core.logs import configure_logging

    configure_logging(settings.log_level)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        # Sync solves hold requests open; do not wait the full time limit at shutdown.
        timeout_graceful_shutdown=5,
    )
