"""The run layer's contracts: one outcome codec for both stores, stable request hashes,
a module graph without cycles in which the two executors never meet; and on a real
Redis, its bounds, its job listing, the shared rate limit and the queue's bound."""

from __future__ import annotations

import ast
import asyncio
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from optiremat.service.core import tasks
from optiremat.service.core.errors import Unavailable
from optiremat.service.core.fair_queue import FairQueue
from optiremat.service.core.graph_text import GraphText
from optiremat.service.core.limits import MemoryRateLimiter
from optiremat.service.core.metrics import Metrics
from optiremat.service.core.outcome import (
    BudgetRange,
    Cancelled,
    Failed,
    Infeasible,
    Interrupted,
    Outcome,
    Solved,
    decode,
    encode,
    reusable,
    settled,
)
from optiremat.service.core.redis_limits import RedisRateLimiter
from optiremat.service.core.redis_store import RedisStore
from optiremat.service.core.rq_executor import RQExecutor
from optiremat.service.core.runs import Withdrawal
from optiremat.service.core.store import SqliteStore
from optiremat.service.core.tasks import BudgetRangeTask, Lane, SolveTask
from optiremat.solver.solution import SolveOptions
from optiremat.solver.step import Memory
from optiremat.solver.wire import JobStatus, Problem
from tests.cluster_harness import RedisServer
from tests.service_harness import REPO, chain

OUTCOMES: list[Outcome] = [
    Solved(solution_json='{"status": "optimal", "b": [1, 2]}'),
    Infeasible(budget_bytes=10, min_budget_bytes=4096),
    BudgetRange(min_feasible_budget=4096, max_useful_budget=65536),
    Failed(message="the worker died"),
    Cancelled(),
    Cancelled(partial=Solved(solution_json='{"status": "feasible"}')),
    Interrupted(),
]


@pytest.mark.parametrize("outcome", OUTCOMES, ids=lambda o: type(o).__name__)
def test_outcomes_survive_the_codec_unchanged(outcome: Outcome) -> None:
    assert decode(encode(outcome).encode()) == outcome
    assert encode(outcome).startswith(f'{{"type":"{outcome.type}"')  # tagged by its type


def test_an_infeasible_answer_keeps_what_its_budget_counts() -> None:
    peak = Infeasible(budget_bytes=10, min_budget_bytes=4096, memory=Memory.PEAK)
    assert decode(encode(peak)) == peak
    # one stored before the outcome recorded it still reads, and claims neither meaning
    stored = decode('{"type":"infeasible","budget_bytes":10,"min_budget_bytes":4096}')
    assert stored == Infeasible(budget_bytes=10, min_budget_bytes=4096)
    assert isinstance(stored, Infeasible) and stored.memory is None
    assert Problem.infeasible(10, 4096, stored.memory).detail == (
        "no plan fits a budget of 10 bytes; the smallest feasible budget for this graph is "
        "4096 bytes")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


def test_both_stores_keep_an_answer_as_the_same_text(tmp_path: Path,
                                                     redis_server: RedisServer) -> None:
    answer = Infeasible(budget_bytes=10, min_budget_bytes=4096)
    task = SolveTask(graph_hash="g", budget_bytes=10, options=SolveOptions())
    sqlite = SqliteStore(tmp_path / "db.sqlite3")
    sqlite.record(task.key, answer)
    sqlite.close()
    with sqlite3.connect(tmp_path / "db.sqlite3") as db:
        (in_sqlite,) = db.execute("SELECT outcome FROM answers").fetchone()

    redis = RedisStore(redis_server.client(), ttl_s=60)
    run, started = redis.ensure_run(task, job=False)
    assert started and redis.finish(run, answer)
    in_redis = redis.redis.get(redis.answer_key(task.key))
    assert in_sqlite == in_redis.decode() == encode(answer)
    assert redis.get_answer(task.key) == answer == decode(in_sqlite)


