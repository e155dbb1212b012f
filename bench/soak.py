"""A soak of the embedded service: mixed traffic for minutes, then what it left behind.

    .venv/bin/python bench/soak.py                  # 10 minutes, the issue's soak
    .venv/bin/python bench/soak.py --duration 60    # a short one

Starts ``optiremat serve`` on loopback with a small store bound (so eviction runs
all along) and several API keys under a rate limit, then keeps ``--concurrency``
clients busy until ``--duration`` seconds or ``--max-requests`` requests, whichever
comes first. The mix: answers from the cache (the same body again), the same
request in a new body, fresh solves of distinct budgets, frontiers, jobs polled to
their end, slow jobs cancelled while they run, job listings and reads, and bad input
(malformed JSON, an invalid graph, a wrong content type, an unknown job).

Prints the 5xx count (must be 0), the RSS of the API process and of its worker
processes after a warm-up (the first tenth of the run) and at the end (growth must
stay under 10%), the cached answer's p50/p99 (p99 at most 20 ms), how long a
cancel of a slow job took to answer (p50 and the slowest: the solve stops and hands
back its best plan first) and the store's size on disk at the end against its bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.service import percentile  # noqa: E402
from optiremat.solver.graph import CostGraph  # noqa: E402
from optiremat.solver.solve import max_useful_budget, min_feasible_budget  # noqa: E402
from tests.service_harness import Server, chain, layered, metric, tangled  # noqa: E402

KEYS = [f"soak-key-{i}" for i in range(4)]
HEADERS = {"Content-Type": "application/json"}
PROBE_EVERY_S = 0.05
# (action, weight): what a client does next
MIX = [("cached", 40), ("reparsed", 5), ("fresh", 15), ("frontier", 5), ("job", 8),
       ("cancelled", 4), ("bad", 10), ("listing", 8), ("read", 5)]


@dataclass(frozen=True)
class Workload:
    graph: dict[str, Any]  # the JSON form, made once: the clients must not be the bottleneck
    low: int
    high: int

    def body(self, budget: int, **options: Any) -> dict[str, Any]:
        return {"graph": self.graph, "budget_bytes": budget, "options": options}


def workload(graph: CostGraph) -> Workload:
    return Workload(graph.model_dump(mode="json"), min_feasible_budget(graph),
                    max_useful_budget(graph))


def workloads() -> list[Workload]:
    graphs = [chain(n, name=f"soak-chain-{n}") for n in (20, 60, 150)]
    graphs += [layered(layers, 6, name=f"soak-layered-{layers}") for layers in (4, 8, 16)]
    return [workload(g) for g in graphs]


@dataclass
class Tally:
    statuses: Counter[str] = field(default_factory=Counter)
    by_action: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    requests: int = 0
    cancel_ms: list[float] = field(default_factory=list)  # DELETE's round trip, answered

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status.startswith("5"))


class Client:
    def __init__(self, http: httpx.AsyncClient, index: int, tally: Tally,
                 work: list[Workload], cached_body: bytes) -> None:
        self.http = http
        self.rnd = random.Random(index)
        self.key = KEYS[index % len(KEYS)]
        self.tally = tally
        self.work = work
        self.cached_body = cached_body
        self.job_ids: list[str] = []

    async def send(self, method: str, path: str, *, expect: tuple[int, ...],
                   **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.key}", **kwargs.pop("headers", {})}
        response = await self.http.request(method, path, headers=headers, **kwargs)
        self.tally.requests += 1
        self.tally.statuses[str(response.status_code)] += 1
        if response.status_code not in (*expect, 429):
            self.tally.unexpected.append(f"{method} {path}: {response.status_code} "
                                         f"{response.text[:200]}")
        return response

    def fresh_body(self, **options: Any) -> dict[str, Any]:
        w = self.rnd.choice(self.work)
        return w.body(self.rnd.randint(w.low, w.high), **options)

    async def cached(self) -> None:
        await self.send("POST", "/v1/solve", content=self.cached_body, headers=HEADERS,
                        expect=(200,))

    async def reparsed(self) -> None:  # the same request, a body new to the server
        padding = b" " * self.rnd.randint(1, 10_000)
        await self.send("POST", "/v1/solve", content=self.cached_body + padding,
                        headers=HEADERS, expect=(200,))

    async def fresh(self) -> None:
        await self.send("POST", "/v1/solve", json=self.fresh_body(time_limit_s=5),
                        expect=(200, 422))  # 422: a budget under the smallest feasible one

    async def frontier(self) -> None:
        w = self.rnd.choice(self.work)
        await self.send("POST", "/v1/frontier", json={"graph": w.graph, "count": 4},
                        expect=(200,))

    async def job(self) -> None:
        submitted = await self.send("POST", "/v1/jobs", json=self.fresh_body(), expect=(200, 202))
        if submitted.status_code not in (200, 202):
            return
        job_id = submitted.json()["id"]
        self.job_ids = [*self.job_ids[-20:], job_id]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            job = await self.send("GET", f"/v1/jobs/{job_id}", expect=(200,))
            if job.status_code != 200 or job.json()["status"] not in ("queued", "running"):
                return
            await asyncio.sleep(0.05)

    async def cancelled(self) -> None:
        slow = tangled(20, 8, seed=self.rnd.randrange(1000), name="soak-slow")
        submitted = await self.send("POST", "/v1/jobs", expect=(200, 202), json={
            "graph": slow.model_dump(mode="json"), "budget_bytes": 10**6,
            "options": {"tie": False, "time_limit_s": 5}})
        if submitted.status_code in (200, 202):
            await asyncio.sleep(self.rnd.uniform(0.05, 0.5))
            started = time.monotonic()
            cancelled = await self.send("DELETE", f"/v1/jobs/{submitted.json()['id']}",
                                        expect=(200,))
            if cancelled.status_code == 200:
                self.tally.cancel_ms.append((time.monotonic() - started) * 1000)

    async def bad(self) -> None:
        kind = self.rnd.randrange(4)
        if kind == 0:
            await self.send("POST", "/v1/solve", content=b'{"graph": [', headers=HEADERS,
                            expect=(400,))
        elif kind == 1:
            body = self.fresh_body()
            graph = body["graph"] = dict(body["graph"])  # not the shared one
            graph["output_ids"] = [*graph["output_ids"][:-1], 10**6]  # a value that is not
            await self.send("POST", "/v1/jobs", json=body, expect=(422,))
        elif kind == 2:
            await self.send("POST", "/v1/solve", content=b"graph=1",
                            headers={"Content-Type": "text/plain"}, expect=(415,))
        else:
            await self.send("GET", f"/v1/jobs/{self.rnd.getrandbits(256):064x}", expect=(404,))

    async def listing(self) -> None:
        page = await self.send("GET", "/v1/jobs", params={"limit": 20}, expect=(200,))
        cursor = page.json().get("next_cursor") if page.status_code == 200 else None
        if cursor:
            await self.send("GET", "/v1/jobs", params={"limit": 20, "cursor": cursor},
                            expect=(200,))

    async def read(self) -> None:
        if self.job_ids:  # a job read long after it finished may have been evicted: 404
            await self.send("GET", f"/v1/jobs/{self.rnd.choice(self.job_ids)}",
                            expect=(200, 404))

    async def run(self, stop_at: float, max_requests: int) -> None:
        actions: dict[str, Callable[[], Awaitable[None]]] = {
            name: getattr(self, name) for name, _ in MIX}
        names, weights = zip(*MIX, strict=True)
        while time.monotonic() < stop_at and self.tally.requests < max_requests:
            name = self.rnd.choices(names, weights)[0]
            self.tally.by_action[name] += 1
            try:
                await actions[name]()
            except httpx.HTTPError as exc:
                self.tally.statuses[type(exc).__name__] += 1
                self.tally.unexpected.append(f"{name}: {type(exc).__name__}: {exc}")


def probe(url: str, body: bytes, start_at: float, stop_at: float,
          out: Connection) -> None:
    """In a process of its own, so that the clients' work does not show in its times:
    the cached answer's latency, ``PROBE_EVERY_S`` apart, from ``start_at`` on."""
    headers = {**HEADERS, "Authorization": f"Bearer {KEYS[0]}"}
    samples = []
    with httpx.Client(base_url=url, timeout=60) as client:
        while (now := time.monotonic()) < stop_at:
            started = time.perf_counter()
            answer = client.post("/v1/solve", content=body, headers=headers)
            if now >= start_at and answer.status_code == 200:
                samples.append((time.perf_counter() - started) * 1000)
            time.sleep(PROBE_EVERY_S)
    out.send(samples)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def memory(pid: int) -> tuple[int, dict[int, int]]:
    """(the API's RSS, {worker pid: RSS}) in KiB."""
    return rss_kib(pid), {child: rss_kib(child) for child in children(pid)}


