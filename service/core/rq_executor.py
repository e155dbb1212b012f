"""The cluster executor: queues runs on Redis for RQ workers (``rq_worker``).

``RedisStore.ensure_run`` joins the run another replica started or queues a new
one (the request hash is the RQ job id); the worker that takes it records the
outcome in Redis itself. Waiting is polling, quick at first and then every
``_MAX_POLL_S``; every ``_LIVE_CHECK_S`` the wait also asks RQ whether the run is
still alive, so a run whose worker died without retries left comes back failed
instead of hanging. An API replica holds no state that a restart could lose.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from optiremat.service.core.config import Settings
from optiremat.service.core.errors import Unavailable, queue_full
from optiremat.service.core.graph_text import GraphText
from optiremat.service.core.metrics import Metrics
from optiremat.service.core.models import Readiness
from optiremat.service.core.outcome import Outcome, reusable
from optiremat.service.core.redis_store import RedisStore, Usage
from optiremat.service.core.runs import Live, in_thread
from optiremat.service.core.tasks import Task

log = logging.getLogger("optiremat.service")
T = TypeVar("T")

_FIRST_POLL_S = 0.005
_MAX_POLL_S = 0.2
_LIVE_CHECK_S = 1.0
# A wait rides out a Redis restart this long before answering 503: the solve goes on.
_REDIS_OUTAGE_S = 30.0


class RQExecutor:
    def __init__(self, store: RedisStore, heartbeat_s: int, metrics: Metrics,
                 max_queued: int) -> None:
        self.store = store
        self._heartbeat_s = heartbeat_s
        self._metrics = metrics
        self._max_queued = max_queued
        self._reaper: asyncio.Task[None] | None = None
        self._dropped: tuple[int, int] | None = None  # Redis' evicted and expired keys

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics) -> RQExecutor:
        assert settings.redis_url
        # Requests wait on these calls: a Redis that does not answer must turn into a
        # 503 in seconds, not hang them (nothing the API sends to Redis blocks).
        redis = Redis.from_url(settings.redis_url, health_check_interval=30,
                               socket_connect_timeout=5, socket_timeout=10)
        store = RedisStore(redis, settings.store_ttl_s, settings.job_retries)
        return cls(store, settings.worker_heartbeat_s, metrics, settings.max_queued_jobs)

    def _unavailable(self, exc: RedisError) -> Unavailable:
        unavailable = self.store.unavailable(exc)
        assert unavailable is not None
        return unavailable

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await in_thread(self.store, fn, *args)

    # ---- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        with contextlib.suppress(RedisError):  # managed Redis may refuse CONFIG: no matter
            policy = await asyncio.to_thread(self.store.eviction_policy)
            if policy is not None and not policy.startswith("volatile-"):
                log.warning("Redis evicts with maxmemory-policy %s; use volatile-ttl so that "
                            "only expiring keys go, never queued runs (docker/README.md)",
                            policy)
        self._reaper = asyncio.create_task(self._reap_forever())

    async def stop(self) -> None:
        """Stop watching; the solves go on in the workers."""
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        self.store.redis.close()

    async def readiness(self) -> Readiness:
        try:
            await asyncio.to_thread(self.store.ping)
            workers = await asyncio.to_thread(self.store.worker_count)
            queue_depth = await asyncio.to_thread(self.store.queued)
        except RedisError as exc:
            raise Unavailable("Not ready", f"Redis does not answer: {exc}") from exc
        return Readiness(workers=workers, queue_depth=queue_depth)

    async def _reap_forever(self) -> None:
        period = self._heartbeat_s
        while True:
            try:
                queued, running = await asyncio.to_thread(self.store.reap, 0.9 * period)
                self._metrics.queue_depth.set(queued)
                self._metrics.busy_workers.set(running)
                self._count_usage(await asyncio.to_thread(self.store.usage))
            except RedisError as exc:
                log.warning("reaper: Redis does not answer: %s", exc)
            except Exception:  # keep reaping whatever one round hit
                log.exception("reaper round failed")
            await asyncio.sleep(period)

    def _count_usage(self, usage: Usage) -> None:
        self._metrics.store_bytes.set(usage.used_bytes)
        self._metrics.store_max_bytes.set(usage.max_bytes)
        dropped = (usage.evicted_keys, usage.expired_keys)
        # Redis counts from its start: count the difference (all of it after a restart)
        before = self._dropped or dropped
        for reason, now, then in zip(("size", "ttl"), dropped, before, strict=True):
            self._metrics.store_evictions.labels(reason=reason).inc(
                now - then if now >= then else now)
        self._dropped = dropped

    # ---- runs -------------------------------------------------------------------

    async def ensure(self, task: Task, graph: GraphText, *, job: bool,
                     client: str = "") -> bool:
        # RQ queues are first in, first out: ``client`` takes no turns here; the sync
        # lane (its own queue) keeps a client's solve from waiting behind jobs.
        await self._check_queue(task)
        if not await self._call(self.store.has_graph, task.graph_hash):
            await self._call(self.store.put_graph, task.graph_hash, graph.json)
        record, started = await self._call(lambda: self.store.ensure_run(task, job=job))
        if started:
            log.info("queued %s %s", task.kind, task.key)
        return not started and record.outcome is None

    async def _check_queue(self, task: Task) -> None:
        """A run past the bound on queued ones is refused, unless it joins a run under
        way or is answered already."""
        queued = await self._call(self.store.queued)
        if queued < self._max_queued:
            return
        run = await self._call(self.store.get_run, task.key)
        if run is not None and reusable(run.outcome):
            return
        if await self._call(self.store.get_answer, task.key) is not None:
            return
        self._metrics.rejected.labels(reason="queue_full").inc()
        raise queue_full(queued, self._max_queued)

    async def wait(self, key: str, timeout_s: float | None = None) -> Outcome | None:
        """As the protocol says; meanwhile this waiter counts as wanting the run, for
        ``abandon`` on any replica."""
        waiter = uuid.uuid4().hex
        try:
            return await self._wait(key, timeout_s, waiter)
        finally:
            with contextlib.suppress(RedisError):  # gone by itself in WAITER_TTL_MS
                await asyncio.to_thread(self.store.jobs.stop_waiting, key, waiter)

    async def _wait(self, key: str, timeout_s: float | None, waiter: str) -> Outcome | None:
        now = time.monotonic()
        deadline = None if timeout_s is None else now + timeout_s
        next_live_check = now + _LIVE_CHECK_S
        renew_at = now  # the waiter's next renewal
        outage_since: float | None = None
        delay = _FIRST_POLL_S
        while True:
            try:
                if time.monotonic() >= renew_at:
                    await asyncio.to_thread(self.store.jobs.wait, key, waiter)
                    renew_at = time.monotonic() + _LIVE_CHECK_S
                outcome = await asyncio.to_thread(self.store.outcome, key)
                if outcome is None and time.monotonic() >= next_live_check:
                    outcome = (await asyncio.to_thread(self.store.live, key)).outcome
                    next_live_check = time.monotonic() + _LIVE_CHECK_S
                outage_since = None
            except (RedisConnectionError, RedisTimeoutError) as exc:
                outage_since = outage_since or time.monotonic()
                if time.monotonic() - outage_since > _REDIS_OUTAGE_S:
                    raise self._unavailable(exc) from exc
                outcome, delay = None, _MAX_POLL_S
            except RedisError as exc:
                raise self._unavailable(exc) from exc
            if outcome is not None:
                return outcome
            if deadline is not None and time.monotonic() >= deadline:
                return None
            await asyncio.sleep(delay)
            delay = min(2 * delay, _MAX_POLL_S)

    async def live(self, key: str) -> Live:
        return await self._call(self.store.live, key)

    async def cancel(self, key: str) -> None:
        await self._call(self.store.cancel, key)

    async def abandon(self, key: str) -> bool:
        if not await self._call(self.store.jobs.unwanted, key):
            return False
        await self.cancel(key)
        return True
