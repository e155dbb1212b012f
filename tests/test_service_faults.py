"""Stopping and failing well: SIGTERM answers what is open, SIGKILL mid-write leaves a
store that opens, a full disk is a 503 the server recovers from."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from optiremat.service.core.outcome import Solved
from optiremat.service.core.store import SqliteStore
from optiremat.solver.solve import max_useful_budget, min_feasible_budget
from optiremat.solver.synthetic import transformer_like
from tests.service_harness import REPO, Server, body, chain, metric


def wait_until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)


def refuses_connections(server: Server) -> bool:
    try:
        httpx.get(f"{server.url}/healthz", timeout=1.0)
    except httpx.ConnectError:
        return True
    return False


def stopped(server: Server) -> int:
    assert server.process is not None
    code = server.process.wait(timeout=30)
    assert "Application shutdown complete" in server.log()
    return code


def searched_to_its_time_limit(time_limit_s: float) -> dict[str, Any]:
    """A solve CP-SAT does not prove in minutes: it runs to its time limit."""
    graph = transformer_like(24)
    low, high = min_feasible_budget(graph, tie=False), max_useful_budget(graph)
    return body(graph, low + (high - low) // 4, tie=False, time_limit_s=time_limit_s)


def test_sigterm_answers_the_open_solve_and_leaves_queued_jobs_for_the_restart(
        tmp_path: Path) -> None:
    settings = {"workers": "1", "shutdown_grace_s": "20"}
    server = Server(tmp_path / "data", settings).start()
    with ThreadPoolExecutor(1) as pool, server.client() as client:
        answer = pool.submit(client.post, "/v1/solve", json=searched_to_its_time_limit(3))
        wait_until(lambda: metric(client, "optiremat_busy_workers") == 1, 30, "solving")
        queued = client.post("/v1/jobs", json=body(chain(6, name="left"), 10**9)).json()
        assert queued["status"] == "queued"
        assert server.process is not None and not answer.done()
        server.process.send_signal(signal.SIGTERM)
        wait_until(lambda: refuses_connections(server), 5, "stops accepting")
        assert answer.result().status_code == 200  # the open request was answered
        assert answer.result().json()["status"] in ("optimal", "feasible")
    assert stopped(server) in (0, -signal.SIGTERM)

    server = Server(tmp_path / "data", settings).start()  # the queued job runs now
    try:
        with server.client() as client:
            wait_until(lambda: client.get(f"/v1/jobs/{queued['id']}").json()["status"]
                       == "succeeded", 30, "the queued job ran after the restart")
    finally:
        server.stop()


def test_a_solve_still_open_when_the_grace_ends_is_answered_503_not_cut_off(
        tmp_path: Path) -> None:
    server = Server(tmp_path / "data", {"workers": "1", "shutdown_grace_s": "2"}).start()
    with ThreadPoolExecutor(1) as pool, server.client() as client:
        answer = pool.submit(client.post, "/v1/solve", json=searched_to_its_time_limit(30))
        wait_until(lambda: metric(client, "optiremat_busy_workers") == 1, 30, "solving")
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)
        response = answer.result(timeout=10)
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/problem+json"
    assert "shutting down" in response.json()["detail"] and response.headers["Retry-After"]
    assert stopped(server) in (0, -signal.SIGTERM)


WRITER = """
import sys
from pathlib import Path
from optiremat.service.core.outcome import Solved
from optiremat.service.core.store import SqliteStore
from optiremat.solver.solve import max_useful_budget, min_feasible_budget
from optiremat.solver.synthetic import transformer_like

store = SqliteStore(Path(sys.argv[1]), max_bytes=256 * 1024)  # evicting as it goes
for i in range(100_000):
    store.record(f"k{i}", Solved(solution_json='{"pad": "%s"}' % ("x" * 3000)))
    print(i, flush=True)  # after the commit: this one is on disk
"""


def test_a_store_killed_mid_write_opens_cleanly_with_every_committed_answer(
        tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    assert writer.stdout is not None
    committed = [int(writer.stdout.readline()) for _ in range(300)]  # well into evicting
    writer.send_signal(signal.SIGKILL)
    writer.wait()

    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    store = SqliteStore(path, max_bytes=256 * 1024)
    last = f"k{committed[-1]}"
    assert store.get_answer(last) == Solved(solution_json='{"pad": "%s"}' % ("x" * 3000))
    store.record("after", Solved(solution_json="{}"))  # and it takes writes
    assert store.get_answer("after") is not None
