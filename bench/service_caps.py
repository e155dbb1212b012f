"""What a graph over the caps costs the server, and how /healthz answers meanwhile.

    .venv/bin/python bench/service_caps.py               # 600k nodes, 4 at once
    .venv/bin/python bench/service_caps.py --nodes 600000 --concurrent 1

Starts its own server (default caps: 200k nodes, 64 MiB bodies) on loopback, then
sends ``--concurrent`` bodies of a ``--nodes``-node chain at once (about 40 MiB each
at 600k nodes) and reports the server's CPU seconds from the first byte sent to the
last 413, the refusals' wall time, and the /healthz latency (max and p99) of probes
sent every 10 ms meanwhile. Targets (issue 22): < 0.5 s of server CPU per body,
/healthz under 50 ms. Then the same for a graph under the caps that the server must
validate in full (``--checked`` nodes, refused 422 for a cycle in its last node):
the latency figure ``tests/test_service_api.py`` no longer times.

The over-cap bodies go twice: keys as written, then every key spelt with JSON escapes
(``"node\\u005fid"`` is ``node_id``), which the early scan must read the same way
(issue 31: such a body cost 4.0 s of CPU, 22-27 s for four at once).
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
    cpu_before, started = cpu_seconds(server.process.pid), time.perf_counter()
    with ThreadPoolExecutor(at_once) as pool:
        answers = list(pool.map(lambda _: post(), range(at_once)))
    wall = time.perf_counter() - started
    cpu = cpu_seconds(server.process.pid) - cpu_before
    stop.set()
    ordered = sorted(results.get(timeout=60))
    prober.join()
    return {"statuses": sorted({a.status_code for a in answers}),
            "server_cpu_s": round(cpu, 3),
            "server_cpu_s_per_body": round(cpu / at_once, 3), "wall_s": round(wall, 3),
            "healthz_max_ms": round(1000 * ordered[-1], 1),
            "healthz_p99_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 1),
            "healthz_median_ms": round(1000 * statistics.median(ordered), 1),
            "probes": len(ordered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=600_000)
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--checked", type=int, default=40_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data:
        server = Server(Path(data), {"workers": "1"}).start()
        try:
            plain = chain_json(args.nodes)
            for keys, over in (("plain", plain), ("escaped", escaped_keys(plain))):
                print(f"over the caps, {keys} keys: {args.nodes} nodes, "
                      f"{len(over) / 2**20:.1f} MiB, {args.concurrent} at once:",
                      measure(server, over, args.concurrent))
            checked = chain_json(args.checked, cycle=True)
            print(f"checked in full: {args.checked} nodes, {len(checked) / 2**20:.1f} MiB:",
                  measure(server, checked, 1))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
