"""The service attacked as a hostile client would, on loopback: what got through.

    .venv/bin/python bench/attack.py            # every section, about a minute
    .venv/bin/python bench/attack.py --quick    # fewer requests per section

Starts ``optiremat serve`` with API keys, the wrong-key throttle and the default
caps, under an open-file limit of 1,024 (the common default), and runs:

- ``fuzz``: every route and method with malformed, mistyped, oversized, escaped,
  truncated, compressed and nested bodies, odd paths, ids and query strings;
- ``owners``: a second key asking after, joining and cancelling the first key's job;
- ``over caps``: graphs over the node caps, keys plain, escaped and gzipped;
- ``idle sockets``: 1,100 connections that send nothing, and /healthz meanwhile;
- ``keys``: a flood of requests with missing and wrong API keys.

Prints, per section, the answers by status, and the holes: any 5xx, any 4xx that
is not problem+json, any answer that differs from the one expected; then the
tracebacks in the server's log and whether it still answers. Targets (issue 31):
0 5xx, 0 holes, 0 tracebacks, /healthz answering throughout.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import resource
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.service_harness import Server, body, chain  # noqa: E402

KEYS = ("alpha-key", "beta-key")
PROBLEM = "application/problem+json"


@dataclass
class Tally:
    """A section's answers, and what should not have happened."""

    statuses: Counter[int] = field(default_factory=Counter)
    holes: list[str] = field(default_factory=list)

    def see(self, what: str, answer: httpx.Response, expect: set[int] | None = None) -> None:
        self.statuses[answer.status_code] += 1
        status = answer.status_code
        if status >= 500 and status != 503:
            self.holes.append(f"{what}: {status} {answer.text[:120]!r}")
        elif status >= 400 and answer.headers.get("content-type", "").split(";")[0] != PROBLEM:
            self.holes.append(f"{what}: {status} is not problem+json")
        elif expect is not None and status not in expect:
            self.holes.append(f"{what}: {status}, expected one of {sorted(expect)}")


def valid_solve() -> dict[str, Any]:
    return body(chain(6, name="attack"), 10**9)


def escaped(key: str) -> str:
    return "".join(f"\\u{ord(c):04x}" for c in key)


def bodies() -> Iterator[tuple[str, bytes, dict[str, str]]]:
    """(what, raw body, extra headers): the fuzz set's bodies."""
    js = {"Content-Type": "application/json"}
    base = valid_solve()
    yield "empty", b"", js
    yield "not json", b"{nope", js
    yield "truncated", json.dumps(base).encode()[:-7], js
    yield "invalid utf-8", b'{"graph": "\xff\xfe"}', js
    yield "NaN budget", json.dumps(base).replace("1000000000", "NaN").encode(), js
    yield "huge budget", json.dumps({**base, "budget_bytes": 2**70}).encode(), js
    yield "negative budget", json.dumps({**base, "budget_bytes": -1}).encode(), js
    yield "string budget", json.dumps({**base, "budget_bytes": "8GiB"}).encode(), js
    yield "unknown field", json.dumps({**base, "surprise": 1}).encode(), js
    yield "no graph", json.dumps({"budget_bytes": 1}).encode(), js
    yield "null graph", json.dumps({**base, "graph": None}).encode(), js
    yield "graph is a list", json.dumps({**base, "graph": [1, 2]}).encode(), js
    yield "deep nesting", b'{"graph": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", js
    yield "duplicate keys", b'{"budget_bytes": 1, "budget_bytes": 2, "graph": {}}', js
    yield "escaped keys", json.dumps(base).replace(
        '"budget_bytes"', f'"{escaped("budget_bytes")}"').encode(), js
    yield "array body", b"[]", js
    yield "wrong content type", json.dumps(base).encode(), {"Content-Type": "text/plain"}
    yield "no content type", json.dumps(base).encode(), {}
    yield "gzip", gzip.compress(json.dumps(base).encode()), {**js, "Content-Encoding": "gzip"}
    yield "bad gzip", b"not gzip", {**js, "Content-Encoding": "gzip"}
    yield "gzip bomb", gzip.compress(b" " * 80_000_000, 9), {**js, "Content-Encoding": "gzip"}
    yield "brotli", b"{}", {**js, "Content-Encoding": "br"}
    yield "options bad", json.dumps({**base, "options": {"time_limit_s": -5}}).encode(), js
    yield "options unknown", json.dumps({**base, "options": {"threads": 9}}).encode(), js
    yield "frontier both", json.dumps({"graph": base["graph"], "count": 3,
                                       "budgets": [1, 2]}).encode(), js
    yield "frontier 10^6 budgets", json.dumps({"graph": base["graph"],
                                               "budgets": list(range(10**6))}).encode(), js
    cyclic = valid_solve()
    cyclic["graph"]["input_ids"][-1] = cyclic["graph"]["output_ids"][-1]
    yield "cycle", json.dumps(cyclic).encode(), js
    ragged = valid_solve()
    ragged["graph"]["node_flops"] = ragged["graph"]["node_flops"][:-1]
    yield "ragged columns", json.dumps(ragged).encode(), js


