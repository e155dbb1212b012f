"""A real ``optiremat serve`` on loopback for the service tests, and graphs to send it.

Each test module starts its own server (``python -m optiremat serve``) on a free
port with a temporary ``OPTIREMAT_DATA_DIR``; the server's log lines go to a file
the tests can read.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from optiremat.solver.graph import CostGraph, GraphBuilder

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    data_dir: Path
    settings: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    wrap: list[str] = field(default_factory=list)  # a command that execs the server
    own_group: bool = False  # lead a process group, as a terminal's or systemd's job does

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "server.log"

    def start(self, timeout_s: float = 60.0) -> Server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OPTIREMAT_")}
        env.update({f"OPTIREMAT_{k.upper()}": v for k, v in self.settings.items()})
        env["OPTIREMAT_DATA_DIR"] = str(self.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [*self.wrap, sys.executable, "-m", "optiremat", "serve",
                 "--host", "127.0.0.1", "--port", str(self.port)],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=self.own_group,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited ({self.process.returncode}):\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.log()}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def log_records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log().splitlines() if line.startswith("{")]

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120.0, **kwargs)


def running_server(tmp_path_factory: Any, **settings: str) -> Iterator[Server]:
    """Body of a module-scoped fixture: ``pytest.fixture(scope="module")(...)``."""
    server = Server(tmp_path_factory.mktemp("optiremat-data"), dict(settings)).start()
    try:
        yield server
    finally:
        server.stop()


def metric(client: httpx.Client, name: str) -> float:
    """Sum of every sample of ``name`` (all label sets) on /metrics."""
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            sample, value = line.rsplit(" ", 1)
            if sample == name or sample.startswith(name + "{"):
                total += float(value)
    return total


# ---- graphs ---------------------------------------------------------------


def chain(length: int, *, name: str = "chain", tied: bool = False) -> CostGraph:
    """x -> tanh -> tanh -> ...; the backward pass reads every output (as tanh's does)."""
    b = GraphBuilder(name)
    x = b.input(1024, (256,), "float32")
    for i in range(length):
        y = b.value(1024 + 64 * i, (256 + 16 * i,), "float32")
        b.node("tanh", [x], [y], key="tanh" if tied else f"tanh{i}", flops=1000 + 37 * i)
        b.backward_reads.append(y)
        x = y
    return b.build()


def layered(layers: int, width: int, *, name: str = "layered") -> CostGraph:
    """Each layer's nodes read two values of the layer before: a small but real MILP."""
    b = GraphBuilder(name)
    previous = [b.input(4096, (1024,), "float32") for _ in range(width)]
    for layer in range(layers):
        current = []
        for j in range(width):
            out = b.value(4096 + 512 * ((layer * 7 + j) % 5), (1024,), "float32")
            reads = [previous[j], previous[(j + 1) % width]]
            b.node("mul", reads, [out], key=f"mul{layer}.{j}",
                   flops=10_000 + 1_000 * ((layer * 3 + j) % 7))
            b.backward_reads.extend(reads)
            current.append(out)
        previous = current
    return b.build()


def tangled(layers: int, width: int, *, seed: int = 1, name: str = "tangled") -> CostGraph:
    """Values feed random later nodes and the backward pass reads an irregular subset:
    a 160-node instance finds a plan in well under a second but takes CP-SAT minutes
    to prove optimal without ties. The slow solve for cancel tests."""
    rnd = random.Random(seed)
    b = GraphBuilder(name)
    values = [b.input(4096, (1024,), "float32") for _ in range(width)]
    for layer in range(layers):
        fresh = []
        for j in range(width):
            out = b.value(rnd.randrange(1, 64) * 1024, (1024,), "float32")
            reads = rnd.sample(values[-3 * width:], 2)
            b.node("op", reads, [out], key=f"op{layer}.{j}", flops=rnd.randrange(1, 100) * 10_000)
            if rnd.random() < 0.3:
                b.backward_reads.extend(reads)
            fresh.append(out)
        values.extend(fresh)
    b.backward_reads.extend(values[-width:])
    return b.build()


def body(graph: CostGraph, budget_bytes: int, **options: Any) -> dict[str, Any]:
    return {"graph": graph.model_dump(mode="json"), "budget_bytes": budget_bytes,
            "options": options}
