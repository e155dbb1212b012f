"""Service pieces on their own: settings, body decoding, the SQLite store, the Pareto marks."""

from __future__ import annotations

import asyncio
import gzip
import time
from pathlib import Path
from unittest import mock

import httpx
import pytest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from optiremat.service.api.api_keys import ApiKeys, key_id
from optiremat.service.api.middleware import BodyDecodingMiddleware
from optiremat.service.core.config import Settings
from optiremat.service.core.errors import Unavailable
from optiremat.service.core.keeper import StoreKeeper
from optiremat.service.core.outcome import BudgetRange, Cancelled, Failed, Infeasible, Solved
from optiremat.service.core.store import Evicted, SqliteStore
from optiremat.service.core.tasks import SolveTask
from optiremat.solver.frontier import mark_pareto
from optiremat.solver.solution import SolveOptions, SolveStatus
from optiremat.solver.wire import FrontierPoint, Progress


def test_settings_come_from_optiremat_variables(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    for name in ("PORT", "HOST", "DATA_DIR", "API_KEYS"):
        monkeypatch.delenv(f"OPTIREMAT_{name}", raising=False)
    defaults = Settings()
    assert (defaults.host, defaults.port, defaults.api_keys) == ("127.0.0.1", 8000, ())
    assert "optiremat" in str(defaults.data_dir)
    monkeypatch.setenv("OPTIREMAT_PORT", "9123")
    monkeypatch.setenv("OPTIREMAT_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("OPTIREMAT_API_KEYS", " one, two ,,")
    configured = Settings()
    assert configured.port == 9123 and configured.data_dir == tmp_path
    assert configured.api_keys == ("one", "two")
    assert configured.database_path.parent == tmp_path


async def _echo(request: Request) -> Response:
    return Response(await request.body(), media_type="application/octet-stream")


def decoding_client(limit: int) -> Starlette:
    app = Starlette(routes=[Route("/", _echo, methods=["POST"])])
    app.add_middleware(BodyDecodingMiddleware,
                       settings=Settings(max_body_bytes=limit, body_timeout_s=60.0))
    return app


def post(app: Starlette, content: bytes, encoding: str | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if encoding:
        headers["Content-Encoding"] = encoding

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/", content=content, headers=headers)

    return asyncio.run(send())


def test_gzip_bodies_are_decoded_including_multiple_members() -> None:
    client = decoding_client(1000)
    assert post(client, gzip.compress(b'{"a": 1}'), "gzip").content == b'{"a": 1}'
    two = gzip.compress(b'{"a": ') + gzip.compress(b"1}")
    assert post(client, two, "gzip").content == b'{"a": 1}'
    assert post(client, b"[1, 2]").content == b"[1, 2]"


def test_the_cap_applies_to_decoded_bytes() -> None:
    client = decoding_client(100_000)
    assert post(client, gzip.compress(b" " * 100_000), "gzip").status_code == 200
    bomb = post(client, gzip.compress(b" " * 10_000_000), "gzip")  # 10 kB on the wire
    assert bomb.status_code == 413 and "inflates past 100000" in bomb.json()["detail"]
    assert post(client, b" " * 100_001).status_code == 413


def test_a_graph_over_the_caps_never_reaches_the_app() -> None:
    reached = []

    async def route(request: Request) -> Response:
        reached.append(await request.body())
        return Response(b"{}")

    app = Starlette(routes=[Route("/", route, methods=["POST"])])
    app.add_middleware(BodyDecodingMiddleware, settings=Settings(max_graph_nodes=3))
    answer = post(app, b'{"graph": {"node_id": [0, 1, 2, 3]}}')  # neither auth nor a parse
    assert answer.status_code == 413 and "at least 4 nodes" in answer.json()["detail"]
    assert answer.json()["type"].endswith("graph-too-large") and not reached
    assert post(app, b'{"graph": {"node_id": [0, 1, 2]}}').status_code == 200 and reached


def test_broken_gzip_is_a_400() -> None:
    client = decoding_client(1000)
    assert post(client, gzip.compress(b"{}")[:-6], "gzip").status_code == 400
    assert post(client, b"plain", "gzip").status_code == 400


def test_the_store_keeps_answers_and_jobs(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite3")
    for key, answer in (("a", Solved(solution_json='{"x": 1}')),
                        ("b", Infeasible(budget_bytes=5, min_budget_bytes=77)),
                        ("c", BudgetRange(min_feasible_budget=1, max_useful_budget=9))):
        store.record(key, answer)
        assert store.get_answer(key) == answer
    store.record("a", Solved(solution_json='{"x": 2}'))  # first answer wins: answers never change
    assert store.get_answer("a") == Solved(solution_json='{"x": 1}')
    assert store.get_answer("missing") is None
    store.record("d", Failed(message="no"))  # not an answer: not cached
    assert store.get_answer("d") is None

    task = SolveTask(graph_hash="h", budget_bytes=5, options=SolveOptions())
    store.put_job("j", task, "{}")
    assert store.unfinished_jobs() == [("j", task, "{}")]
    store.record("j", Solved(solution_json='{"x": 1}'), Progress(elapsed_s=1.0))
    store.close()
    reopened = SqliteStore(tmp_path / "db.sqlite3")
    job = reopened.get_job("j")
    assert job is not None and job.task == task and job.outcome == Solved(solution_json='{"x": 1}')
    assert job.progress == Progress(elapsed_s=1.0) and reopened.unfinished_jobs() == []


def test_a_job_keeps_its_graph_only_while_unfinished(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite3")
    tasks = [SolveTask(graph_hash="g", budget_bytes=b, options=SolveOptions()) for b in (1, 2)]
    for i, task in enumerate(tasks):
        store.put_job(f"j{i}", task, '{"graph": "g"}')
    store.record("j0", Cancelled())
    assert [key for key, _, graph in store.unfinished_jobs()] == ["j1"]  # j1 still needs g
    store.record("j1", Failed(message="no"))
    assert store.unfinished_jobs() == []
    store.put_job("j0", tasks[0], '{"graph": "g"}')  # a restart brings the graph again
    assert [(key, graph) for key, _, graph in store.unfinished_jobs()] == [
        ("j0", '{"graph": "g"}')]


def test_pareto_marks_the_points_nothing_beats() -> None:
    def point(budget: int, residual: int, flops: int) -> FrontierPoint:
        return FrontierPoint(budget_bytes=budget, status=SolveStatus.OPTIMAL,
                             residual_bytes=residual, recompute_flops=flops)

    points = [FrontierPoint(budget_bytes=1, status=SolveStatus.INFEASIBLE),
              point(10, 9, 50), point(20, 9, 50), point(30, 25, 60), point(40, 30, 0)]
    mark_pareto(points)
    assert [p.pareto for p in points] == [False, True, True, False, True]


def test_api_keys_come_from_the_variable_and_a_file_read_again_when_it_changes(
        tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# rotated monthly\nfile-key-1\n\n  file-key-2  \n")
    now = [0.0]
    keys = ApiKeys(Settings(api_keys=("inline-key",), api_keys_file=key_file),
                   clock=lambda: now[0])
    owners = {k: keys.owner(k) for k in ("inline-key", "file-key-1", "file-key-2")}
    assert None not in owners.values() and len(set(owners.values())) == 3
    assert owners["file-key-1"] == key_id("file-key-1") != "file-key-1"
    for wrong in ("file-key", "file-key-1x", "", "# rotated monthly"):
        assert keys.owner(wrong) is None

    key_file.write_text("file-key-3\n")
    assert keys.owner("file-key-3") is None  # looked at again at most once a second
    now[0] += 1.0
    assert keys.owner("file-key-3") == key_id("file-key-3")
    assert keys.owner("file-key-1") is None and keys.owner("inline-key") is not None
    key_file.unlink()
    now[0] += 1.0
    assert keys.owner("file-key-3") is not None  # unreadable: the last keys stay


def test_a_key_file_turns_authentication_on_even_while_it_is_empty(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("")
    keys = ApiKeys(Settings(api_keys_file=tmp_path / "keys"))
    assert keys.enabled and keys.owner("anything") is None
    assert not ApiKeys(Settings()).enabled


def test_metrics_behind_a_key_needs_keys(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="OPTIREMAT_METRICS_REQUIRE_KEY needs API keys"):
        Settings(metrics_require_key=True)
    with pytest.raises(ValidationError, match="api_keys_file"):
        Settings(api_keys_file=tmp_path / "missing")
    assert Settings(metrics_require_key=True, api_keys=("k",)).metrics_require_key


def plan(i: int, size: int = 4096) -> Solved:
    return Solved(solution_json=f'{{"i": {i}, "pad": "{"x" * size}"}}')


def test_the_store_stays_within_its_bound_and_evicts_the_least_recently_used(
        tmp_path: Path) -> None:
    bound = 512 * 1024
    evictions: list[Evicted] = []
    store = SqliteStore(tmp_path / "db.sqlite3", max_bytes=bound, on_evict=evictions.append)
    # the WAL's cap (a sixteenth of the bound, 16 pages at least), the frames one write
    # adds past it, and the WAL's 32 KiB index
    slack = 16 * 4096 + 32 * 1024 + 32 * 1024
    for i in range(400):  # 1.6 MB of answers into a 512 KiB store
        store.record(f"k{i}", plan(i))
        if i % 10 == 0:
            assert store.get_answer("k0") == plan(0)  # used all along
        assert store.disk_bytes() <= bound + slack, (i, store.disk_bytes())
    assert sum(e.evicted for e in evictions) > 200
    assert store.get_answer("k0") == plan(0)
    assert store.get_answer("k1") is None  # unused since written: long gone
    assert store.get_answer("k399") == plan(399)


def test_unfinished_and_just_finished_jobs_are_never_evicted(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite3", max_bytes=256 * 1024, job_grace_s=600)
    task = SolveTask(graph_hash="g", budget_bytes=1, options=SolveOptions())
    store.put_job("queued", task, "{}")
    store.put_job("finished", task.model_copy(update={"budget_bytes": 2}), "{}")
    store.record("finished", plan(-1))
    for i in range(100):  # twice the bound: both jobs are the least recently used
        store.record(f"k{i}", plan(i))
    assert store.get_job("queued") is not None and store.get_job("finished") is not None
    with mock.patch("time.time", return_value=time.time() + 601):  # past the grace
        for i in range(100, 200):
            store.record(f"k{i}", plan(i))
    assert store.get_job("finished") is None
    assert store.get_job("queued") is not None
    assert store.unfinished_jobs() == [("queued", task, "{}")]


def test_entries_unused_for_the_ttl_expire(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite3", ttl_s=3600)
    store.record("old", plan(1))
    store.record("read", plan(2))
    later = time.time() + 3000
    with mock.patch("time.time", return_value=later):
        assert store.get_answer("read") is not None  # a read counts as a use
    assert store.maintain(now=later + 1000) == Evicted(expired=1)
    assert store.get_answer("old") is None and store.get_answer("read") is not None


def test_an_outcome_the_store_refused_is_held_then_recorded_once_it_takes_writes(
        tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite3")
    keeper = StoreKeeper(store)
    task = SolveTask(graph_hash="g", budget_bytes=1, options=SolveOptions())
    store.put_job("j", task, "{}")
    # The database may not grow: SQLite answers as it does on a full disk.
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count={pages}")
    answer = plan(0, size=200_000)
    asyncio.run(keeper.record("j", answer, Progress(elapsed_s=2.0)))
    assert keeper.fault is not None and "full" in keeper.fault
    assert keeper.unrecorded("j") == answer  # held, for job views meanwhile
    job = store.get_job("j")
    assert job is not None and job.outcome is None  # nothing half-written
    assert store.get_answer("j") is None
    with pytest.raises(Unavailable, match="cannot be written"):
        keeper.refuse_new_work()
    with pytest.raises(Unavailable):
        asyncio.run(keeper.retry())  # still full

    store._db.execute("PRAGMA max_page_count=1073741823")  # space returns
    asyncio.run(keeper.retry())
    assert keeper.fault is None and keeper.unrecorded("j") is None
    keeper.refuse_new_work()
    job = store.get_job("j")
    assert job is not None and job.outcome == answer and store.get_answer("j") == answer
