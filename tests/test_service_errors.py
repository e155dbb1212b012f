"""Every bad input gets the right 4xx as problem+json, and the server keeps serving."""

from __future__ import annotations

import gzip
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from optiremat.solver.solve import min_feasible_budget
from tests.service_harness import Server, body, chain, running_server

MAX_BODY = 200_000
BODY_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from running_server(tmp_path_factory, workers="1", max_body_bytes=str(MAX_BODY),
                              max_graph_nodes="300", max_graph_values="600",
                              max_graph_edges=str(EDGE_CAP),
                              body_timeout_s=str(BODY_TIMEOUT_S))


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "api-keys"
    path.write_text("# one key a line\nfile-key-1\n")
    return path


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory, key_file: Path) -> Iterator[Server]:
    yield from running_server(tmp_path_factory, workers="1", api_keys="alpha-key, beta-key",
                              api_keys_file=str(key_file), metrics_require_key="true")


def graph_json(**changes: Any) -> dict[str, Any]:
    data = chain(4, name="bad").model_dump(mode="json")
    data.update(changes)
    return data


def post_json(data: Any) -> Callable[[httpx.Client], httpx.Response]:
    return lambda c: c.post("/v1/solve", json=data)


def post_raw(content: bytes, **headers: str) -> Callable[[httpx.Client], httpx.Response]:
    return lambda c: c.post("/v1/solve", content=content,
                            headers={"Content-Type": "application/json", **headers})


def gzip_bomb() -> bytes:
    # 16 MB of spaces (valid JSON whitespace) in 16 kB of gzip: 80x the body limit
    return gzip.compress(b" " * 16_000_000, compresslevel=9)


# (what, request, status, words the detail must contain)
BAD_INPUTS = [
    ("malformed JSON", post_raw(b'{"graph": {"value_id": [0,'), 400, ["not valid JSON"]),
    ("wrong schema_version", post_json({"graph": graph_json(schema_version=7),
                                        "budget_bytes": 1}), 422, ["schema_version 7"]),
    ("cyclic graph", post_json({"graph": graph_json(input_ids=[0, 2, 2, 3]),
                                "budget_bytes": 10**6}), 422, ["cycle"]),
    ("dangling id", post_json({"graph": graph_json(output_ids=[1, 2, 3, 9]),
                               "budget_bytes": 10**6}), 422, ["value 9", "does not exist"]),
    ("negative bytes", post_json({"graph": graph_json(value_bytes=[1024, -5, 1, 1, 1]),
                                  "budget_bytes": 10**6}), 422, ["value 1", "bytes"]),
    ("negative budget", post_json({"graph": graph_json(), "budget_bytes": -1}), 422,
     ["budget_bytes"]),
    # past what the solver's 64-bit integers hold: each integer, and the sums it builds
    ("budget past int64", post_json({"graph": graph_json(), "budget_bytes": 10**29}), 422,
     ["budget_bytes", "less than 4611686018427387904"]),
    ("budget of 400 digits", post_json({"graph": graph_json(), "budget_bytes": 10**400}), 422,
     ["budget_bytes"]),
    ("bytes past int64", post_json({"graph": graph_json(value_bytes=[10**300, 1, 1, 1, 1]),
                                    "budget_bytes": 10**6}), 422,
     ["value 0", "bytes", "301 digits", "2**62"]),
    ("flops past int64", post_json({"graph": graph_json(node_flops=[2**70, 1, 1, 1]),
                                    "budget_bytes": 10**6}), 422, ["node 0", "flops", "2**62"]),
    ("bytes that add up past int64",
     post_json({"graph": graph_json(value_bytes=[2**61] * 5), "budget_bytes": 10**6}), 422,
     ["bytes", "add up", "2**62"]),
    ("flops that add up past int64",
     post_json({"graph": graph_json(node_flops=[2**61] * 4), "budget_bytes": 10**6}), 422,
     ["FLOPs", "add up", "2**62"]),
    ("working bytes past int64",
     post_json({"graph": graph_json(step={"argument_bytes": 0, "output_bytes": 0, "regions": [
         {"source": "s", "length": 1, "working_bytes": 2**80}]}, node_region=[-1] * 4,
         value_region=[-1] * 5), "budget_bytes": 10**6}), 422,
     ["graph.step.regions.0.working_bytes", "less than 4611686018427387904"]),
    ("aliases above arguments and outputs",
     post_json({"graph": graph_json(step={"argument_bytes": 10, "output_bytes": 5,
                                          "alias_bytes": 10**12}, node_region=[-1] * 4,
                                    value_region=[-1] * 5), "budget_bytes": 10**6}), 422,
     ["step.alias_bytes", "exceeds"]),
    ("offload prices past int64",
     post_json({"graph": graph_json(), "budget_bytes": 10**6, "options": {
         "offload": {"host_bandwidth": 7, "device_flop_rate": 10**18}}}), 422,
     ["device_flop_rate", "host_bandwidth", "64-bit"]),
    ("a frontier budget past int64",
     lambda c: c.post("/v1/frontier", json={"graph": graph_json(), "budgets": [10**29]}), 422,
     ["budgets.0"]),
    ("unknown option", post_json({"graph": graph_json(), "budget_bytes": 1,
                                  "options": {"speed": "fast"}}), 422, ["options.speed"]),
    ("body over the limit", post_raw(b" " * (MAX_BODY + 1)), 413, [str(MAX_BODY)]),
    ("gzip bomb", post_raw(gzip_bomb(), **{"Content-Encoding": "gzip"}), 413,
     ["inflates past"]),
    ("bad gzip", post_raw(b"not gzip at all", **{"Content-Encoding": "gzip"}), 400, ["gzip"]),
    ("unsupported encoding", post_raw(b"{}", **{"Content-Encoding": "br"}), 415, ["br"]),
    ("not JSON", post_raw(b"graph=1", **{"Content-Type": "application/x-www-form-urlencoded"}),
     415, ["Content-Type: application/json"]),
    ("graph over the node limit", post_json(body(chain(301), 10**9)), 413,
     ["301 nodes", "OPTIREMAT_MAX_GRAPH_NODES"]),
    # counted before the parse: a body that is otherwise no graph at all is a 413, not a 422
    ("node ids over the limit, before validation",
     post_json({"graph": {"node_id": list(range(400))}, "budget_bytes": 1}), 413,
     ["at least 400 nodes", "OPTIREMAT_MAX_GRAPH_NODES"]),
    ("value ids over the limit, before validation",
     post_raw(b'{"budget_bytes": 1, "graph": {"value_id" : [' + b"1," * 700 + b'1]}}'), 413,
     ["at least 701 values", "OPTIREMAT_MAX_GRAPH_VALUES"]),
    ("frontier without budgets or count",
     lambda c: c.post("/v1/frontier", json={"graph": graph_json()}), 422, ["exactly one"]),
    ("unknown path", lambda c: c.get("/v2/solve"), 404, ["/v2/solve"]),
    ("wrong method", lambda c: c.get("/v1/solve"), 405, ["GET"]),
]


