"""Wires the app: settings, lifespan (the front and its executor), middleware, handlers, routes."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType

from fastapi import FastAPI

from optiremat.service.api.api_keys import ApiKeys
from optiremat.service.api.docs import install_docs
from optiremat.service.api.middleware import BodyDecodingMiddleware, RequestContextMiddleware
from optiremat.service.api.openapi import install_openapi
from optiremat.service.api.parsing import BodyParsers
from optiremat.service.api.problems import install_problem_handlers
from optiremat.service.api.routes import frontier, health, jobs, solve
from optiremat.service.core.config import Settings, redact_url
from optiremat.service.core.front import Front
from optiremat.service.core.limits import FailureThrottle, MemoryRateLimiter, RateLimiter
from optiremat.service.core.metrics import Metrics
from optiremat.service.core.runs import Executor
from optiremat.service.core.tasks import solver_version

log = logging.getLogger("optiremat.service")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        executor, app.state.rate_limiter = _open(settings, metrics)
        app.state.front = front = Front(executor, metrics)
        await front.start()
        where = ({"redis": redact_url(settings.redis_url)} if settings.redis_url
                 else {"data_dir": str(settings.data_dir), "workers": settings.workers})
        log.info("serving", extra={**where, "auth": settings.auth})
        try:
            yield
        finally:
            parsers.close()
            await front.stop()

    app = FastAPI(
        title="optiremat",
        summary="Optimal activation-checkpointing plans for JAX, as a service.",
        version=_version(),
        lifespan=lifespan,
        docs_url=None,  # install_docs serves it with its own assets
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.api_keys = ApiKeys(settings)
    app.state.auth_failures = (FailureThrottle(settings.auth_failures_per_minute)
                               if settings.auth_failures_per_minute else None)
    app.state.parsers = parsers = BodyParsers(settings)
    install_problem_handlers(app)
    # Added last runs first: the request id exists before the body is read.
    app.add_middleware(BodyDecodingMiddleware, settings=settings)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)
    for module in (solve, jobs, frontier, health):
        app.include_router(module.router)
    install_openapi(app)
    install_docs(app)
    return app


def _open(settings: Settings, metrics: Metrics) -> tuple[Executor, RateLimiter | None]:
    """Cluster mode with a Redis URL, else the embedded default; and the rate limiter,
    shared through Redis by every replica in cluster mode."""
    per_minute = settings.rate_limit_per_minute
    if settings.redis_url:  # imports redis and rq only when used
        from optiremat.service.core.redis_limits import RedisRateLimiter
        from optiremat.service.core.rq_executor import RQExecutor

        cluster = RQExecutor.from_settings(settings, metrics)
        return cluster, RedisRateLimiter(cluster.store.redis, per_minute) if per_minute else None
    from optiremat.service.core.pool_executor import PoolExecutor

    embedded = PoolExecutor.from_settings(settings, metrics)
    return embedded, MemoryRateLimiter(per_minute) if per_minute else None


def _version() -> str:
    return solver_version().split("+")[0].removeprefix("optiremat-")


def serve(settings: Settings) -> None:
    """Run the embedded service in this process until interrupted."""
    import uvicorn

    from optiremat.service.api.connections import guarded_protocol
    from optiremat.service.core.logs import configure_logging
    from optiremat.service.core.memory import tune_malloc

    configure_logging(settings.log_level)
    tune_malloc()  # before uvicorn and the executors start threads
    app = create_app(settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # A signal handler: reach the front through the loop, not from here.
            front: Front | None = getattr(app.state, "front", None)
            if front is not None and not self.should_exit:
                asyncio.get_running_loop().call_soon_threadsafe(front.drain,
                                                                settings.shutdown_grace_s)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        # h11 with a header deadline and a connection limit (api/connections.py)
        http=guarded_protocol(settings, app.state.metrics),
        timeout_keep_alive=settings.keep_alive_timeout_s,  # type: ignore[arg-type]
        proxy_headers=bool(settings.forwarded_allow_ips.strip()),
        forwarded_allow_ips=settings.forwarded_allow_ips.strip() or None,
        # SIGTERM: uvicorn stops accepting at once and answers what is open within this
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s),
    )
    Server(config).run()