def growth(before: int, after: int) -> str:
    change = 100 * (after / before - 1)
    return f"{before / 1024:8.1f} MiB -> {after / 1024:8.1f} MiB  ({change:+.1f}%)"


async def soak(server: Server, args: argparse.Namespace, work: list[Workload]) -> None:
    assert server.process is not None
    pid = server.process.pid
    tally = Tally()
    cached_body = json.dumps(work[1].body((work[1].low + work[1].high) // 2)).encode()
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
        clients = [Client(http, i, tally, work, cached_body) for i in range(args.concurrency)]
        await clients[0].cached()  # solve it once: every later one is from the cache
        started = time.monotonic()
        stop_at, warm_at = started + args.duration, started + args.duration / 10
        prober_side, ours = multiprocessing.get_context("spawn").Pipe(duplex=False)
        prober = multiprocessing.get_context("spawn").Process(
            target=probe, args=(server.url, cached_body, warm_at, stop_at, ours))
        prober.start()
        runs = asyncio.gather(*(c.run(stop_at, args.max_requests) for c in clients))
        await asyncio.sleep(warm_at - time.monotonic())  # warm-up: imports, caches, pools
        api_before, workers_before = memory(pid)
        await runs
        elapsed = time.monotonic() - started
        cached_ms: list[float] = await asyncio.to_thread(prober_side.recv)
        prober.join()
    api_after, workers_after = memory(pid)
    with httpx.Client(base_url=server.url) as client:
        evicted = metric(client, "optiremat_store_evictions_total")
        rejected = metric(client, "optiremat_rejected_requests_total")
    store = sum(p.stat().st_size for p in server.data_dir.glob("optiremat.sqlite3*"))
    bound = int(args.store_max_bytes)
    kept = set(workers_before) & set(workers_after)

    print(f"optiremat soak: {elapsed:.0f} s, {tally.requests} requests "
          f"({tally.requests / elapsed:.1f}/s) from {args.concurrency} clients, server workers="
          f"{args.workers}, host {platform.machine()} with {os.cpu_count()} cores "
          f"(load average {os.getloadavg()[1]:.1f} over the last 5 minutes)")
    print("actions:  " + ", ".join(f"{k} {v}" for k, v in sorted(tally.by_action.items())))
    print("statuses: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.statuses.items())))
    print(f"5xx: {tally.server_errors}   unexpected answers: {len(tally.unexpected)}   "
          f"429 and queue-full: {rejected:.0f}")
    for line in tally.unexpected[:10]:
        print(f"  {line}")
    print("RSS after warm-up -> at the end (growth must stay under 10%):")
    print(f"  API      {growth(api_before, api_after)}")
    print(f"  workers  {growth(sum(workers_before.values()), sum(workers_after.values()))}  "
          f"({len(workers_after)} processes, {len(kept)} the same from warm-up to end)")
    if cached_ms:
        print(f"cached answer under that load: p50 {percentile(cached_ms, 0.5):.1f} ms, "
              f"p99 {percentile(cached_ms, 0.99):.1f} ms (n={len(cached_ms)}, one each "
              f"{PROBE_EVERY_S * 1000:.0f} ms after warm-up; p99 must be at most 20 ms)")
    if tally.cancel_ms:
        print(f"cancel of a slow job: p50 {percentile(tally.cancel_ms, 0.5):.1f} ms, slowest "
              f"{max(tally.cancel_ms):.1f} ms (n={len(tally.cancel_ms)}, queued or running)")
    print(f"store at the end: {store / 1024:.0f} KiB on disk, bound {bound / 1024:.0f} KiB "
          f"({100 * store / bound:.0f}%), {evicted:.0f} entries evicted")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument("--max-requests", type=int, default=1_000_000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2, help="the server's worker processes")
    parser.add_argument("--store-max-bytes", default=str(2 << 20),
                        help="the store's bound: small, so that eviction runs (default 2 MiB)")
    args = parser.parse_args()
    work = workloads()
    with tempfile.TemporaryDirectory() as data_dir:
        server = Server(Path(data_dir), {
            "workers": str(args.workers), "log_level": "WARNING",
            "api_keys": ",".join(KEYS), "rate_limit_per_minute": "6000",
            "store_max_bytes": args.store_max_bytes,
            # finished jobs may go after a minute, so that they take part in eviction
            "store_job_grace_s": "60",
        }).start()
        try:
            asyncio.run(soak(server, args, work))
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
