"""Sharing workers and runs in cluster mode (a real redis-server, two API replicas, one
worker for anything and one ``--sync-only``): a client's solve is not stuck behind
jobs, a solve stops when every client on every replica hung up, and not before."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from optiremat.service.core.tasks import SolveTask
from optiremat.solver.solution import SolveOptions
from optiremat.solver.solve import max_useful_budget, min_feasible_budget
from optiremat.solver.synthetic import transformer_like
from tests.cluster_harness import Cluster, running_cluster, wait_for
from tests.service_harness import body, chain, metric


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from running_cluster(tmp_path_factory.mktemp("sharing"), apis=2, workers=1,
                               sync_workers=1)


def long_solve(offset: int, time_limit_s: float) -> tuple[dict[str, Any], str]:
    """A solve CP-SAT searches to its time limit, and its request hash."""
    graph = transformer_like(24)
    low, high = min_feasible_budget(graph, tie=False), max_useful_budget(graph)
    request = body(graph, low + (high - low) // 4 + offset, tie=False,
                   time_limit_s=time_limit_s)
    task = SolveTask(graph_hash=graph.content_hash, budget_bytes=request["budget_bytes"],
                     options=SolveOptions.model_validate(request["options"]))
    return request, task.key


def cancel_requested(cluster: Cluster, key: str) -> bool:
    return any('"cancel requested"' in line and key in line
               for line in cluster.worker_log().splitlines())


def test_a_small_solve_is_answered_behind_jobs_filling_every_other_worker(
        cluster: Cluster) -> None:
    api = cluster.apis[0]
    with api.client() as client:
        blockers = [client.post("/v1/jobs", json=long_solve(1000 + i, 600)[0]).json()["id"]
                    for i in range(2)]
        try:
            wait_for(lambda: client.get(f"/v1/jobs/{blockers[0]}").json()["status"]
                     == "running", 30, "the first job running")
            small = client.post("/v1/solve", json=body(chain(5, name="small"), 10**9),
                                timeout=30)
            assert small.status_code == 200, small.text
            assert client.get(f"/v1/jobs/{blockers[1]}").json()["status"] == "queued"
        finally:
            for job_id in blockers:
                client.delete(f"/v1/jobs/{job_id}")


def test_a_solve_stops_when_its_only_client_hung_up(cluster: Cluster) -> None:
    request, key = long_solve(0, time_limit_s=30)
    with cluster.apis[0].client() as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/solve", json=request, timeout=3)
        wait_for(lambda: cancel_requested(cluster, key), 15, "the solve cancelled")
        assert metric(client, "optiremat_abandoned_runs_total") >= 1
    wait_for(lambda: "cancelled" in cluster.run_record(key).get("outcome", ""), 15,
             "the run finished as cancelled")


def test_a_solve_goes_on_while_a_client_on_another_replica_waits(cluster: Cluster) -> None:
    request, key = long_solve(100, time_limit_s=6)

    def patient() -> httpx.Response:
        with cluster.apis[1].client() as client:
            return client.post("/v1/solve", json=request)

    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(patient)
        wait_for(lambda: cluster.run_record(key), 15, "the run queued")
        with cluster.apis[0].client() as client, pytest.raises(httpx.ReadTimeout):
            client.post("/v1/solve", json=request, timeout=2)  # joins, then hangs up
        assert answer.result().status_code == 200
    assert not cancel_requested(cluster, key)
    assert cluster.solves_of(key) == 1