def test_the_request_hash_is_the_one_of_the_first_release(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Pinned values: a request keeps its job id and cached answer across this layout.
    monkeypatch.setattr(tasks, "solver_version", lambda: "optiremat-0.1.0+ortools-9.0")
    graph_hash = "ab" * 32
    assert SolveTask(graph_hash=graph_hash, budget_bytes=4096, options=SolveOptions()).key == (
        "84ff627e5e0d3b76514f22d3cd5ba75d9b36deaa2753734fcfcb564d4f918c66")
    options = SolveOptions(tie=False, time_limit_s=5, compare_baselines=True)
    assert SolveTask(graph_hash=graph_hash, budget_bytes=4096, options=options).key == (
        "0c0b2fc60a4430cbe13d3ff5d743f0a474a65bdaa402fa5b4394d9bc2b4151b5")
    assert BudgetRangeTask(graph_hash=graph_hash, tie=True).key == (
        "da62ef8e58febe0c11457e03fbc0f76517fd0038f3b0279fff156af927178718")


def test_only_runs_that_answered_are_joined_rather_than_restarted() -> None:
    assert reusable(None)  # still going
    assert [reusable(o) for o in OUTCOMES] == [True, False, True, False, False, False, False]


def test_a_cancel_that_lands_after_optimality_is_proven_changes_nothing() -> None:
    proven = Solved(solution_json='{"status": "optimal"}')
    assert settled(Cancelled(partial=proven)) == proven
    unproven = Cancelled(partial=Solved(solution_json='{"status": "feasible"}'))
    assert settled(unproven) == unproven


# ---- the module graph ---------------------------------------------------------------

SERVICE = REPO / "service"
POOL_SIDE = {"pool", "pool_worker", "pool_executor", "store"}
RQ_SIDE = {"rq_executor", "rq_worker", "redis_store"}


def _module(path: Path) -> str:
    parts = path.relative_to(SERVICE).with_suffix("").parts
    return ".".join(("optiremat.service", *parts)).removesuffix(".__init__")


def _imports(path: Path) -> set[str]:
    """Every optiremat.service module ``path`` imports, at any depth, except under
    ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    skipped = {id(node) for guard in ast.walk(tree) if isinstance(guard, ast.If)
               and ast.unparse(guard.test) == "TYPE_CHECKING"
               for stmt in guard.body for node in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.startswith("optiremat.service")}


def _graph() -> dict[str, set[str]]:
    modules = {_module(path): path for path in SERVICE.rglob("*.py")}
    return {name: _imports(path) & set(modules) - {name} for name, path in modules.items()}


def test_the_service_modules_import_each_other_without_a_cycle() -> None:
    graph = _graph()
    state: dict[str, str] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                pytest.fail("import cycle: " + " -> ".join([*trail, module, target]))
            if target not in state:
                visit(target, [*trail, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_the_run_layer_knows_nothing_of_http_and_the_executors_never_meet() -> None:
    graph = _graph()
    for module, targets in graph.items():
        name = module.rsplit(".", 1)[-1]
        if module.startswith("optiremat.service.core"):
            assert not {t for t in targets if t.startswith("optiremat.service.api")}, module
        if name in POOL_SIDE:
            assert not {t for t in targets if t.rsplit(".", 1)[-1] in RQ_SIDE}, module
        if name in RQ_SIDE:
            assert not {t for t in targets if t.rsplit(".", 1)[-1] in POOL_SIDE}, module


# ---- Redis' bounds ----------------------------------------------------------------


def test_an_unfinished_run_and_its_graph_never_expire_until_it_finishes(
        redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.client(), ttl_s=60)
    store.redis.flushall()
    tasks = [SolveTask(graph_hash="g1", budget_bytes=b, options=SolveOptions()) for b in (1, 2)]
    store.put_graph("g1", "{}")
    runs = [store.ensure_run(task, job=True)[0] for task in tasks]
    ttl = store.redis.ttl
    assert ttl(store.graph_key("g1")) == ttl(store.run_key(tasks[0].key)) == -1  # none
    assert store.has_graph("g1") and ttl(store.graph_key("g1")) == -1  # a use keeps it so

    store.finish(runs[0], Solved(solution_json="{}"))
    assert 0 < ttl(store.run_key(tasks[0].key)) <= 60
    assert ttl(store.graph_key("g1")) == -1  # the second run still needs it
    store.finish(runs[1], Failed(message="no"))
    assert 0 < ttl(store.graph_key("g1")) <= 60

    store.redis.expire(store.answer_key(tasks[0].key), 5)
    assert store.get_answer(tasks[0].key) is not None  # a read renews the lifetime
    assert ttl(store.answer_key(tasks[0].key)) > 5


def test_past_maxmemory_redis_evicts_answers_but_no_unfinished_run(
        redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.client(), ttl_s=3600)
    store.redis.flushall()
    queued = SolveTask(graph_hash="big", budget_bytes=1, options=SolveOptions())
    store.put_graph("big", "x" * 200_000)
    store.ensure_run(queued, job=True)
    used = store.usage().used_bytes
    # docker/: a bound, and volatile-ttl to evict what expires soonest
    store.redis.config_set("maxmemory", used + 1_000_000)
    store.redis.config_set("maxmemory-policy", "volatile-ttl")
    try:
        for i in range(100):  # 4 MB of answers into 1 MB
            task = SolveTask(graph_hash="g", budget_bytes=i, options=SolveOptions())
            store.redis.hset(store.run_key(task.key), mapping={
                "task": task.model_dump_json(), "generation": "g", "created_at": 0,
                "updated_at": 0})
            run = store.get_run(task.key)
            assert run is not None and store.finish(run, plan(i, 40_000))
        usage = store.usage()
        assert usage.evicted_keys > 0 and usage.used_bytes <= usage.max_bytes
        assert store.get_run(queued.key) is not None and store.get_graph("big") is not None
        assert store.queued() == 1
    finally:
        store.redis.config_set("maxmemory", 0)


def plan(i: int, size: int) -> Solved:
    return Solved(solution_json=f'{{"i": {i}, "pad": "{"x" * size}"}}')


def test_redis_lists_a_keys_jobs_newest_first_a_page_at_a_time(
        redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.client(), ttl_s=3600)
    store.redis.flushall()
    runs = []
    for budget in range(5):
        task = SolveTask(graph_hash="g", budget_bytes=budget, options=SolveOptions())
        runs.append(store.ensure_run(task, job=True)[0])
        time.sleep(0.002)  # distinct created_at
    for run in runs[:4]:
        store.submit(run.key, "alpha")
        time.sleep(0.002)  # distinct submission times
    store.submit(runs[0].key, "beta")
    store.finish(runs[1], Failed(message="no"))
    store.ensure_run(SolveTask(graph_hash="g", budget_bytes=99, options=SolveOptions()),
                     job=False)  # not a job: never listed

    def keys(owner: str | None, **kw: Any) -> list[str]:
        jobs, _ = store.list_jobs(owner, kw.get("status"), None, 10)
        return [job.key for job in jobs]

    newest_first = [run.key for run in reversed(runs)]
    assert keys(None) == newest_first
    assert keys("alpha") == newest_first[1:]
    assert keys("beta") == [runs[0].key]
    assert keys("alpha", status=JobStatus.FAILED) == [runs[1].key]
    assert keys(None, status=JobStatus.QUEUED) == [k for k in newest_first if k != runs[1].key]
    assert store.get_job(runs[1].key, "alpha") and store.get_job(runs[0].key, "beta")
    assert not store.get_job(runs[1].key, "beta") and not store.get_job(runs[4].key, "alpha")
    # a key's submission is its own: beta's is later than alpha's, and withdrawn alone
    beta_job, alpha_job = store.get_job(runs[0].key, "beta"), store.get_job(runs[0].key, "alpha")
    assert beta_job and alpha_job and beta_job.created_at > alpha_job.created_at
    assert store.withdraw(runs[0].key, "beta")  # alpha's still wants it
    assert keys("beta", status=JobStatus.CANCELLED) == [runs[0].key]
    assert runs[0].key in keys("alpha", status=JobStatus.QUEUED)
    assert not store.jobs.unwanted(runs[0].key)
    assert not store.withdraw(runs[0].key, "alpha") and not store.wanted(runs[0].key)
    assert store.jobs.unwanted(runs[0].key)
    store.jobs.wait(runs[0].key, "a waiter elsewhere")  # a client on another replica
    assert not store.jobs.unwanted(runs[0].key)
    store.jobs.stop_waiting(runs[0].key, "a waiter elsewhere")
    store.submit(runs[0].key, "beta")  # submitted again: wanted again
    assert store.wanted(runs[0].key) and runs[0].key in keys("beta", status=JobStatus.QUEUED)

    first, after = store.list_jobs("alpha", None, None, 3)
    assert after is not None and [job.key for job in first] == newest_first[1:4]
    rest, _ = store.list_jobs("alpha", None, after, 3)
    assert [job.key for job in rest] == newest_first[4:]

    store.redis.delete(store.run_key(runs[2].key))  # gone from Redis: gone from the index
    assert runs[2].key not in keys("alpha")
    assert store.redis.zscore(store.jobs.jobs_key("alpha"), runs[2].key) is None


# ---- rate limits and the queue's bound ------------------------------------------------


def test_a_client_may_send_a_minutes_worth_at_once_then_one_an_interval() -> None:
    now = [0.0]
    limiter = MemoryRateLimiter(per_minute=6, clock=lambda: now[0])  # one each 10 s

    def wait(client: str = "a") -> float:
        return asyncio.run(limiter.wait_s(client))

    assert [wait() for _ in range(6)] == [0.0] * 6
    assert wait() == pytest.approx(10.0)  # the seventh: one interval to go
    assert wait("b") == 0.0  # every client has its own
    now[0] += 10.0
    assert wait() == 0.0 and wait() == pytest.approx(10.0)
    now[0] += 60.0  # a quiet minute gives the whole burst back
    assert [wait() for _ in range(6)] == [0.0] * 6


def test_redis_counts_every_replicas_requests_against_one_limit(
        redis_server: RedisServer) -> None:
    replicas = [RedisRateLimiter(redis_server.client(), per_minute=4) for _ in range(2)]

    async def burst() -> list[float]:
        return [await replicas[i % 2].wait_s("key k") for i in range(5)]

    waits = asyncio.run(burst())
    assert waits[:4] == [0.0] * 4 and waits[4] == pytest.approx(15.0, abs=0.5)
    assert asyncio.run(replicas[0].wait_s("key other")) == 0.0


def test_past_its_bound_the_queue_refuses_new_runs_but_not_joins(
        redis_server: RedisServer) -> None:
    async def scenario() -> None:
        store = RedisStore(redis_server.client(), ttl_s=3600)
        store.redis.flushall()
        executor = RQExecutor(store, heartbeat_s=1, metrics=Metrics(), max_queued=2)
        graph = GraphText.of(chain(3, name="queued"))
        tasks = [SolveTask(graph_hash=graph.content_hash, budget_bytes=b,
                           options=SolveOptions()) for b in (1, 2, 3)]
        for task in tasks[:2]:  # no worker: both wait in the queue
            assert not await executor.ensure(task, graph, job=True)
        with pytest.raises(Unavailable, match="OPTIREMAT_MAX_QUEUED_JOBS=2"):
            await executor.ensure(tasks[2], graph, job=True)
        assert await executor.ensure(tasks[0], graph, job=False)  # joins its run
        assert store.get_job(tasks[2].key) is None  # the refused one left nothing behind

    asyncio.run(scenario())


# ---- submissions and the waiting line --------------------------------------------------


def _job_in(store: SqliteStore | RedisStore, budget: int) -> str:
    task = SolveTask(graph_hash="g", budget_bytes=budget, options=SolveOptions())
    if isinstance(store, SqliteStore):
        store.put_job(task.key, task, "{}")
    else:
        store.ensure_run(task, job=True)
    return task.key


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_each_owner_withdraws_its_own_submission(kind: str, tmp_path: Path,
                                                 redis_server: RedisServer) -> None:
    store: SqliteStore | RedisStore
    if kind == "sqlite":
        store = SqliteStore(tmp_path / "store.sqlite3")
    else:
        store = RedisStore(redis_server.client(), ttl_s=3600)
        store.redis.flushall()
    key = _job_in(store, 7)
    store.submit(key, "alpha")
    time.sleep(0.002)
    store.submit(key, "beta")
    alpha, beta = store.get_job(key, "alpha"), store.get_job(key, "beta")
    assert alpha and beta and beta.created_at > alpha.created_at
    assert store.get_job(key, "gamma") is None  # not submitted: as absent as no job
    assert store.withdraw(key, "beta")  # alpha still wants it
    beta = store.get_job(key, "beta")
    assert beta and beta.withdrawn == Withdrawal.LEFT and beta.status == JobStatus.CANCELLED
    assert store.get_job(key, "alpha").status == JobStatus.QUEUED  # type: ignore[union-attr]
    assert not store.withdraw(key, "alpha") and not store.wanted(key)
    store.stopped_for(key, "alpha")  # the run stops for alpha: alpha sees how it ends
    assert store.get_job(key, "alpha").withdrawn == Withdrawal.STOPPED  # type: ignore[union-attr]
    assert store.get_job(key, "beta").withdrawn == Withdrawal.LEFT  # type: ignore[union-attr]
    store.submit(key, "beta")  # submitted afresh
    assert store.wanted(key) and store.get_job(key, "beta").withdrawn == Withdrawal.NONE  # type: ignore[union-attr]


def test_a_store_of_schema_2_keeps_its_jobs_each_submitted_once(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    store = SqliteStore(path)
    owned, anonymous = _job_in(store, 1), _job_in(store, 2)
    store.submit(owned, "alpha")
    store.close()
    with sqlite3.connect(path) as db:  # back to schema 2: no withdrawals, anonymous jobs unowned
        db.execute("DELETE FROM job_owners WHERE owner = ''")
        db.execute("ALTER TABLE job_owners DROP COLUMN cancelled")
        db.execute("PRAGMA user_version=2")
    store = SqliteStore(path)
    assert store.get_job(owned, "alpha") is not None and store.get_job(anonymous) is not None
    assert store.wanted(owned) and store.wanted(anonymous)  # ANONYMOUS's, from the upgrade
    assert not store.withdraw(anonymous, None) and not store.wanted(anonymous)


def test_the_waiting_line_serves_sync_first_and_owners_in_turn() -> None:
    async def scenario() -> tuple[list[str], list[str], str | None]:
        line: FairQueue[str] = FairQueue()
        for client, count in (("flood", 4), ("one", 1), ("two", 2)):
            for i in range(count):
                line.put(f"{client}{i}", Lane.BACKGROUND, client)
        line.put("sync0", Lane.SYNC, "flood")
        both = (Lane.SYNC, Lane.BACKGROUND)
        assert line.take((Lane.SYNC,)) == "sync0"
        sync_only_waits = asyncio.ensure_future(line.get((Lane.SYNC,)))
        taken = [await line.get(both) for _ in range(7)]
        await asyncio.sleep(0)
        assert not sync_only_waits.done()  # it never takes a job
        line.put("sync1", Lane.SYNC, "one")
        line.put("late", Lane.BACKGROUND, "one")
        sync_taken = [await sync_only_waits]
        return taken, sync_taken, line.take(both)

    taken, sync_taken, last = asyncio.run(scenario())
    assert taken == ["flood0", "one0", "two0", "flood1", "two1", "flood2", "flood3"]
    assert sync_taken == ["sync1"] and last == "late"


def test_a_graph_text_is_the_graph_s_canonical_json_and_content_hash() -> None:
    graph = chain(5, name="text")
    text = GraphText.of(graph)
    assert text.json == graph.canonical_json()
    assert text.content_hash == graph.content_hash
    assert "chars" in repr(text) and text.json not in repr(text)