def assert_problem(response: httpx.Response, status: int, words: list[str]) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["status"] == status
    assert problem["title"] and problem["type"]
    assert problem["request_id"] == response.headers["X-Request-ID"]
    for word in words:
        assert word in problem["detail"], problem
    return problem


@pytest.mark.parametrize(("request_", "status", "words"),
                         [pytest.param(*case[1:], id=case[0]) for case in BAD_INPUTS])
def test_bad_input_gets_a_clear_problem(server: Server, request_: Callable[..., httpx.Response],
                                        status: int, words: list[str]) -> None:
    with server.client() as client:
        assert_problem(request_(client), status, words)
        assert client.get("/readyz").status_code == 200  # and the server keeps serving


def test_a_budget_below_the_smallest_feasible_one_names_that_budget(server: Server) -> None:
    graph = chain(10, name="too-small")
    smallest = min_feasible_budget(graph)
    with server.client() as client:
        problem = assert_problem(client.post("/v1/solve", json=body(graph, smallest - 1)), 422,
                                 [str(smallest)])
        assert problem["min_budget_bytes"] == smallest
        again = client.post("/v1/solve", json=body(graph, smallest - 1))  # now from the store
        assert again.status_code == 422 and again.json()["detail"] == problem["detail"]
        assert client.post("/v1/solve", json=body(graph, smallest)).status_code == 200


def test_validation_problems_list_every_error(server: Server) -> None:
    with server.client() as client:
        problem = assert_problem(post_json({"graph": graph_json(value_bytes=[-1, -2, 1, 1, 1]),
                                            "budget_bytes": -3})(client), 422, [])
    errors = {tuple(e["loc"]): e["msg"] for e in problem["errors"]}
    assert ("body", "budget_bytes") in errors
    assert "value 0" in errors[("body", "graph")]


