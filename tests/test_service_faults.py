"""Stopping and failing well: SIGTERM answers what is open, SIGKILL mid-write leaves a
store that opens, a full disk is a 503 the server recovers from."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from optiremat.service.core.outcome import Solved
from optiremat.service.core.store import SqliteStore
from optiremat.service.core.tasks import SolveTask
from optiremat.solver.solution import SolveOptions
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
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return True  # refused, or reset as the listening socket closed
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
    settings = {"workers": "1", "sync_workers": "0", "shutdown_grace_s": "20"}
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


def test_sigterm_to_the_process_group_still_answers_the_open_solve(tmp_path: Path) -> None:
    # Ctrl-C in a terminal and systemd's default KillMode signal every process of the
    # group, the pool's workers too: they leave the stop to the server.
    server = Server(tmp_path / "data", {"workers": "1", "shutdown_grace_s": "20"},
                    own_group=True).start()
    with ThreadPoolExecutor(1) as pool, server.client() as client:
        answer = pool.submit(client.post, "/v1/solve", json=searched_to_its_time_limit(3))
        wait_until(lambda: metric(client, "optiremat_busy_workers") == 1, 30, "solving")
        assert server.process is not None and not answer.done()
        os.killpg(server.process.pid, signal.SIGTERM)
        assert answer.result().status_code == 200, answer.result().text
        assert answer.result().json()["status"] in ("optimal", "feasible")
    assert stopped(server) in (0, -signal.SIGTERM)


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
from optiremat.service.core.tasks import SolveTask
from optiremat.solver.solution import SolveOptions
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


# ---- a full disk ------------------------------------------------------------------


def tiny_filesystem(size: str, at: Path) -> list[str]:
    """A command prefix that runs the server with a tmpfs of ``size`` mounted at ``at``,
    in a mount namespace of its own (a user namespace makes that work without root).
    The test reaches the file system through /proc/<pid>/root."""
    unshare = shutil.which("unshare")
    # Root needs only a mount namespace; anyone else a user namespace as well.
    candidates = [["--mount"]] if os.geteuid() == 0 else []
    candidates.append(["--user", "--map-root-user", "--mount"])
    flags = next((f for f in candidates if unshare is not None and subprocess.run(
        [unshare, *f, "true"], capture_output=True).returncode == 0), None)
    if unshare is None or flags is None:
        reason = "user and mount namespaces are not available (unshare, util-linux)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return [unshare, *flags, "sh", "-c",
            f'mount -t tmpfs -o size={size} optiremat-test "{at}" && exec "$@"', "sh"]


def fill(path: Path) -> None:
    """Write zeros to ``path`` until its file system is full."""
    chunk = b"\0" * 4096
    with path.open("wb", buffering=0) as ballast:  # unbuffered: nothing left to flush
        try:
            while True:
                ballast.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def test_a_full_disk_is_a_503_the_server_stays_up_and_recovers_once_space_returns(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    server = Server(data, {"workers": "1", "store_max_bytes": str(256 * 1024)},
                    wrap=tiny_filesystem("2m", data)).start()
    assert server.process is not None
    inside = Path(f"/proc/{server.process.pid}/root") / data.relative_to("/")
    cached = body(chain(8, name="before"), 10**9)
    job = body(chain(2000, name="after"), 10**9)  # 165 kB of graph to keep: more than the WAL
    try:
        with server.client() as client:
            answer = client.post("/v1/solve", json=cached)
            assert answer.status_code == 200
            fill(inside / "ballast")

            refused = client.post("/v1/jobs", json=job)
            assert refused.status_code == 503, refused.text
            problem = refused.json()
            assert refused.headers["content-type"] == "application/problem+json"
            assert problem["type"] == "urn:optiremat:problem:store-unavailable"
            assert "disk is full" in problem["detail"] and refused.headers["Retry-After"]
            fresh = client.post("/v1/solve", json=body(chain(9, name="during"), 10**9))
            assert fresh.status_code == 503  # no solve whose answer could not be kept
            assert "disk is full" in client.get("/readyz").json()["detail"]
            assert client.get("/healthz").status_code == 200
            again = client.post("/v1/solve", json=cached)  # what is stored is served
            assert again.status_code == 200 and again.content == answer.content
            job_id = SolveTask(graph_hash=chain(2000, name="after").content_hash,
                               budget_bytes=10**9, options=SolveOptions()).key
            assert client.get(f"/v1/jobs/{job_id}").status_code == 404  # nothing half-written
            with sqlite3.connect(inside / "optiremat.sqlite3") as db:
                assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)

            (inside / "ballast").unlink()  # space returns
            wait_until(lambda: client.get("/readyz").status_code == 200, 10, "ready again")
            accepted = client.post("/v1/jobs", json=job)
            assert accepted.status_code == 202 and accepted.json()["id"] == job_id
            wait_until(lambda: client.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded",
                       30, "the job ran")
    finally:
        server.stop()
