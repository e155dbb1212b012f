"""Sharing the workers and the runs between clients, on a real server: a client's small
solve is not stuck behind another's jobs, a solve nobody waits on any more stops, and
an identical job of another key is that key's own submission."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from optiremat.solver.solve import max_useful_budget, min_feasible_budget
from optiremat.solver.synthetic import transformer_like
from tests.service_harness import Server, body, chain, metric, running_server

KEYS = {"alpha": "sharing-alpha-key", "beta": "sharing-beta-key"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # one worker for anything and (the default) one for solves a client waits on
    yield from running_server(tmp_path_factory, workers="1", api_keys=",".join(KEYS.values()))


def as_(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not {what} after {timeout_s} s"
        time.sleep(0.05)


def long_solve(offset: int, time_limit_s: float = 30) -> dict[str, Any]:
    """A solve CP-SAT searches to its time limit; ``offset`` tells apart requests for
    budgets a few bytes apart."""
    graph = transformer_like(24)
    low, high = min_feasible_budget(graph, tie=False), max_useful_budget(graph)
    return body(graph, low + (high - low) // 4 + offset, tie=False, time_limit_s=time_limit_s)


def blocker(index: int) -> dict[str, Any]:
    """A job that runs until it is cancelled."""
    return long_solve(1000 + index, time_limit_s=600)


def test_a_small_solve_is_answered_behind_another_keys_six_long_jobs(server: Server) -> None:
    with server.client() as client:
        jobs = [client.post("/v1/jobs", json=blocker(seed), headers=as_("alpha")).json()["id"]
                for seed in range(6)]
        try:
            wait_until(lambda: metric(client, "optiremat_busy_workers") == 1, 30,
                       "running the first job")
            # Without the sync lane this waits for six 600 s jobs: the timeout fails it.
            small = client.post("/v1/solve", json=body(chain(5, name="small"), 10**9),
                                headers=as_("beta"), timeout=30)
            assert small.status_code == 200, small.text
            statuses = [client.get(f"/v1/jobs/{j}", headers=as_("alpha")).json()["status"]
                        for j in jobs]
            assert statuses.count("running") == 1 and statuses.count("queued") == 5
        finally:
            for job_id in jobs:
                client.delete(f"/v1/jobs/{job_id}", headers=as_("alpha"))
        wait_until(lambda: metric(client, "optiremat_busy_workers") == 0, 30, "idle")


@pytest.mark.parametrize("route", ["/v1/solve", "/v1/frontier"])
def test_a_solve_stops_when_every_client_waiting_on_it_hung_up(server: Server,
                                                               route: str) -> None:
    request = long_solve(0 if route == "/v1/solve" else 10)
    if route == "/v1/frontier":
        budget = request.pop("budget_bytes")
        request["budgets"] = [budget, budget + 1]
    with server.client() as client:
        before = metric(client, "optiremat_abandoned_runs_total")
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up
            client.post(route, json=request, headers=as_("beta"), timeout=2)
        # the solves would hold the workers for 30 s: they stop within seconds
        wait_until(lambda: metric(client, "optiremat_busy_workers") == 0, 10,
                   "idle after the hang-up")
        assert metric(client, "optiremat_abandoned_runs_total") > before
        # nothing was cached: asked again, it is solved again (a short limit this time)
        request["options"]["time_limit_s"] = 1
        again = client.post(route, json=request, headers=as_("beta"))
        assert again.status_code == 200, again.text


def test_another_keys_identical_job_is_its_own_submission(server: Server) -> None:
    job = blocker(99)
    with server.client() as client:
        first = client.post("/v1/jobs", json=job, headers=as_("alpha")).json()
        time.sleep(0.05)
        second = client.post("/v1/jobs", json=job, headers=as_("beta")).json()
        assert second["id"] == first["id"]
        assert second["created_at"] > first["created_at"]  # when beta submitted, not alpha
        job_id = first["id"]
        try:
            wait_until(lambda: metric(client, "optiremat_busy_workers") == 1, 30, "running")
            # beta cancelling withdraws beta's submission only
            mine = client.delete(f"/v1/jobs/{job_id}", headers=as_("beta")).json()
            assert mine["status"] == "cancelled" and mine["solution"] is None
            assert mine["progress"] is None
            theirs = client.get(f"/v1/jobs/{job_id}", headers=as_("alpha")).json()
            assert theirs["status"] == "running"
            assert metric(client, "optiremat_busy_workers") == 1
            listed = client.get("/v1/jobs", params={"status": "cancelled"},
                                headers=as_("beta")).json()["jobs"]
            assert job_id in [j["id"] for j in listed]
            listed = client.get("/v1/jobs", params={"status": "running"},
                                headers=as_("alpha")).json()["jobs"]
            assert [j["id"] for j in listed] == [job_id]
            # submitted again, beta's submission is live again and sees the same run
            again = client.post("/v1/jobs", json=job, headers=as_("beta")).json()
            assert again["status"] == "running" and again["created_at"] > second["created_at"]
            client.delete(f"/v1/jobs/{job_id}", headers=as_("beta"))
        finally:
            # the last submission withdrawn: the solve stops
            last = client.delete(f"/v1/jobs/{job_id}", headers=as_("alpha")).json()
        assert last["status"] == "cancelled"
        wait_until(lambda: metric(client, "optiremat_busy_workers") == 0, 10, "stopped")