def test_a_missing_or_wrong_api_key_is_401(keyed_server: Server) -> None:
    request = body(chain(4, name="auth"), 10**6)
    with keyed_server.client() as client:
        missing = assert_problem(client.post("/v1/solve", json=request), 401, ["API key"])
        assert client.post("/v1/solve", json=request).headers["WWW-Authenticate"] == "Bearer"
        wrong = client.post("/v1/solve", json=request,
                            headers={"Authorization": "Bearer gamma-key"})
        assert_problem(wrong, 401, ["not valid"])
        assert missing["type"] == "about:blank"
        for key in ("alpha-key", "beta-key", "file-key-1"):
            ok = client.post("/v1/solve", json=request, headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200, ok.text
        assert_problem(client.get("/v1/jobs/" + "0" * 64), 401, [])
        # probes stay open for the orchestrator; metrics, as configured, need a key
        for path in ("/healthz", "/readyz"):
            assert client.get(path).status_code == 200
        assert_problem(client.get("/metrics"), 401, ["API key"])
        scraped = client.get("/metrics", headers={"Authorization": "Bearer file-key-1"})
        assert scraped.status_code == 200 and "optiremat_cache_hits_total" in scraped.text


def test_a_rotated_key_file_takes_effect_without_a_restart(keyed_server: Server,
                                                           key_file: Path) -> None:
    request = body(chain(4, name="rotation"), 10**6)

    def status(key: str) -> int:
        with keyed_server.client() as client:
            return client.post("/v1/solve", json=request,
                               headers={"Authorization": f"Bearer {key}"}).status_code

    assert (status("file-key-1"), status("file-key-2")) == (200, 401)
    key_file.write_text("file-key-2\n")  # what a Secret update does to the mounted file
    deadline = time.monotonic() + 10
    while status("file-key-2") != 200:
        assert time.monotonic() < deadline, "the new key was not taken"
        time.sleep(0.2)
    assert status("file-key-1") == 401 and status("alpha-key") == 200


def test_a_body_that_never_arrives_is_answered_408_and_the_connection_closed(
        server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        # before sending: the server's deadline starts once it has the headers, which may
        # be before sendall returns here
        started = time.monotonic()
        sock.sendall(b"POST /v1/solve HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
        received = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            received += chunk
        waited = time.monotonic() - started
    head, _, payload = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), received
    assert b"connection: close" in head.lower()
    assert "OPTIREMAT_BODY_TIMEOUT_S" in json.loads(payload)["detail"]
    assert waited >= BODY_TIMEOUT_S  # and at most the socket's 30 s, or recv would raise
    with server.client() as client:
        assert client.get("/readyz").status_code == 200


def test_the_error_log_line_carries_the_request_id(server: Server) -> None:
    with server.client() as client:
        rid = client.post("/v1/solve", content=b"{",
                          headers={"Content-Type": "application/json"}).headers["X-Request-ID"]

    def lines() -> list[dict[str, Any]]:
        return [json.loads(x) for x in server.log().splitlines() if rid in x]

    deadline = time.monotonic() + 5  # the line is written once the answer has gone out
    while not lines() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(lines()) == 1 and lines()[0]["status"] == 400


# ---- the early caps read keys as JSON does ----------------------------------

NODE_CAP, VALUE_CAP, EDGE_CAP = 300, 600, 1200  # the server fixture's


def capped_column_entry(column: str) -> Any:
    """One entry of a capped column, awkward where it can be: strings with commas and
    brackets, inner arrays (whose commas are not the column's)."""
    if column in ("node_primitive", "node_key", "node_source", "value_dtype"):
        return "f(a, b]"
    if column == "node_mode":
        return "free"
    if column == "value_shape":
        return [3, 4]
    return 7


def capped_columns() -> list[tuple[str, int]]:
    """(column, entries one past its cap): every per-node, per-value and per-use column."""
    from optiremat.service.api.caps import CAP_OF  # the table the server counts by
    caps = {"nodes": NODE_CAP, "values": VALUE_CAP, "value references": EDGE_CAP}
    return [(column, caps[what] + extra + 1) for column, (what, _, _, extra) in CAP_OF.items()]


def escaped(key: str) -> str:
    """``key`` with every character a JSON \\u escape: the same key to any JSON reader."""
    return "".join(f"\\u{ord(c):04X}" for c in key)


@pytest.mark.parametrize("encoding", ["identity", "gzip"])
@pytest.mark.parametrize(("column", "entries"), capped_columns())
def test_every_capped_column_is_refused_before_the_parse_however_its_key_is_spelt(
        server: Server, column: str, entries: int, encoding: str) -> None:
    items = json.dumps([capped_column_entry(column)] * entries)
    # Cut short after the array: a parse would answer 400, so a 413 comes from the scan.
    raw = f'{{"budget_bytes": 1, "graph": {{"{escaped(column)}" :\n {items}'.encode()
    headers = {"Content-Type": "application/json"}
    if encoding == "gzip":
        raw, headers["Content-Encoding"] = gzip.compress(raw), "gzip"
    with server.client() as client:
        problem = assert_problem(client.post("/v1/solve", content=raw, headers=headers), 413,
                                 ["at least", "OPTIREMAT_MAX_GRAPH_"])
        from optiremat.service.api.caps import CAP_OF
        what = CAP_OF[column][0]
        assert f" {what}" in problem["detail"] and column.startswith(
            {"nodes": ("node", "input_ptr", "output_ptr"), "values": ("value",)}.get(
                what, ("input_ids", "output_ids", "inputs", "backward_reads", "carry")))


def test_a_body_the_scan_cannot_read_is_capped_after_the_parse_before_validation(
        server: Server) -> None:
    # 10,001 arrays after colons inside strings end the scan (it gives up rather than
    # spend a step on each); the parsed body is then checked before validation, so a
    # graph that is nothing but 301 node ids is a 413 (counted exactly), not a 422.
    data = {"pad": [":["] * 10_001, "budget_bytes": 1, "gr\\u0061ph": None}
    raw = json.dumps(data).replace('"gr\\\\u0061ph": null',
                                   f'"gr\\u0061ph": {{"{escaped("node_id")}": '
                                   f'{json.dumps(list(range(NODE_CAP + 1)))}}}').encode()
    with server.client() as client:
        problem = assert_problem(post_raw(raw)(client), 413, ["301 nodes"])
        assert "at least" not in problem["detail"]
        # and one under the caps is validated as usual
        assert_problem(post_raw(raw.replace(b", 300]", b"]"))(client), 422,
                      ["graph.value_id: Field required"])


def test_an_escaped_graph_under_the_caps_solves(server: Server) -> None:
    request = json.dumps(body(chain(6, name="escaped"), 10**9))
    for key in ("graph", "node_id", "value_id", "input_ptr"):
        request = request.replace(f'"{key}"', f'"{escaped(key)}"')
    with server.client() as client:
        answer = post_raw(request.encode())(client)
    assert answer.status_code == 200, answer.text
    assert answer.json()["graph_hash"] == chain(6, name="escaped").content_hash


def solves_metric(client: httpx.Client, outcome: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'optiremat_solves_total{{outcome="{outcome}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_request_the_solver_refuses_is_counted_invalid_not_failed(server: Server) -> None:
    # Offload prices whose objective overflows are refused by the solver in a worker (a
    # 422); counting them as failed solves showed failures that no job had.
    request = {"graph": graph_json(name="overflowing prices"), "budget_bytes": 10**6,
               "options": {"offload": {"host_bandwidth": 7, "device_flop_rate": 10**18}}}
    with server.client() as client:
        failed, invalid = solves_metric(client, "failed"), solves_metric(client, "invalid")
        assert_problem(client.post("/v1/solve", json=request), 422, ["64-bit"])
        assert solves_metric(client, "failed") == failed
        assert solves_metric(client, "invalid") == invalid + 1


AUTH_FAILURES = 3


@pytest.fixture(scope="module")
def throttled_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from running_server(tmp_path_factory, workers="1", api_keys="alpha-key",
                              auth_failures_per_minute=str(AUTH_FAILURES))


def test_wrong_api_keys_from_one_address_are_throttled(throttled_server: Server) -> None:
    def with_key(client: httpx.Client, key: str) -> httpx.Response:
        return client.get("/v1/jobs/" + "0" * 64, headers={"Authorization": f"Bearer {key}"})

    with throttled_server.client() as client:
        assert with_key(client, "alpha-key").status_code == 404  # a right key: no such job
        for attempt in range(AUTH_FAILURES):
            assert_problem(with_key(client, f"guess-{attempt}"), 401, ["not valid"])
        throttled = with_key(client, "guess-next")
        assert_problem(throttled, 429, ["wrong API key", "OPTIREMAT_AUTH_FAILURES_PER_MINUTE"])
        assert 1 <= int(throttled.headers["Retry-After"]) <= 60 // AUTH_FAILURES
        # Past the limit even the right key is turned away, unchecked: a guess that hits
        # cannot be told from one that misses.
        assert with_key(client, "alpha-key").status_code == 429
        assert client.get("/v1/jobs/" + "0" * 64).status_code == 401  # no key: no guess
        assert client.get("/healthz").status_code == 200
        rejected = [line for line in client.get("/metrics").text.splitlines()
                    if line.startswith('optiremat_rejected_requests_total{reason="auth_f')]
        assert rejected and float(rejected[0].rsplit(" ", 1)[1]) >= 2
