"""A loopback TCP proxy in front of a real server, flaky on purpose.

Until ``listen()`` its port is bound but not listening, so connections to it are
refused (the kernel answers with a reset), exactly as for a server not yet up.
Once listening it answers the first ``unavailable`` requests itself with
``refusal`` (503 by default; 429 as a rate limit answers) and forwards every
later connection to the target, recording what each client sent first
(request line and headers).
"""

from __future__ import annotations

import contextlib
import socket
import threading


class FlakyProxy:
    def __init__(self, target_port: int, *, unavailable: int = 0,
                 refusal: bytes = b"503 Service Unavailable") -> None:
        self.target_port = target_port
        self.unavailable = unavailable
        self.refusal = refusal
        self.requests: list[bytes] = []  # the first bytes of each forwarded connection
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def listen(self) -> None:
        self._sock.listen(16)
        self._start(self._accept_loop)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() below
        self._sock.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def _start(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if self.unavailable > 0:
                self.unavailable -= 1
                self._start(self._refuse, conn)
            else:
                self._start(self._forward, conn)

    def _refuse(self, conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 " + self.refusal + b"\r\nRetry-After: 0\r\n"
                         b"Content-Length: 0\r\nConnection: close\r\n\r\n")

    def _forward(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        first = client.recv(65536)
        self.requests.append(first)
        upstream.sendall(first)
        back = threading.Thread(target=self._pipe, args=(upstream, client), daemon=True)
        back.start()
        self._pipe(client, upstream)
        back.join(timeout=30)
        client.close()
        upstream.close()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
