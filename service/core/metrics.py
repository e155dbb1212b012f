"""Prometheus metrics, in a registry per app so several apps in one process do not collide."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_SOLVE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        """(Long on purpose: one declaration per metric, the list /metrics serves.)"""
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_seconds = Histogram(
            "optiremat_http_request_duration_seconds", "HTTP request latency",
            ["method", "route", "status"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.solves = Counter(
            "optiremat_solves", "Solver runs in worker processes, by outcome (invalid: the "
            "solver refused the request, answered 422)",
            ["outcome"], registry=r,
        )
        self.solve_seconds = Histogram(
            "optiremat_solve_seconds", "Wall time of one solver run in a worker",
            buckets=_SOLVE_BUCKETS, registry=r,
        )
        self.cache_hits = Counter(
            "optiremat_cache_hits", "Requests answered from the result store", registry=r,
        )
        self.coalesced = Counter(
            "optiremat_coalesced_requests",
            "Requests that joined an identical solve already in flight", registry=r,
        )
        self.abandoned = Counter(
            "optiremat_abandoned_runs",
            "Runs stopped because every client waiting on them hung up and no job wanted "
            "them", registry=r,
        )
        self.open_connections = Gauge(
            "optiremat_open_connections", "HTTP connections open", registry=r,
        )
        self.connections_turned_away = Counter(
            "optiremat_connections_turned_away",
            "Connections closed or refused: header_timeout (request line and headers late), "
            "longest_idle (closed to make room past OPTIREMAT_MAX_CONNECTIONS), over_limit "
            "(answered 503: every connection had a request in flight)",
            ["reason"], registry=r,
        )
        self.queue_depth = Gauge(
            "optiremat_queue_depth", "Solver tasks waiting for a free worker", registry=r,
        )
        self.busy_workers = Gauge(
            "optiremat_busy_workers", "Worker processes running a task", registry=r,
        )
        self.rejected = Counter(
            "optiremat_rejected_requests",
            "Requests turned away: over a client's rate limit (rate_limit), with the queue "
            "at OPTIREMAT_MAX_QUEUED_JOBS (queue_full), or from an address past its wrong API "
            "keys (auth_failures)", ["reason"], registry=r,
        )
        self.store_bytes = Gauge(
            "optiremat_store_bytes",
            "Bytes the store takes: the SQLite files on disk, or Redis' used memory", registry=r,
        )
        self.store_max_bytes = Gauge(
            "optiremat_store_max_bytes",
            "The store's bound: OPTIREMAT_STORE_MAX_BYTES, or Redis' maxmemory (0: none)",
            registry=r,
        )
        self.store_evictions = Counter(
            "optiremat_store_evictions",
            "Entries dropped from the store: unused past the TTL (ttl) or least recently used "
            "past the size bound (size)", ["reason"], registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
