"""Cluster mode with Redis gone: the API answers 503 with the reason, stays up, and
both it and the worker carry on once Redis is back."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from optiremat.solver.solve import max_useful_budget, min_feasible_budget
from optiremat.solver.synthetic import transformer_like
from tests.cluster_harness import Cluster, running_cluster, wait_for
from tests.service_harness import body, chain


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from running_cluster(tmp_path_factory.mktemp("faults"), apis=1, workers=1)


def test_without_redis_the_api_answers_503_and_the_worker_waits_it_out(
        cluster: Cluster) -> None:
    api, worker = cluster.apis[0], cluster.workers[0]
    with api.client() as client:
        before = client.post("/v1/solve", json=body(chain(5, name="before"), 10**9))
        assert before.status_code == 200
        cluster.redis.stop()

        started = time.monotonic()
        refused = client.post("/v1/solve", json=body(chain(6, name="during"), 10**9))
        assert time.monotonic() - started < 5  # at once, not after a timeout
        assert refused.status_code == 503
        assert refused.headers["content-type"] == "application/problem+json"
        problem = refused.json()
        assert problem["type"] == "urn:optiremat:problem:store-unavailable"
        assert "Redis does not answer" in problem["detail"] and refused.headers["Retry-After"]
        assert client.post("/v1/jobs", json=body(chain(7, name="job"), 10**9)).status_code == 503
        assert "Redis does not answer" in client.get("/readyz").json()["detail"]
        assert client.get("/healthz").status_code == 200

        time.sleep(4)  # a few of the worker's tries
        assert worker.process is not None and worker.process.poll() is None
        assert "Redis" in cluster.worker_log()[-5000:]

        cluster.redis.start()  # same port, same data

        def answered() -> bool:
            try:
                again = client.post("/v1/solve", json=body(chain(6, name="during"), 10**9),
                                    timeout=60)
            except httpx.TransportError:
                return False
            return again.status_code == 200

        wait_for(answered, timeout_s=60, what="a fresh solve once Redis is back")
    assert worker.process.poll() is None


def test_a_solve_that_ends_while_redis_is_down_is_recorded_once_it_is_back(
        cluster: Cluster) -> None:
    graph = transformer_like(24)  # untied, CP-SAT searches it to its time limit
    low, high = min_feasible_budget(graph, tie=False), max_useful_budget(graph)
    request = body(graph, low + (high - low) // 4, tie=False, time_limit_s=3)
    api, worker = cluster.apis[0], cluster.workers[0]
    with api.client() as client:
        job_id = client.post("/v1/jobs", json=request).json()["id"]
        wait_for(lambda: client.get(f"/v1/jobs/{job_id}").json()["status"] == "running",
                 what="solving")
        cluster.redis.stop()
        time.sleep(5)  # the solve ends meanwhile, with nowhere to write
        cluster.redis.start()

        def succeeded() -> bool:
            response = client.get(f"/v1/jobs/{job_id}")
            return response.status_code == 200 and response.json()["status"] == "succeeded"

        wait_for(succeeded, timeout_s=60, what="the job recorded")
    assert cluster.solves_of(job_id) == 1  # recorded, not solved again
    assert worker.process is not None and worker.process.poll() is None
    # RQ's loop met the outage (a heartbeat mid-solve): the process started a new one
    wait_for(lambda: "worker loop ended: Redis does not answer" in cluster.worker_log()
             and cluster.worker_log().count('"msg": "worker started"') >= 2,
             timeout_s=60, what="a new worker after the outage")
