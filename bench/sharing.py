"""How the embedded service shares its workers between clients (issue 31, item 3).

    .venv/bin/python bench/sharing.py               # the issue's figures
    .venv/bin/python bench/sharing.py --rounds 3

Starts its own server (one worker, API keys ``alpha`` and ``beta``) on loopback:

1. ``alpha`` submits six jobs that each search for 600 s; once one runs, ``beta``
   sends ``--rounds`` trivial ``POST /v1/solve`` (a 5-node chain) one after another.
   Printed: their latency, with the default sync worker and, side by side, with
   ``OPTIREMAT_SYNC_WORKERS=0`` (sync solves then only go first in the queue; the
   first such one waits for a running job, and gives up after ``--patience`` s).
   Target: under 5 s with the default.
2. A client sends a solve, then a two-point frontier, each searching for 30 s, and
   hangs up after 2 s. Printed: how long the workers stay busy after the hang-up
   (before issue 31 a frontier kept its worker at least 70 s more). Target: seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from optiremat.solver.solve import max_useful_budget, min_feasible_budget  # noqa: E402
from optiremat.solver.synthetic import transformer_like  # noqa: E402
from tests.service_harness import Server, body, chain, metric  # noqa: E402

KEYS = {"alpha": "bench-sharing-alpha", "beta": "bench-sharing-beta"}


def as_(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


def long_request(offset: int, time_limit_s: float) -> dict[str, Any]:
    """A request CP-SAT searches to its time limit; ``offset`` makes it distinct."""
    graph = transformer_like(24)
    low, high = min_feasible_budget(graph, tie=False), max_useful_budget(graph)
    return body(graph, low + (high - low) // 4 + offset, tie=False, time_limit_s=time_limit_s)


def wait_until(client: httpx.Client, busy: int, timeout_s: float) -> float:
    """Seconds until ``optiremat_busy_workers`` reads ``busy`` (or ``timeout_s``)."""
    started = time.monotonic()
    while metric(client, "optiremat_busy_workers") != busy:
        if time.monotonic() - started > timeout_s:
            break
        time.sleep(0.05)
    return time.monotonic() - started


def behind_jobs(root: Path, sync_workers: int, rounds: int, patience_s: float) -> list[float]:
    server = Server(root / f"sync{sync_workers}", {
        "workers": "1", "sync_workers": str(sync_workers),
        "api_keys": ",".join(KEYS.values())}).start()
    latencies = []
    try:
        with server.client() as client:
            for i in range(6):
                client.post("/v1/jobs", json=long_request(1000 + i, 600), headers=as_("alpha"))
            wait_until(client, 1, 60)
            for i in range(rounds):
                started = time.monotonic()
                try:
                    client.post("/v1/solve", json=body(chain(5, name=f"small{i}"), 10**9),
                                headers=as_("beta"), timeout=patience_s)
                    latencies.append(time.monotonic() - started)
                except httpx.ReadTimeout:
                    latencies.append(float("inf"))
                    break
    finally:
        server.stop()
    return latencies


def after_hang_up(root: Path) -> dict[str, float]:
    server = Server(root / "hang-up", {"workers": "1"}).start()
    busy_after = {}
    try:
        with server.client() as client:
            for route, offset in (("/v1/solve", 0), ("/v1/frontier", 10)):
                request = long_request(offset, 30)
                if route == "/v1/frontier":
                    budget = request.pop("budget_bytes")
                    request["budgets"] = [budget, budget + 1]
                with contextlib.suppress(httpx.ReadTimeout):  # the client hangs up
                    client.post(route, json=request, timeout=2)
                busy_after[route] = wait_until(client, 0, 90)
    finally:
        server.stop()
    return busy_after


def show(latencies: list[float]) -> str:
    if not latencies:
        return "none answered"
    finite = [s for s in latencies if s != float("inf")]
    gave_up = len(latencies) - len(finite)
    text = (f"median {statistics.median(finite):.2f} s, max {max(finite):.2f} s"
            if finite else "")
    return text + (f"{', ' if text else ''}{gave_up} not answered in time" if gave_up else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--patience", type=float, default=60.0,
                        help="seconds a trivial solve waits before giving up")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        lane = behind_jobs(root, 1, args.rounds, args.patience)
        no_lane = behind_jobs(root, 0, args.rounds, args.patience)
        print("a trivial sync solve of key beta behind six 600 s jobs of key alpha, 1 worker:")
        print(f"  with the sync worker (default):   {show(lane)}   (target < 5 s)")
        print(f"  OPTIREMAT_SYNC_WORKERS=0:          {show(no_lane)}"
              f"   (patience {args.patience:.0f} s)")
        busy = after_hang_up(root)
        print("workers still busy after a client hung up on a 30 s search:")
        for route, seconds in busy.items():
            print(f"  {route:<13} {seconds:.1f} s")


if __name__ == "__main__":
    main()
