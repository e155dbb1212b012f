"""Service latency and throughput, side by side, from one run.

    .venv/bin/python bench/service.py                # starts its own server
    .venv/bin/python bench/service.py --url URL      # or measures a running one

Prints p50/p99 latency of a cached answer and of a fresh solve of a ~2,500-node
graph, then the requests per second a server holds for ``--duration`` seconds of
concurrent cached requests, with the error count. Each request carries the whole
graph, as a client's would. A cached answer comes two ways: a body the server has
seen byte for byte skips parsing; a body new to the server (here: the same request
with different trailing whitespace) is parsed, validated and hashed first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from optiremat.solver.graph import CostGraph  # noqa: E402
from optiremat.solver.solve import max_useful_budget, min_feasible_budget  # noqa: E402
from optiremat.solver.synthetic import transformer_like  # noqa: E402

HEADERS = {"Content-Type": "application/json"}


def graph_of_about(nodes: int) -> CostGraph:
    layers = 1
    while (graph := transformer_like(layers)).num_nodes < nodes:
        layers += 1
    return graph


def request_body(graph: CostGraph, budget_bytes: int) -> bytes:
    return json.dumps({"graph": graph.model_dump(mode="json"),
                       "budget_bytes": budget_bytes}).encode()


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@contextmanager
def local_server(workers: int) -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as data_dir:
        env = {**os.environ, "OPTIREMAT_DATA_DIR": data_dir, "OPTIREMAT_WORKERS": str(workers),
               "OPTIREMAT_LOG_LEVEL": "WARNING"}
        process = subprocess.Popen(
            [sys.executable, "-m", "optiremat", "serve", "--port", str(port)],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("the server did not become ready")
                time.sleep(0.1)
            yield url
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)


def timed_posts(client: httpx.Client, bodies: list[bytes]) -> list[float]:
    seconds = []
    for content in bodies:
        started = time.perf_counter()
        response = client.post("/v1/solve", content=content, headers=HEADERS)
        seconds.append(time.perf_counter() - started)
        response.raise_for_status()
    return seconds


async def sustained(url: str, content: bytes, duration_s: float,
                    concurrency: int) -> tuple[int, int, list[float]]:
    """(successes, errors, latencies) of back-to-back requests from ``concurrency`` clients."""
    ok = errors = 0
    latencies: list[float] = []
    stop_at = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def loop() -> None:
            nonlocal ok, errors
            while time.monotonic() < stop_at:
                started = time.perf_counter()
                try:
                    response = await client.post("/v1/solve", content=content, headers=HEADERS)
                    good = response.status_code == 200
                except httpx.HTTPError:
                    good = False
                latencies.append(time.perf_counter() - started)
                ok, errors = (ok + 1, errors) if good else (ok, errors + 1)

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return ok, errors, latencies


def run(url: str, args: argparse.Namespace, graph: CostGraph) -> None:
    with httpx.Client(base_url=url, timeout=600) as client:
        low, high = min_feasible_budget(graph), max_useful_budget(graph)
        # Distinct feasible budgets make distinct requests: each fresh one is a cache miss.
        fresh_bodies = [request_body(graph, low + (high - low) * (i + 1) // (args.fresh + 2))
                        for i in range(args.fresh)]
        cached_body = request_body(graph, low + (high - low) // 3 + 1)
        timed_posts(client, [cached_body])  # solve it once; every later call is a hit
        fresh = timed_posts(client, fresh_bodies)
        cached = timed_posts(client, [cached_body] * args.cached)
        revalidated = timed_posts(client, [cached_body + b" " * (i + 1)
                                           for i in range(max(1, args.cached // 5))])
        ready = client.get("/readyz").json()

    ok, errors, latencies = asyncio.run(
        sustained(url, cached_body, args.duration, args.concurrency))

    ms = 1000.0
    print(f"optiremat service bench: {graph.num_nodes}-node graph "
          f"({len(cached_body) / 1e6:.2f} MB request), server workers={ready['workers']}, "
          f"host {platform.machine()} with {os.cpu_count()} cores (client on the same host)")
    print(f"{'':32}{'p50 ms':>10}{'p99 ms':>10}{'n':>8}")
    print(f"{'cached answer':32}{percentile(cached, .5) * ms:>10.1f}"
          f"{percentile(cached, .99) * ms:>10.1f}{len(cached):>8}")
    print(f"{'cached answer, body new':32}{percentile(revalidated, .5) * ms:>10.1f}"
          f"{percentile(revalidated, .99) * ms:>10.1f}{len(revalidated):>8}")
    print(f"{f'fresh {graph.num_nodes}-node solve':32}{percentile(fresh, .5) * ms:>10.1f}"
          f"{percentile(fresh, .99) * ms:>10.1f}{len(fresh):>8}")
    print(f"{f'sustained, {args.concurrency} clients':32}{percentile(latencies, .5) * ms:>10.1f}"
          f"{percentile(latencies, .99) * ms:>10.1f}{len(latencies):>8}")
    print(f"held {ok / args.duration:.1f} requests/s of cached answers for {args.duration:.0f} s "
          f"with {errors} errors (mean {statistics.fmean(latencies) * ms:.1f} ms)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="bench this server instead of starting one")
    parser.add_argument("--nodes", type=int, default=2500, help="graph size (default 2500)")
    parser.add_argument("--cached", type=int, default=200, help="cached requests to time")
    parser.add_argument("--fresh", type=int, default=10, help="fresh solves to time")
    parser.add_argument("--duration", type=float, default=30.0, help="sustained-load seconds")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2, help="workers of the local server")
    args = parser.parse_args()
    graph = graph_of_about(args.nodes)
    if args.url:
        run(args.url, args, graph)
    else:
        with local_server(args.workers) as url:
            run(url, args, graph)
    return 0


if __name__ == "__main__":
    sys.exit(main())
