"""What a graph over the caps costs the server, how /healthz answers meanwhile, and
what memory the API process keeps after graphs just under the caps.

    .venv/bin/python bench/service_caps.py               # every phase
    .venv/bin/python bench/service_caps.py --phases over --nodes 600000 --concurrent 1
    .venv/bin/python bench/service_caps.py --phases rss  # the memory phase alone

Starts its own server (default caps: 200k nodes, 64 MiB bodies) on loopback, then
sends ``--concurrent`` bodies of a ``--nodes``-node chain at once (about 40 MiB each
at 600k nodes) and reports the server's CPU seconds from the first byte sent to the
last 413 (``server_cpu_s``; ``bodies_cpu_s`` is that less what the probes alone cost
it, measured for a second before), the refusals' wall time, and the /healthz latency
(max and p99) of probes sent every 10 ms meanwhile. Targets: < 0.5 s of server CPU
for four bodies at once, plain or escaped (issue 31), /healthz under 50 ms. Then
the same for a graph under the caps that the server must validate in full
(``--checked`` nodes, refused 422 for a cycle in its last node): the latency figure
``tests/test_service_api.py`` no longer times.

The over-cap bodies go twice: keys as written, then every key spelt with JSON escapes
(``"node\\u005fid"`` is ``node_id``), which the early scan must read the same way
(issue 31: such a body cost 4.0 s of CPU, 22-27 s for four at once). Each of these
phases also reports the API process's RSS before and after.

The memory phase (``rss``, issue 31 item 5) starts a server of its own, warms it up
(a few small solves at once, so its threads exist), notes the API process's RSS idle,
then posts ``--concurrent`` distinct ``--rss-nodes``-node graphs (199,999: just under
the default cap of 200,000) to /v1/solve at once, ``--rounds`` times, and prints the
RSS after each round and once settled (``--settle-s`` later), each with its ratio to
idle. Target: settled within 20% of idle.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.service_harness import Server  # noqa: E402


def chain_json(nodes: int, *, cycle: bool = False) -> bytes:
    """x -> tanh -> ... as wire columns, written directly (validating 600k nodes on
    the client side would take longer than the measurement)."""
    graph: dict[str, Any] = {
        "schema_version": 2, "name": f"chain-{nodes}",
        "value_id": list(range(nodes + 1)), "value_bytes": [4096] * (nodes + 1),
        "value_shape": [[]] * (nodes + 1), "value_dtype": ["f32"] * (nodes + 1),
        "node_id": list(range(nodes)), "node_primitive": ["tanh"] * nodes,
        "node_key": ["t"] * nodes, "node_flops": [1024] * nodes,
        "node_mode": ["free"] * nodes, "node_repeat": [1] * nodes,
        "node_source": [""] * nodes,
        "input_ptr": list(range(nodes + 1)), "input_ids": list(range(nodes)),
        "output_ptr": list(range(nodes + 1)), "output_ids": list(range(1, nodes + 1)),
        "inputs": [0], "backward_reads": list(range(1, nodes + 1)),
    }
    if cycle:  # the last node reads its own output: only the last check fails
        graph["input_ids"][-1] = graph["output_ids"][-1]
    return json.dumps({"graph": graph, "budget_bytes": 1 << 60},
                      separators=(",", ":")).encode()


def escaped_keys(payload: bytes) -> bytes:
    """The same body with every character of every key a \\u escape."""
    return re.sub(rb'"([a-z_]+)":', lambda m: b'"' + "".join(
        f"\\u{ord(c):04x}" for c in m.group(1).decode()).encode() + b'":', payload)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def children_rss_mib(pid: int) -> float:
    """The RSS of ``pid``'s child processes (solver workers, parse processes)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return sum(rss_mib(int(child)) for child in children)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def probe(url: str, stop: Any, results: Any) -> None:
    """GET /healthz every 10 ms until ``stop``; the latencies go to ``results``."""
    latencies = []
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            started = time.perf_counter()
            client.get("/healthz").raise_for_status()
            latencies.append(time.perf_counter() - started)
            time.sleep(0.01)
    results.put(latencies)


