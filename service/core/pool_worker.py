"""A pool worker process: runs tasks for ``pool.WorkerPool``, one at a time.

This module is the entry point of a spawned process, so it imports only the task
code and solver/ (never FastAPI, never JAX). Tasks arrive as ``(task, graph_json)``;
what goes back is ``Ready`` once, then ``Progress`` reports and each task's
``Outcome``.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event

from optiremat.service.core.memory import LARGE_BODY_BYTES, trim
from optiremat.service.core.tasks import run_task

WORKER_NICENESS = 10


@dataclass(frozen=True)
class Ready:
    """Sent once, when the worker has imported the solver and takes tasks."""


def worker_main(conn: Connection, cancel: Event) -> None:
    """Serve ``(task, graph_json)`` from ``conn`` until it closes or sends ``None``."""
    # Ctrl-C in a terminal, and systemd's default KillMode, signal the whole process
    # group: the server decides when we stop (it asks through the pipe, and kills a
    # worker that does not), so that the solve it is answering finishes first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The API shares the machine: on a busy one the scheduler serves it before the
    # solves, so that answers from the store stay quick while the workers solve.
    os.nice(WORKER_NICENESS)
    import optiremat.solver.solve  # noqa: F401  (warm the import before the first task)

    send_lock = threading.Lock()

    def send(message: object) -> None:
        with send_lock:  # the solver may report progress from its own threads
            conn.send(message)

    send(Ready())
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        task, graph_json = message
        send(run_task(task, graph_json, cancel, send))
        large = len(graph_json) >= LARGE_BODY_BYTES
        del message, graph_json
        if large:  # its objects are freed: hand their pages back (tens of ms: not each time)
            trim()
