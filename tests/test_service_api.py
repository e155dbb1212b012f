"""The REST API against a real server: answers, caching, single-flight, jobs, frontier."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gzip
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from optiremat.solver.solution import Solution, SolveOptions
from optiremat.solver.solve import max_useful_budget, min_feasible_budget, solve
from tests.service_harness import Server, body, chain, layered, metric, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from running_server(tmp_path_factory, workers="2")


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def wait_for_job(client: httpx.Client, job_id: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] not in ("queued", "running"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} still {job['status']} after {timeout_s} s")


def test_a_solve_over_http_equals_the_in_process_solve(client: httpx.Client) -> None:
    graph = layered(12, 6, name="equal")
    low, high = min_feasible_budget(graph), max_useful_budget(graph)
    budget = (low + high) // 2
    response = client.post("/v1/solve", json=body(graph, budget, time_limit_s=20))
    assert response.status_code == 200, response.text
    remote = Solution.model_validate(response.json())
    local = solve(graph, budget, SolveOptions(time_limit_s=20))
    assert remote.fingerprint() == local.fingerprint()
    assert remote.graph_hash == graph.content_hash


def test_the_sync_time_limit_is_capped_by_the_server(client: httpx.Client) -> None:
    graph = chain(8, name="capped")
    response = client.post("/v1/solve", json=body(graph, 10**9, time_limit_s=10_000))
    assert response.status_code == 200
    assert response.json()["options"]["time_limit_s"] == 30.0  # OPTIREMAT_SYNC_TIME_LIMIT_S


def test_64_identical_concurrent_requests_run_the_solver_once(client: httpx.Client,
                                                              server: Server) -> None:
    graph = layered(40, 10, name="single-flight")
    low, high = min_feasible_budget(graph), max_useful_budget(graph)
    request = body(graph, low + (high - low) // 3)
    solves_before = metric(client, "optiremat_solves_total")

    async def fire() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as ac:
            return await asyncio.gather(*(ac.post("/v1/solve", json=request) for _ in range(64)))

    responses = asyncio.run(fire())
    assert [r.status_code for r in responses] == [200] * 64
    assert len({r.content for r in responses}) == 1  # identical bytes, solve_seconds included
    assert metric(client, "optiremat_solves_total") - solves_before == 1


def test_a_repeated_request_is_served_from_the_store(client: httpx.Client) -> None:
    request = body(chain(20, name="repeat"), 40_000)
    first = client.post("/v1/solve", json=request)
    hits, solves = metric(client, "optiremat_cache_hits_total"), metric(
        client, "optiremat_solves_total")
    again = client.post("/v1/solve", json=request)
    assert again.content == first.content
    assert metric(client, "optiremat_cache_hits_total") == hits + 1
    assert metric(client, "optiremat_solves_total") == solves


def test_a_gzip_body_gets_the_same_answer(client: httpx.Client) -> None:
    request = body(chain(12, name="gzip"), 20_000)
    plain = client.post("/v1/solve", json=request)
    zipped = client.post(
        "/v1/solve", content=gzip.compress(json.dumps(request).encode()),
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    assert zipped.status_code == 200, zipped.text
    assert zipped.content == plain.content


def test_a_job_runs_to_its_solution_and_resubmitting_finds_it(client: httpx.Client) -> None:
    graph = layered(10, 6, name="job")
    budget = max_useful_budget(graph) // 2
    submitted = client.post("/v1/jobs", json=body(graph, budget, time_limit_s=20))
    assert submitted.status_code == 202, submitted.text
    job = submitted.json()
    assert submitted.headers["Location"] == f"/v1/jobs/{job['id']}"
    assert job["status"] in ("queued", "running", "succeeded")
    assert job["graph_hash"] == graph.content_hash and job["budget_bytes"] == budget

    again = client.post("/v1/jobs", json=body(graph, budget, time_limit_s=20))
    assert again.json()["id"] == job["id"]

    done = wait_for_job(client, job["id"])
    assert done["status"] == "succeeded"
    sync = client.post("/v1/solve", json=body(graph, budget, time_limit_s=20))
    assert Solution.model_validate(done["solution"]).fingerprint() == Solution.model_validate(
        sync.json()).fingerprint()
    finished = client.post("/v1/jobs", json=body(graph, budget, time_limit_s=20))
    assert finished.status_code == 200 and finished.json()["id"] == job["id"]
    # without API keys every job is listed, newest first
    listed = client.get("/v1/jobs", params={"status": "succeeded"}).json()["jobs"]
    assert listed[0]["id"] == job["id"] and listed[0]["status"] == "succeeded"


def test_the_job_id_is_the_request_hash(client: httpx.Client) -> None:
    graph = chain(6, name="ids")

    def job_id(budget: int, **options: Any) -> str:
        return client.post("/v1/jobs", json=body(graph, budget, **options)).json()["id"]

    first = job_id(9_000)
    assert len(first) == 64 and int(first, 16) >= 0
    assert job_id(9_000) == first
    assert job_id(9_000, tie=True, relative_gap=0.0) == first  # defaults are part of it
    assert job_id(9_001) != first
    assert job_id(9_000, tie=False) != first


def test_an_infeasible_job_fails_with_the_smallest_budget(client: httpx.Client) -> None:
    graph = chain(10, name="infeasible-job")
    job = client.post("/v1/jobs", json=body(graph, 1)).json()
    done = wait_for_job(client, job["id"])
    assert done["status"] == "failed"
    assert done["error"]["min_budget_bytes"] == min_feasible_budget(graph)


def test_an_unknown_job_is_404(client: httpx.Client) -> None:
    for method in ("GET", "DELETE"):
        response = client.request(method, "/v1/jobs/" + "0" * 64)
        assert response.status_code == 404
        assert response.headers["content-type"] == "application/problem+json"


def test_the_frontier_spans_feasible_to_useful_budgets(client: httpx.Client) -> None:
    graph = layered(8, 5, name="frontier")
    response = client.post("/v1/frontier", json={"graph": graph.model_dump(mode="json"),
                                                  "count": 5})
    assert response.status_code == 200, response.text
    frontier = response.json()
    low, high = min_feasible_budget(graph), max_useful_budget(graph)
    assert (frontier["min_feasible_budget"], frontier["max_useful_budget"]) == (low, high)
    points = frontier["points"]
    assert [p["budget_bytes"] for p in points] == [low + (high - low) * i // 4 for i in range(5)]
    flops = [p["recompute_flops"] for p in points]
    assert flops == sorted(flops, reverse=True) and flops[-1] == 0
    assert all(p["residual_bytes"] <= p["budget_bytes"] for p in points)
    assert points[-1]["pareto"]
    for point in points:  # each point is the answer POST /v1/solve gives
        one = client.post("/v1/solve", json=body(graph, point["budget_bytes"])).json()
        assert (one["residual_bytes"], one["recompute_flops"]) == (
            point["residual_bytes"], point["recompute_flops"])


def test_a_frontier_budget_below_the_minimum_is_an_infeasible_point(
        client: httpx.Client) -> None:
    graph = chain(10, name="frontier-budgets")
    low = min_feasible_budget(graph)
    response = client.post("/v1/frontier", json={"graph": graph.model_dump(mode="json"),
                                                  "budgets": [low * 4, low - 1, low * 4]})
    assert response.status_code == 200, response.text
    below, above = response.json()["points"]
    assert below["status"] == "infeasible" and below["min_budget_bytes"] == low
    assert above["status"] == "optimal" and above["pareto"]


def test_the_event_loop_answers_while_a_large_graph_is_checked(server: Server) -> None:
    # ~20 MB, under the 200k-node cap: its check must outlast ten 10 ms probes on a fast
    # machine (40k nodes answered 7-8 here, where the machine was idle).
    request = body(chain(150_000, name="big"), 1 << 60)
    # The last node reads its own output: only the last check (acyclic) fails, so the
    # server validates the whole graph, then answers 422 without solving.
    request["graph"]["input_ids"][-1] = request["graph"]["output_ids"][-1]
    big = json.dumps(request).encode()
    with concurrent.futures.ThreadPoolExecutor(1) as pool, server.client() as client:
        upload = pool.submit(client.post, "/v1/solve", content=big,
                             headers={"Content-Type": "application/json"})
        answered_meanwhile = 0
        while not upload.done():
            probe = client.get("/healthz")  # one at a time: each answered before the next
            assert probe.status_code == 200
            answered_meanwhile += not upload.done()
            time.sleep(0.01)
        assert "cycle" in upload.result().json()["detail"]
    # In the event loop the check would hold every probe until it ended (one or two
    # answered meanwhile, during the upload); in a thread the loop answers each probe
    # while it runs, whatever the machine's load. How fast: bench/service_caps.py.
    assert answered_meanwhile >= 10, answered_meanwhile


def test_health_readiness_and_metrics(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["workers"] == 3  # 2 and the sync lane's
    text = client.get("/metrics").text
    for name in ("optiremat_http_request_duration_seconds", "optiremat_solves_total",
                 "optiremat_solve_seconds", "optiremat_cache_hits_total",
                 "optiremat_queue_depth"):
        assert name in text
    assert 'route="/v1/solve"' in text


def test_each_request_logs_one_line_with_its_id(client: httpx.Client, server: Server) -> None:
    response = client.get("/v1/jobs/nope", headers={"X-Request-ID": "trace-42"})
    assert response.headers["X-Request-ID"] == "trace-42"
    assert response.json()["request_id"] == "trace-42"
    generated = client.get("/healthz").headers["X-Request-ID"]
    time.sleep(0.2)  # let the log line reach the file
    records = server.log_records()
    mine = [r for r in records if r.get("request_id") == "trace-42"]
    assert len(mine) == 1
    assert mine[0]["status"] == 404 and mine[0]["route"] == "/v1/jobs/{job_id}"
    assert mine[0]["method"] == "GET" and mine[0]["duration_ms"] >= 0
    assert len([r for r in records if r.get("request_id") == generated]) == 1
