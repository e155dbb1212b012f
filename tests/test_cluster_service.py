"""Cluster mode on a real redis-server, two API replicas and two RQ workers.

One cluster serves the whole module; the Redis restart comes last.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

import httpx
import pytest

from optiremat.solver.graph import CostGraph
from optiremat.solver.solve import max_useful_budget, min_feasible_budget
from optiremat.solver.synthetic import transformer_like
from tests.cluster_harness import Cluster, running_cluster, wait_for
from tests.service_harness import Server, body, layered, tangled


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from running_cluster(tmp_path_factory.mktemp("cluster"))


@cache
def _transformer() -> tuple[CostGraph, int]:
    graph = transformer_like(24)
    low, high = min_feasible_budget(graph, tie=False), max_useful_budget(graph)
    return graph, low + (high - low) // 10


def slow_request(variant: int, time_limit_s: float = 4) -> dict[str, Any]:
    """Untied with a tight budget: a plan after a couple of seconds, then the search
    runs to its time limit. ``variant`` makes a distinct request."""
    graph, budget = _transformer()
    return body(graph, budget + 4096 * variant, tie=False, time_limit_s=time_limit_s)


def post(api: Server, path: str, request: dict[str, Any]) -> httpx.Response:
    with api.client() as client:
        return client.post(path, json=request)


def job_of(api: Server, job_id: str) -> dict[str, Any]:
    with api.client() as client:
        return client.get(f"/v1/jobs/{job_id}").json()


def finished(api: Server, job_id: str, timeout_s: float = 60) -> dict[str, Any]:
    return wait_for(lambda: (job := job_of(api, job_id))["status"] not in ("queued", "running")
                    and job, timeout_s, f"job {job_id} finished")


def test_32_clients_on_two_replicas_get_one_solve_and_one_answer(cluster: Cluster) -> None:
    graph = tangled(60, 12, seed=5, name="crowd")  # about a second of solving
    request = body(graph, max_useful_budget(graph) // 4, tie=False, time_limit_s=20)
    start = threading.Barrier(32)

    def ask(i: int) -> httpx.Response:
        with cluster.apis[i % 2].client() as client:
            start.wait()
            return client.post("/v1/solve", json=request)

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, range(32)))
    assert {a.status_code for a in answers} == {200}
    assert len({a.content for a in answers}) == 1
    job = post(cluster.apis[0], "/v1/jobs", request)
    assert job.status_code == 200 and job.json()["status"] == "succeeded"
    assert cluster.solves_of(job.json()["id"]) == 1


def test_a_worker_killed_mid_solve_leaves_the_job_to_the_other_worker(cluster: Cluster) -> None:
    api = cluster.apis[0]
    job_id = post(api, "/v1/jobs", slow_request(1)).json()["id"]
    victim_name = wait_for(lambda: cluster.run_record(job_id).get("worker"), what="solve started")
    victim = next(w for w in cluster.workers if w.name == victim_name)
    assert job_of(api, job_id)["status"] == "running"
    victim.kill_mid_solve()

    done = finished(cluster.apis[1], job_id)
    assert done["status"] == "succeeded", done
    assert cluster.run_record(job_id)["worker"] != victim_name  # the survivor solved it
    assert cluster.solves_of(job_id) == 1  # the killed attempt never finished
    assert job_of(api, job_id) == done
    cluster.workers.remove(victim)
    cluster.add_worker().wait_listening()


def test_a_job_whose_workers_all_die_fails_with_the_reason(cluster: Cluster) -> None:
    job_id = post(cluster.apis[1], "/v1/jobs", slow_request(2)).json()["id"]
    killed = set()
    for _attempt in range(2):  # the first run and its one retry
        name = wait_for(lambda: (w := cluster.run_record(job_id).get("worker")) not in killed
                        and w, what="an attempt started")
        victim = next(w for w in cluster.workers if w.name == name)
        victim.kill_mid_solve()
        killed.add(name)
        cluster.workers.remove(victim)
        cluster.add_worker()  # the next attempt needs a worker; the last one stays idle

    done = finished(cluster.apis[0], job_id)
    assert done["status"] == "failed"
    assert done["error"]["type"] == "urn:optiremat:problem:solve-failed"
    assert "stopped heartbeating" in done["error"]["detail"]
    assert "2 attempts" in done["error"]["detail"]
    for worker in cluster.workers:
        worker.wait_listening()

    # a new submission starts it again
    again = post(cluster.apis[0], "/v1/jobs", slow_request(2))
    assert again.status_code == 202 and again.json()["status"] in ("queued", "running")
    rerun = finished(cluster.apis[1], job_id)
    assert rerun["status"] == "succeeded", rerun


def test_cancel_reaches_the_solve_on_whichever_worker_runs_it(cluster: Cluster) -> None:
    job_id = post(cluster.apis[0], "/v1/jobs", slow_request(3, time_limit_s=60)).json()["id"]
    wait_for(lambda: (job_of(cluster.apis[0], job_id)["progress"] or {}).get("incumbent_flops"),
             what="an incumbent")
    started = time.monotonic()
    with cluster.apis[1].client() as client:  # the other replica
        stopped = client.delete(f"/v1/jobs/{job_id}").json()
    assert time.monotonic() - started < 2.0
    assert f'"cancel requested", "job": "{job_id}"' in cluster.worker_log()
    # The solve stopped long before its 60 s and kept its best plan: the job is
    # cancelled, or succeeded when the plan was proven optimal before the cancel landed
    # (as in the embedded mode).
    assert stopped["solution"]["solve_seconds"] < 30
    assert (stopped["status"], stopped["solution"]["status"]) in (
        ("cancelled", "feasible"), ("succeeded", "optimal"))
    assert cluster.solves_of(job_id) == 1
    assert job_of(cluster.apis[0], job_id) == stopped


def test_restarting_an_api_replica_loses_nothing(cluster: Cluster) -> None:
    api = cluster.apis[0]
    request = slow_request(4)
    job_id = post(api, "/v1/jobs", request).json()["id"]
    wait_for(lambda: job_of(api, job_id)["status"] == "running", what="running")

    assert api.process is not None
    api.process.kill()  # a crash, not a graceful stop
    api.process.wait()
    api.start()  # same port and settings, a fresh process

    done = finished(api, job_id)
    assert done["status"] == "succeeded"
    assert done == job_of(cluster.apis[1], job_id)
    answer = post(api, "/v1/solve", request)
    assert answer.status_code == 200 and answer.json() == done["solution"]
    assert cluster.solves_of(job_id) == 1


def test_any_replica_lists_the_jobs_newest_first(cluster: Cluster) -> None:
    graph = layered(6, 4, name="listed")
    ids = [post(cluster.apis[i % 2], "/v1/jobs", body(graph, 10**9 + i)).json()["id"]
           for i in range(3)]
    for job_id in ids:
        finished(cluster.apis[0], job_id)
    with cluster.apis[1].client() as client:
        listing = client.get("/v1/jobs", params={"limit": 2}).json()
        assert [job["id"] for job in listing["jobs"]] == ids[:0:-1]
        rest = client.get("/v1/jobs", params={"limit": 2, "cursor": listing["next_cursor"]})
    assert rest.json()["jobs"][0]["id"] == ids[0]
    assert listing["jobs"][0]["status"] == job_of(cluster.apis[0], ids[2])["status"]


def test_a_redis_restart_keeps_every_finished_result(cluster: Cluster) -> None:
    graph = layered(8, 6, name="durable")
    requests = [body(graph, max_useful_budget(graph) * k // 4, time_limit_s=10) for k in (1, 2, 3)]
    answers = [post(cluster.apis[0], "/v1/solve", r).content for r in requests]
    job_id = post(cluster.apis[0], "/v1/jobs", requests[0]).json()["id"]
    job = job_of(cluster.apis[0], job_id)
    assert job["status"] == "succeeded"
    solves = cluster.worker_log().count('"task finished"')

    cluster.redis.kill()  # SIGKILL: what is left is what the append-only file kept
    cluster.redis.start()  # same port, same data directory

    assert [post(cluster.apis[1], "/v1/solve", r).content for r in requests] == answers
    assert job_of(cluster.apis[1], job_id) == job
    assert cluster.worker_log().count('"task finished"') == solves  # all from Redis
    # and the cluster still solves: workers and replicas reconnect by themselves
    fresh = post(cluster.apis[0], "/v1/solve", body(graph, max_useful_budget(graph) // 5))
    assert fresh.status_code == 200