def measure(server: Server, payload: bytes, at_once: int) -> dict[str, Any]:
    assert server.process is not None
    # The prober is its own process: the uploads' threads must not delay its timings.
    stop = multiprocessing.Event()
    results: multiprocessing.Queue[list[float]] = multiprocessing.Queue()

    def post() -> httpx.Response:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            return client.post("/v1/solve", content=payload,
                               headers={"Content-Type": "application/json"})

    prober = multiprocessing.Process(target=probe, args=(server.url, stop, results))
    prober.start()
    time.sleep(0.2)
    # What the probes alone cost the server a second, to tell the bodies' cost apart.
    cpu_before, started = cpu_seconds(server.process.pid), time.perf_counter()
    time.sleep(1.0)
    probes_cpu_per_s = ((cpu_seconds(server.process.pid) - cpu_before)
                        / (time.perf_counter() - started))
    rss_before = rss_mib(server.process.pid)
    cpu_before, started = cpu_seconds(server.process.pid), time.perf_counter()
    with ThreadPoolExecutor(at_once) as pool:
        answers = list(pool.map(lambda _: post(), range(at_once)))
    wall = time.perf_counter() - started
    cpu = cpu_seconds(server.process.pid) - cpu_before
    bodies_cpu = max(0.0, cpu - probes_cpu_per_s * wall)
    stop.set()
    ordered = sorted(results.get(timeout=60))
    prober.join()
    return {"statuses": sorted({a.status_code for a in answers}),
            "server_cpu_s": round(cpu, 3), "bodies_cpu_s": round(bodies_cpu, 3),
            "bodies_cpu_s_per_body": round(bodies_cpu / at_once, 3), "wall_s": round(wall, 3),
            "healthz_max_ms": round(1000 * ordered[-1], 1),
            "healthz_p99_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 1),
            "healthz_median_ms": round(1000 * statistics.median(ordered), 1),
            "probes": len(ordered), "rss_mib_before": round(rss_before),
            "rss_mib_after": round(rss_mib(server.process.pid))}


def post_at_once(url: str, payloads: list[bytes]) -> list[int]:
    def post(payload: bytes) -> int:
        with httpx.Client(base_url=url, timeout=600) as client:
            return client.post("/v1/solve", content=payload,
                               headers={"Content-Type": "application/json"}).status_code

    with ThreadPoolExecutor(len(payloads)) as pool:
        return list(pool.map(post, payloads))


def renamed(payload: bytes, name: str) -> bytes:
    """The same graph under another name: a distinct body and graph hash, so neither
    the cache nor single-flight answers it."""
    return payload.replace(b'"name":"chain-', f'"name":"{name}-chain-'.encode(), 1)


def memory_after_load(nodes: int, at_once: int, rounds: int, settle_s: float) -> None:
    """RSS of the API process idle, after each round of ``at_once`` graphs, and settled."""
    with tempfile.TemporaryDirectory() as data:
        server = Server(Path(data), {"workers": "1"}).start()
        try:
            assert server.process is not None
            pid = server.process.pid
            small = chain_json(50)
            statuses = post_at_once(server.url, [renamed(small, f"warm{i}")
                                                 for i in range(at_once)])
            assert set(statuses) == {200}, statuses
            time.sleep(1.0)
            idle = rss_mib(pid)
            payload = chain_json(nodes)
            print(f"under the caps: {nodes} nodes, {len(payload) / 2**20:.1f} MiB, "
                  f"{at_once} at once, {rounds} rounds; API process RSS:")
            print(f"  idle            {idle:7.1f} MiB  (its child processes: "
                  f"{children_rss_mib(pid):.1f} MiB)")
            for done in range(rounds):
                started = time.perf_counter()
                statuses = post_at_once(server.url, [
                    renamed(payload, f"r{done}.{i}") for i in range(at_once)])
                after = rss_mib(pid)
                print(f"  after round {done + 1}   {after:7.1f} MiB  x{after / idle:.2f}"
                      f"  (statuses {sorted(set(statuses))}, "
                      f"{time.perf_counter() - started:.1f} s)")
            time.sleep(settle_s)
            settled = rss_mib(pid)
            print(f"  settled ({settle_s:g} s) {settled:7.1f} MiB  x{settled / idle:.2f}"
                  f"  (target: within 20% of idle; its child processes, solver workers "
                  f"and parse processes: {children_rss_mib(pid):.1f} MiB)")
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=600_000)
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--checked", type=int, default=40_000)
    parser.add_argument("--rss-nodes", type=int, default=199_999)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--phases", nargs="+", choices=("over", "checked", "rss"),
                        default=["over", "checked", "rss"])
    args = parser.parse_args()
    if {"over", "checked"} & set(args.phases):
        with tempfile.TemporaryDirectory() as data:
            server = Server(Path(data), {"workers": "1"}).start()
            try:
                plain = chain_json(args.nodes)
                for keys, over in (("plain", plain), ("escaped", escaped_keys(plain))):
                    if "over" in args.phases:
                        print(f"over the caps, {keys} keys: {args.nodes} nodes, "
                              f"{len(over) / 2**20:.1f} MiB, {args.concurrent} at once:",
                              measure(server, over, args.concurrent))
                if "checked" in args.phases:
                    checked = chain_json(args.checked, cycle=True)
                    print(f"checked in full: {args.checked} nodes, "
                          f"{len(checked) / 2**20:.1f} MiB:", measure(server, checked, 1))
            finally:
                server.stop()
    if "rss" in args.phases:
        memory_after_load(args.rss_nodes, args.concurrent, args.rounds, args.settle_s)


if __name__ == "__main__":
    main()
