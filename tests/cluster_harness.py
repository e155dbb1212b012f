"""A real cluster on loopback for the cluster tests: redis-server, API replicas
(``optiremat serve``) and RQ workers (``optiremat worker``), each its own process.

Redis keeps its data in a temporary directory (append-only file, fsync on every
write), so a test can kill it and start it again on the same port and data.
Tests that need ``redis-server`` skip without it, except under CI (``CI`` set),
where a missing server is a failure: ``.ci/run`` installs it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from optiremat.service.core.redis_store import RedisStore
from tests.service_harness import REPO, Server, free_port


def require_redis_server() -> str:
    path = shutil.which("redis-server")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed (apt-get install redis-server)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    return path


@dataclass
class RedisServer:
    data_dir: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> Redis:
        return Redis(host="127.0.0.1", port=self.port)

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [require_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.data_dir), "--appendonly", "yes", "--appendfsync", "always",
             "--save", "", "--logfile", str(self.data_dir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return self
            except Exception:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer")

    def kill(self) -> None:
        """SIGKILL: only what was fsynced to the append-only file survives."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


@dataclass
class WorkerProcess:
    log_path: Path
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    sync_only: bool = False

    def launch(self) -> WorkerProcess:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "optiremat", "worker",
                 *(["--sync-only"] if self.sync_only else [])],
                cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            )
        return self

    def wait_listening(self, timeout_s: float = 60.0) -> None:
        assert self.process is not None
        marker = f'"Worker {self.name}: started'.encode()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited:\n{self.log_path.read_text()}")
            if marker in self.log_path.read_bytes():
                return
            time.sleep(0.05)
        raise RuntimeError(f"worker not listening after {timeout_s} s")

    @property
    def name(self) -> str:
        """The RQ worker name, as ``optiremat worker`` picks it (host.pid)."""
        assert self.process is not None
        return f"{os.uname().nodename}.{self.process.pid}"

    def kill_mid_solve(self) -> None:
        """SIGKILL the worker and the work horse it forked: the solve dies with it."""
        assert self.process is not None
        pid = self.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        for victim in [pid, *map(int, children)]:
            os.kill(victim, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()  # RQ's warm shutdown: the current job finishes
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class Cluster:
    root: Path
    settings: dict[str, str]
    redis: RedisServer
    apis: list[Server] = field(default_factory=list)
    workers: list[WorkerProcess] = field(default_factory=list)

    def worker_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OPTIREMAT_")}
        env.update({f"OPTIREMAT_{k.upper()}": v for k, v in self.settings.items()})
        return env

    def add_worker(self, *, sync_only: bool = False) -> WorkerProcess:
        """Start one more worker (with a log of its own)."""
        index = len(list(self.root.glob("worker*.log")))
        worker = WorkerProcess(self.root / f"worker{index}.log", self.worker_env(),
                               sync_only=sync_only).launch()
        self.workers.append(worker)
        return worker

    def worker_log(self) -> str:
        """Every worker's log, killed ones included."""
        return "".join(path.read_text() for path in sorted(self.root.glob("worker*.log")))

    def solves_of(self, key: str) -> int:
        """How many times a worker ran the solver on ``key`` to the end."""
        return sum(1 for line in self.worker_log().splitlines()
                   if '"task finished"' in line and key in line)

    def run_record(self, key: str) -> dict[str, str]:
        raw = self.redis.client().hgetall(RedisStore.run_key(key))
        return {k.decode(): v.decode() for k, v in raw.items()}

    def stop(self) -> None:
        for process in [*self.apis, *self.workers]:
            process.stop()
        self.redis.stop()


def running_cluster(root: Path, apis: int = 2, workers: int = 2, sync_workers: int = 0,
                    **settings: str) -> Iterator[Cluster]:
    """Body of a fixture: a started cluster, stopped afterwards."""
    redis = RedisServer(root / "redis").start()
    cluster = Cluster(root, {"redis_url": redis.url, "worker_heartbeat_s": "1",
                             "job_retries": "1", "log_level": "INFO", **settings}, redis)
    try:
        for index in range(workers + sync_workers):
            cluster.add_worker(sync_only=index >= workers)
        cluster.apis = [Server(root / f"api{i}", dict(cluster.settings)) for i in range(apis)]
        with ThreadPoolExecutor(len(cluster.apis)) as pool:  # start replicas side by side
            list(pool.map(lambda server: server.start(), cluster.apis))
        for worker in cluster.workers:
            worker.wait_listening()
        yield cluster
    finally:
        cluster.stop()


def wait_for(condition: Any, timeout_s: float = 60.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what}: not met in {timeout_s} s")
