"""Operating the service for weeks: a bounded store, job listing, rate limits and a
bounded queue, each against a real server on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from optiremat.solver.solve import max_useful_budget, min_feasible_budget
from tests.service_harness import Server, body, chain, metric, running_server, tangled

STORE_BOUND = 256 * 1024


def finished(client: httpx.Client, job_id: str, timeout_s: float = 60,
             **headers: str) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = client.get(f"/v1/jobs/{job_id}", headers=headers)
        assert response.status_code == 200, response.text
        job = response.json()
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


# ---- GET /v1/jobs -------------------------------------------------------------------

KEYS = {"alpha": "alpha-key", "beta": "beta-key"}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from running_server(tmp_path_factory, workers="1", api_keys=",".join(KEYS.values()))


def as_(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


def page(client: httpx.Client, who: str, **params: Any) -> dict[str, Any]:
    response = client.get("/v1/jobs", params=params, headers=as_(who))
    assert response.status_code == 200, response.text
    return response.json()


def test_each_key_lists_the_jobs_it_submitted_newest_first(keyed: Server) -> None:
    requests = [body(chain(4 + i, name=f"listed-{i}"), 10**9) for i in range(4)]
    with keyed.client() as client:
        def submit(who: str, request: dict[str, Any]) -> str:
            response = client.post("/v1/jobs", json=request, headers=as_(who))
            assert response.status_code in (200, 202), response.text
            return str(response.json()["id"])

        alphas = [submit("alpha", r) for r in requests[:3]]
        beta = submit("beta", requests[3])
        shared = submit("beta", requests[0])  # alpha's first job, submitted again by beta
        assert shared == alphas[0]
        for job_id in alphas:
            finished(client, job_id, **as_("alpha"))
        finished(client, beta, **as_("beta"))

        first = page(client, "alpha", limit=2)
        assert [j["id"] for j in first["jobs"]] == alphas[:0:-1]  # newest first
        assert "solution" not in first["jobs"][0]  # a summary: the job itself has the plan
        second = page(client, "alpha", limit=2, cursor=first["next_cursor"])
        assert [j["id"] for j in second["jobs"]] == alphas[:1]
        assert second["next_cursor"] is None
        assert {j["id"] for j in page(client, "beta")["jobs"]} == {beta, alphas[0]}
        assert page(client, "beta", status="failed")["jobs"] == []
        assert len(page(client, "alpha", status="succeeded")["jobs"]) == 3


def test_another_keys_job_is_not_found_by_any_per_job_route(keyed: Server) -> None:
    blocker = body(tangled(20, 8, seed=5, name="owned"), 10**6, tie=False, time_limit_s=600)
    with keyed.client() as client:
        job_id = client.post("/v1/jobs", json=blocker, headers=as_("alpha")).json()["id"]
        try:
            for method in ("GET", "DELETE"):
                response = client.request(method, f"/v1/jobs/{job_id}", headers=as_("beta"))
                assert response.status_code == 404, (method, response.text)
                assert response.headers["content-type"] == "application/problem+json"
                assert response.json()["detail"].startswith(f"no job {job_id!r}")
            # as absent as a job that never was: the same answer, only the id differs
            absent = client.get("/v1/jobs/" + "0" * len(job_id), headers=as_("beta")).json()
            assert absent["detail"].replace("0" * len(job_id), job_id) == response.json()["detail"]
            assert client.get(f"/v1/jobs/{job_id}", headers=as_("alpha")).json()["status"] in (
                "queued", "running")  # beta's DELETE cancelled nothing
        finally:
            client.delete(f"/v1/jobs/{job_id}", headers=as_("alpha"))
        # submitting the same request makes beta an owner too
        assert client.post("/v1/jobs", json=blocker, headers=as_("beta")).json()["id"] == job_id
        assert client.get(f"/v1/jobs/{job_id}", headers=as_("beta")).status_code == 200
        client.delete(f"/v1/jobs/{job_id}", headers=as_("beta"))


def test_the_status_filter_sees_queued_and_running_jobs(keyed: Server) -> None:
    blocker = body(tangled(20, 8, seed=4, name="blocker"), 10**6, tie=False, time_limit_s=600)
    with keyed.client() as client:
        slow = client.post("/v1/jobs", json=blocker, headers=as_("alpha")).json()["id"]
        waiting = client.post("/v1/jobs", json=body(chain(6, name="waits"), 10**9),
                              headers=as_("alpha")).json()["id"]
        try:
            deadline = time.monotonic() + 30
            while [j["id"] for j in page(client, "alpha", status="running")["jobs"]] != [slow]:
                assert time.monotonic() < deadline, "the slow job never showed as running"
                time.sleep(0.05)
            assert [j["id"] for j in page(client, "alpha", status="queued")["jobs"]] == [waiting]
        finally:
            for job_id in (waiting, slow):
                client.delete(f"/v1/jobs/{job_id}", headers=as_("alpha"))
        assert {j["id"] for j in page(client, "alpha", status="cancelled")["jobs"]} >= {waiting}


@pytest.mark.parametrize(("params", "words"), [
    ({"cursor": "not-a-cursor"}, ["cursor", "not a cursor this server handed out"]),
    ({"limit": 0}, ["limit"]),
    ({"limit": 101}, ["limit"]),
    ({"status": "lost"}, ["status"]),
])
def test_a_bad_listing_query_is_a_422_naming_the_parameter(keyed: Server, params: dict[str, Any],
                                                          words: list[str]) -> None:
    with keyed.client() as client:
        response = client.get("/v1/jobs", params=params, headers=as_("alpha"))
    assert response.status_code == 422
    assert response.headers["content-type"] == "application/problem+json"
    assert all(word in response.json()["detail"] for word in words), response.json()


# ---- rate limits and the queue's bound ------------------------------------------------


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from running_server(tmp_path_factory, workers="1", api_keys=",".join(KEYS.values()),
                              rate_limit_per_minute="3")


def test_over_its_rate_limit_a_key_gets_429_with_retry_after(limited: Server) -> None:
    requests = [body(chain(3 + i, name=f"limited-{i}"), 10**9) for i in range(4)]
    with limited.client() as client:
        answers = [client.post("/v1/solve", json=r, headers=as_("alpha")) for r in requests]
        assert [a.status_code for a in answers] == [200, 200, 200, 429]
        problem = answers[3].json()
        assert answers[3].headers["content-type"] == "application/problem+json"
        assert problem["type"] == "urn:optiremat:problem:rate-limited"
        assert "OPTIREMAT_RATE_LIMIT_PER_MINUTE" in problem["detail"]
        assert 1 <= int(answers[3].headers["Retry-After"]) <= 20  # a third of a minute
        # answers from the cache are not counted, nor are reads; other keys have their own
        again = client.post("/v1/solve", json=requests[0], headers=as_("alpha"))
        assert again.status_code == 200 and again.content == answers[0].content
        assert client.get("/v1/jobs", headers=as_("alpha")).status_code == 200
        assert client.post("/v1/jobs", json=requests[3], headers=as_("alpha")).status_code == 429
        assert client.post("/v1/solve", json=requests[3], headers=as_("beta")).status_code == 200
        assert metric(client, 'optiremat_rejected_requests_total{reason="rate_limit"}') == 2


def statuses_with_forwarded_for(server: Server, name: str) -> list[int]:
    """Five solves from loopback, each claiming another client in X-Forwarded-For."""
    with server.client() as client:
        return [client.post("/v1/solve", json=body(chain(3 + i, name=f"{name}-{i}"), 10**9),
                            headers={"X-Forwarded-For": f"203.0.113.{i}"}).status_code
                for i in range(5)]


@pytest.mark.parametrize(("trusted", "statuses"), [
    (None, [200, 200, 200, 429, 429]),  # the default trusts no proxy: one bucket, loopback's
    ("127.0.0.1", [200] * 5),  # a trusted proxy names each client: five buckets
])
def test_x_forwarded_for_picks_a_rate_limit_bucket_only_from_a_trusted_proxy(
        tmp_path_factory: pytest.TempPathFactory, trusted: str | None,
        statuses: list[int]) -> None:
    settings = {"workers": "1", "rate_limit_per_minute": "3"}
    if trusted is not None:
        settings["forwarded_allow_ips"] = trusted
    for server in running_server(tmp_path_factory, **settings):
        assert statuses_with_forwarded_for(server, f"xff-{trusted}") == statuses


@pytest.fixture(scope="module")
def short_queue(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from running_server(tmp_path_factory, workers="1", max_queued_jobs="1")


def test_past_its_bound_the_queue_answers_503_and_takes_work_again_after(
        short_queue: Server) -> None:
    blocker = body(tangled(20, 8, seed=6, name="blocker"), 10**6, tie=False, time_limit_s=600)
    with short_queue.client() as client:
        slow = client.post("/v1/jobs", json=blocker).json()["id"]
        queued = client.post("/v1/jobs", json=body(chain(5, name="q1"), 10**9)).json()["id"]
        refused = client.post("/v1/jobs", json=body(chain(5, name="q2"), 10**9))
        assert refused.status_code == 503
        assert refused.json()["type"] == "urn:optiremat:problem:queue-full"
        assert "OPTIREMAT_MAX_QUEUED_JOBS=1" in refused.json()["detail"]
        assert refused.headers["Retry-After"] == "10"
        assert client.get("/v1/jobs", params={"status": "queued"}).json()["jobs"][0]["id"] == (
            queued)  # the refused job left nothing behind
        client.delete(f"/v1/jobs/{slow}")
        assert finished(client, queued)["status"] == "succeeded"
        again = client.post("/v1/jobs", json=body(chain(5, name="q2"), 10**9))
        assert again.status_code in (200, 202), again.text
        assert metric(client, 'optiremat_rejected_requests_total{reason="queue_full"}') == 1
    # the 503 is logged at error level with its request id and what went wrong; the rest
    # at info (/readyz answered 503 too, while the server started)
    lines = [r for r in short_queue.log_records()
             if r.get("logger") == "optiremat.access" and r["path"] == "/v1/jobs"]
    errors = [r for r in lines if r["level"] == "error"]
    assert [(r["request_id"], r["status"]) for r in errors] == [
        (refused.headers["X-Request-ID"], 503)]
    assert "OPTIREMAT_MAX_QUEUED_JOBS=1" in errors[0]["detail"]
    assert {r["level"] for r in lines if r["status"] < 500} == {"info"}
