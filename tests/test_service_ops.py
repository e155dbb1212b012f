"""Operating the service for weeks: a bounded store, job listing, rate limits and a
bounded queue, each against a real server on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from optiremat.solver.solve import max_useful_budget, min_feasible_budget
from tests.service_harness import Server, body, chain, metric, running_server

STORE_BOUND = 256 * 1024


def finished(client: httpx.Client, job_id: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] not in ("queued", "running"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} still {job['status']} after {timeout_s} s")


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from running_server(tmp_path_factory, workers="1", store_max_bytes=str(STORE_BOUND),
                              store_job_grace_s="0")


def test_past_its_bound_the_store_evicts_and_an_evicted_job_is_a_clean_404(
        small_store: Server) -> None:
    graph = chain(1000, name="bounded", tied=True)  # answers of 12 KB
    low, high = min_feasible_budget(graph), max_useful_budget(graph)
    budgets = [low + (high - low) * i // 30 for i in range(30)]
    with small_store.client() as client:
        job = client.post("/v1/jobs", json=body(graph, budgets[0])).json()
        solution = finished(client, job["id"])["solution"]
        for budget in budgets[1:]:  # 1.4 times the bound in answers
            assert client.post("/v1/solve", json=body(graph, budget)).status_code == 200
        assert metric(client, 'optiremat_store_evictions_total{reason="size"}') > 0
        # the WAL's cap (a sixteenth of the bound, 16 pages at least), one write and the index
        assert metric(client, "optiremat_store_bytes") <= STORE_BOUND + 128 * 1024
        assert metric(client, "optiremat_store_max_bytes") == STORE_BOUND

        gone = client.get(f"/v1/jobs/{job['id']}")
        assert gone.status_code == 404
        assert gone.headers["content-type"] == "application/problem+json"
        assert job["id"] in gone.json()["detail"]
        again = client.post("/v1/jobs", json=body(graph, budgets[0]))  # solved again
        assert again.status_code == 202 and again.json()["id"] == job["id"]
        assert finished(client, job["id"])["solution"]["saved_keys"] == solution["saved_keys"]
