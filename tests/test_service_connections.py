"""Connections a hostile or broken client holds: deadlines for the request line and
headers and for idle keep-alive, the connection limit, and protocol errors as problems.

A real server on loopback and raw sockets, as such a client would send them.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.service_harness import Server, metric, running_server

HEADER_TIMEOUT_S = 1.0
KEEP_ALIVE_S = 1.0
MAX_CONNECTIONS = 8
SLACK_S = 2.0  # a loaded 2-core machine's scheduling


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from running_server(tmp_path_factory, workers="1",
                              header_timeout_s=str(HEADER_TIMEOUT_S),
                              keep_alive_timeout_s=str(KEEP_ALIVE_S),
                              max_connections=str(MAX_CONNECTIONS), body_timeout_s="30")


def connect(server: Server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(HEADER_TIMEOUT_S + 10)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends before it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def read_response(sock: socket.socket) -> bytes:
    """One whole response (headers and Content-Length bytes of body), the connection
    left open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    length = int(status_headers_body(data)[1]["content-length"])
    while len(data.partition(b"\r\n\r\n")[2]) < length:
        data += sock.recv(65536)
    return data


def status_headers_body(response: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def turned_away(client: httpx.Client, reason: str) -> float:
    return metric(client, f'optiremat_connections_turned_away_total{{reason="{reason}"}}')


def closed_within(sock: socket.socket) -> tuple[bytes, float]:
    started = time.monotonic()
    data = read_until_closed(sock)
    return data, time.monotonic() - started


def test_a_connection_that_sends_nothing_is_closed_at_the_header_deadline(
        server: Server) -> None:
    with connect(server) as sock:
        data, seconds = closed_within(sock)
    assert data == b""  # nothing was asked, so nothing is answered
    assert HEADER_TIMEOUT_S - 0.2 <= seconds <= HEADER_TIMEOUT_S + SLACK_S


def test_headers_that_stop_halfway_are_answered_408_at_the_deadline(server: Server) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # no blank line: not done
        time.sleep(HEADER_TIMEOUT_S / 2)
        sock.sendall(b"X-Trickle: 1\r\n")  # a byte now and then does not extend it
        data, seconds = closed_within(sock)
    status, headers, body = status_headers_body(data)
    assert status == 408 and headers["content-type"] == "application/problem+json"
    assert "OPTIREMAT_HEADER_TIMEOUT_S" in json.loads(body)["detail"]
    assert seconds <= HEADER_TIMEOUT_S / 2 + SLACK_S
    with server.client() as client:
        assert turned_away(client, "header_timeout") >= 1


def test_an_idle_kept_alive_connection_is_closed_and_a_stalled_second_request_too(
        server: Server) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with connect(server) as sock:
        sock.sendall(request)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        data, seconds = closed_within(sock)  # kept alive, then idle
    assert data == b"" and KEEP_ALIVE_S - 0.2 <= seconds <= KEEP_ALIVE_S + SLACK_S
    with connect(server) as sock:
        sock.sendall(request)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # the next request stalls
        data, seconds = closed_within(sock)
    assert status_headers_body(data)[0] == 408
    assert seconds <= HEADER_TIMEOUT_S + SLACK_S


def test_idle_sockets_past_the_limit_make_room_and_healthz_answers(server: Server) -> None:
    idle = [connect(server) for _ in range(5 * MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)
        started = time.monotonic()
        assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
        assert time.monotonic() - started < 1.0
        # the longest-waiting were closed to make room: the first ones are gone
        idle[0].settimeout(0.5)
        assert idle[0].recv(1) == b""
    finally:
        for sock in idle:
            sock.close()
    lines = [r for r in server.log_records() if r["msg"].startswith("connection limit")]
    assert lines and lines[0]["level"] == "warning"
    assert lines[0]["max_connections"] == MAX_CONNECTIONS and lines[0]["closed_idle"] >= 1
    with server.client() as client:
        assert turned_away(client, "longest_idle") >= 1
        assert metric(client, "optiremat_open_connections") <= MAX_CONNECTIONS


def test_past_the_limit_of_busy_connections_a_request_is_503_with_retry_after(
        server: Server) -> None:
    # Each holds a request in flight: headers sent, the body it announced never comes.
    busy = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in busy:
            sock.sendall(b"POST /v1/solve HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 100\r\n\r\n")
        time.sleep(0.3)
        with connect(server) as sock:
            sock.sendall(b"POST /v1/solve HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 2\r\n\r\n{}")
            status, headers, body = status_headers_body(read_until_closed(sock))
        assert status == 503 and int(headers["retry-after"]) >= 1
        assert headers["content-type"] == "application/problem+json"
        assert "OPTIREMAT_MAX_CONNECTIONS" in json.loads(body)["detail"]
        # the probes still answer
        for path in ("/healthz", "/readyz"):
            assert httpx.get(f"{server.url}{path}", timeout=5).status_code == 200
    finally:
        for sock in busy:
            sock.close()
    time.sleep(0.3)
    assert httpx.post(f"{server.url}/v1/solve", json={}, timeout=5).status_code == 422
    with server.client() as client:
        assert turned_away(client, "over_limit") >= 1


def test_a_malformed_request_line_is_a_problem_not_plain_text(server: Server) -> None:
    with connect(server) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, headers, body = status_headers_body(read_until_closed(sock))
    assert status == 400 and headers["content-type"] == "application/problem+json"
    assert json.loads(body)["title"] == "Malformed HTTP request"


def test_probes_answer_head(server: Server) -> None:
    for path in ("/healthz", "/readyz"):
        answer = httpx.head(f"{server.url}{path}", timeout=5)
        assert answer.status_code == 200 and answer.content == b""


def test_readyz_not_ready_at_start_up_is_no_error_line(server: Server) -> None:
    readyz = [r for r in server.log_records() if r.get("path") == "/readyz"]
    assert readyz  # the harness waited on it
    assert all(r["level"] == "info" for r in readyz), readyz
