"""The service's settings: one object, read from ``OPTIREMAT_*`` environment variables."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit, urlunsplit

from platformdirs import user_cache_path
from pydantic import AliasChoices, Field, FilePath, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def _default_workers() -> int:
    # Each worker is a process running one CP-SAT solve; leave a core for the event loop.
    return max(1, min(4, (os.cpu_count() or 2) - 1))


class Settings(BaseSettings):
    """Every knob of the service. Environment: ``OPTIREMAT_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="OPTIREMAT_", extra="ignore", frozen=True,
                                      validate_by_name=True)

    host: str = "127.0.0.1"
    # Proxies whose X-Forwarded-For / X-Forwarded-Proto name the client (comma-separated
    # addresses or networks, "*" for any). Empty, the default, trusts none: a client
    # could otherwise pick its own rate-limit bucket (uvicorn trusts loopback by default).
    forwarded_allow_ips: str = ""
    port: int = Field(default=8000, ge=0, le=65535)
    data_dir: Path = Field(default_factory=lambda: user_cache_path("optiremat"))
    # Comma-separated bearer tokens; empty (and no key file) turns authentication off.
    api_keys: Annotated[tuple[str, ...], NoDecode] = ()
    # A file of bearer tokens, one a line (what a Kubernetes Secret mounts); re-read when
    # it changes. Setting it turns authentication on, even while the file is empty.
    api_keys_file: FilePath | None = None
    # /metrics answers only with an API key (Prometheus sends it as a bearer token).
    metrics_require_key: bool = False
    # Cap on the request body after gzip decoding (and on the raw body).
    max_body_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    # A request body must arrive within this long after its headers, else 408 and the
    # connection is closed (64 MiB at 10 Mbit/s takes about 55 s).
    body_timeout_s: float = Field(default=60.0, gt=0)
    # A connection's request line and headers must arrive within this long of its
    # opening (or of the first byte of a later request on it), else it is closed, with a
    # 408 if part of a request came (nginx's client_header_timeout).
    header_timeout_s: float = Field(default=10.0, gt=0)
    # A kept-alive connection with no request in flight is closed after this long.
    keep_alive_timeout_s: float = Field(default=5.0, gt=0)
    # Connections open at once. Past it the one that has waited longest for a request is
    # closed to make room, or, when every one has a request in flight, the new one is
    # answered 503. The default leaves half of a 1,024 open-file limit to the store, the
    # workers' pipes and the sockets being closed.
    max_connections: int = Field(default=512, ge=1)
    max_graph_nodes: int = Field(default=200_000, gt=0)
    max_graph_values: int = Field(default=400_000, gt=0)
    # Cap on each column of value ids (input_ids, backward_reads, ...): ten per node at
    # the node cap; a graph of the client's has about two.
    max_graph_edges: int = Field(default=2_000_000, gt=0)
    # Request bodies validated at once (each in a thread); more wait their turn.
    max_concurrent_parses: int = Field(default=2, ge=1)
    # POST /v1/solve and /v1/frontier hold a connection open: their time limit is capped.
    sync_time_limit_s: float = Field(default=30.0, gt=0)
    # Jobs run in the background but still hold a worker: cap them too.
    job_time_limit_s: float = Field(default=3600.0, gt=0)
    # On SIGTERM: stop accepting, then wait this long for open requests to be answered.
    # The default lets a synchronous solve started just before finish: the 30 s time
    # limit plus 5 s for loading the graph and checking the plan.
    shutdown_grace_s: float = Field(default=35.0, ge=0)
    workers: int = Field(default_factory=_default_workers, ge=1)
    # Embedded: worker processes beside ``workers`` that take only solves a client waits
    # on (POST /v1/solve, frontiers), so that one is never stuck behind hours of another
    # client's jobs. 0 leaves sync solves only their place ahead of jobs in the queue.
    sync_workers: int = Field(default=1, ge=0)
    log_level: str = "INFO"
    # Requests a minute per API key (per client address with keys off) that may start
    # solver work: POST /v1/solve not answered from the body memo, /v1/jobs, /v1/frontier.
    # A client may send a minute's worth at once. 0 turns the limit off.
    rate_limit_per_minute: int = Field(default=600, ge=0)
    # Requests with a wrong API key a minute per client address; past it (a burst of this
    # many at once, then one each 60/N s) every request with a key from that address is
    # 429 until it may try again, so keys cannot be guessed at speed. 0 turns it off.
    auth_failures_per_minute: int = Field(default=30, ge=0)
    # Solves waiting for a worker, beyond which a new one is answered 503. Embedded,
    # each holds its graph's JSON in memory: about 160 bytes a node.
    max_queued_jobs: int = Field(default=100, ge=1)

    # ---- the store: SQLite under data_dir, or Redis in cluster mode ----
    # Embedded: the data directory's bound (SQLite file, WAL and all); least recently
    # used answers and finished jobs are evicted past it. Cluster: Redis' maxmemory
    # bounds it (docker/README.md).
    store_max_bytes: int = Field(default=1 << 30, ge=64 * 1024)
    # Answers, jobs and graphs unused this long are dropped (Redis: their TTL).
    # OPTIREMAT_RESULT_TTL_S is its first name, still read.
    store_ttl_s: int = Field(default=7 * 24 * 3600, ge=60, validation_alias=AliasChoices(
        "OPTIREMAT_STORE_TTL_S", "OPTIREMAT_RESULT_TTL_S"))
    # A finished job is kept at least this long whatever the bound, so a client polling
    # it sees it finish (embedded; in Redis its fresh TTL protects it).
    store_job_grace_s: float = Field(default=600.0, ge=0)

    # ---- cluster mode: set redis_url and run `optiremat worker` processes ----
    # e.g. redis://:password@redis:6379/0; unset keeps the embedded default.
    redis_url: str | None = None
    # Times a job whose worker died mid-solve is queued again before it fails.
    job_retries: int = Field(default=1, ge=0)
    # Workers heartbeat this often; a solve whose worker misses three is abandoned.
    worker_heartbeat_s: int = Field(default=5, ge=1)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(k.strip() for k in value.split(",") if k.strip())
        return value

    @model_validator(mode="after")
    def _metrics_key_needs_keys(self) -> Settings:
        if self.metrics_require_key and not self.auth:
            raise ValueError("OPTIREMAT_METRICS_REQUIRE_KEY needs API keys: set "
                             "OPTIREMAT_API_KEYS or OPTIREMAT_API_KEYS_FILE")
        return self

    @property
    def auth(self) -> bool:
        """Whether the /v1 routes need an API key."""
        return bool(self.api_keys) or self.api_keys_file is not None

    @property
    def database_path(self) -> Path:
        return self.data_dir / "optiremat.sqlite3"


def redact_url(url: str) -> str:
    """``url`` without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