PATHS = ["/v1/solve", "/v1/frontier", "/v1/jobs", "/v1/jobs/x", "/v1/jobs/" + "a" * 5000,
         "/v1/jobs/..%2F..%2Fetc%2Fpasswd", "/v1/jobs/%00", "/v1/jobs?limit=-1",
         "/v1/jobs?limit=1000000000", "/v1/jobs?cursor=%%%", "/v1/jobs?status=bogus",
         "/healthz", "/readyz", "/metrics", "/docs", "/openapi.json", "/nowhere"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


def fuzz(server: Server, rounds: int) -> Tally:
    tally = Tally()
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(rounds):
            for route in ("/v1/solve", "/v1/frontier", "/v1/jobs"):
                for what, raw, headers in bodies():
                    answer = client.post(route, content=raw, headers={**headers, **auth})
                    # a valid body may be answered (200, 202) or queued; the rest are 4xx
                    tally.see(f"POST {route} {what}", answer)
            for path in PATHS:
                for method in METHODS:
                    answer = client.request(method, path, headers=auth)
                    tally.see(f"{method} {path}", answer)
    return tally


def wrong_keys(server: Server, count: int) -> Tally:
    tally = Tally()
    rng = random.Random(31)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for i in range(count):
            headers = ({} if i % 3 == 0 else
                       {"Authorization": f"Bearer {rng.randbytes(8).hex()}"})
            answer = client.post("/v1/solve", json=valid_solve(), headers=headers)
            tally.see("wrong key", answer, {401, 429})
    return tally


def owners(server: Server) -> Tally:
    """Key beta must neither see nor change key alpha's job; its identical request is
    a submission of its own, and withdrawing it leaves alpha's."""
    tally = Tally()
    alpha, beta = ({"Authorization": f"Bearer {k}"} for k in KEYS)
    slow = body(chain(300, name="owned"), 10**5, time_limit_s=20)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        job = client.post("/v1/jobs", json=slow, headers=alpha)
        tally.see("alpha submits", job, {200, 202})
        if job.status_code not in (200, 202):
            return tally
        job_id = job.json()["id"]
        tally.see("beta reads alpha's job", client.get(f"/v1/jobs/{job_id}", headers=beta),
                  {404})
        tally.see("beta cancels alpha's job",
                  client.delete(f"/v1/jobs/{job_id}", headers=beta), {404})
        listed = client.get("/v1/jobs", headers=beta)
        tally.see("beta lists", listed, {200})
        if any(j["id"] == job_id for j in listed.json()["jobs"]):
            tally.holes.append("beta's listing shows alpha's job")
        tally.see("beta submits the same", client.post("/v1/jobs", json=slow, headers=beta),
                  {200, 202})
        tally.see("beta withdraws its own",
                  client.delete(f"/v1/jobs/{job_id}", headers=beta), {200})
        seen = client.get(f"/v1/jobs/{job_id}", headers=alpha)
        tally.see("alpha reads its job", seen, {200})
        if seen.json().get("status") == "cancelled":
            tally.holes.append("beta's withdrawal cancelled alpha's job")
        client.delete(f"/v1/jobs/{job_id}", headers=alpha)
    return tally


def over_caps(server: Server) -> Tally:
    tally = Tally()
    auth = {"Authorization": f"Bearer {KEYS[0]}", "Content-Type": "application/json"}
    ids = json.dumps(list(range(200_001)))
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for what, key in (("plain", "node_id"), ("escaped", escaped("node_id"))):
            raw = f'{{"budget_bytes": 1, "graph": {{"{key}": {ids}}}}}'.encode()
            for encoding in ("identity", "gzip"):
                headers = dict(auth)
                if encoding == "gzip":
                    raw, headers["Content-Encoding"] = gzip.compress(raw), "gzip"
                answer = client.post("/v1/solve", content=raw, headers=headers)
                tally.see(f"over caps {what} {encoding}", answer, {413})
                # without a key: refused for its size before authentication
                answer = client.post("/v1/solve", content=raw,
                                     headers={k: v for k, v in headers.items()
                                              if k != "Authorization"})
                tally.see(f"over caps {what} {encoding}, no key", answer, {413})
    return tally


def idle_sockets(server: Server, count: int) -> Tally:
    tally = Tally()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, count + 256)), hard))
    sockets = []
    try:
        for _ in range(count):
            try:
                sockets.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
            except OSError as exc:
                tally.holes.append(f"connection {len(sockets) + 1} refused: {exc}")
                break
        time.sleep(1.0)
        with httpx.Client(base_url=server.url, timeout=10) as client:
            for _ in range(20):
                tally.see("/healthz beside idle sockets", client.get("/healthz"), {200})
                time.sleep(0.05)
    finally:
        for sock in sockets:
            sock.close()
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests per section")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data:
        server = Server(Path(data), {"workers": "1", "api_keys": ",".join(KEYS),
                                     "auth_failures_per_minute": "30"})
        server.wrap = ["prlimit", "--nofile=1024:1024"]  # the common default
        server.start()
        try:
            sections = {
                "fuzz": lambda: fuzz(server, 1 if args.quick else 3),
                "owners": lambda: owners(server),
                "over caps": lambda: over_caps(server),
                "idle sockets": lambda: idle_sockets(server, 1100),
                # last: the throttle then refuses this address, valid keys too, a while
                "keys": lambda: wrong_keys(server, 300 if args.quick else 3000),
            }
            holes = 0
            for name, run in sections.items():
                started = time.perf_counter()
                tally = run()
                holes += len(tally.holes)
                print(f"{name:13s} {sum(tally.statuses.values()):5d} answers in "
                      f"{time.perf_counter() - started:5.1f} s: "
                      f"{dict(sorted(tally.statuses.items()))}; holes: {len(tally.holes)}")
                for hole in tally.holes[:10]:
                    print(f"    {hole}")
            with httpx.Client(base_url=server.url, timeout=10) as client:
                alive = client.get("/healthz").status_code == 200
            tracebacks = server.log().count("Traceback")
            print(f"holes {holes}, tracebacks in the server's log {tracebacks}, "
                  f"answering at the end: {alive} (targets: 0, 0, True)")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
