"""SQLite store for answers and jobs: the embedded default's only state on disk.

Methods are blocking and thread-safe; the async layer calls them through
``asyncio.to_thread`` so a slow disk never stalls the event loop. Outcomes are
kept in the one codec of ``optiremat.service.core.outcome``.

Tables: ``answers`` (request hash -> answer), ``jobs`` (request hash -> task,
status, outcome, progress, times) and ``graphs`` (content hash -> canonical graph
JSON), which holds the graphs of unfinished jobs, to run them again after a
restart; a graph goes once no unfinished job needs it.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from optiremat.service.core.errors import Unavailable
from optiremat.service.core.models import JobStatus, Progress
from optiremat.service.core.outcome import Answer, Outcome, decode, encode, is_answer
from optiremat.service.core.runs import JobRecord, job_status
from optiremat.service.core.tasks import SolveTask

log = logging.getLogger("optiremat.service")

# 1: the first release's layout and codec; 2: one outcome codec, graphs apart.
_SCHEMA_VERSION = 2
_SCHEMA = """
CREATE TABLE IF NOT EXISTS answers (
    key TEXT PRIMARY KEY,          -- request hash
    outcome TEXT NOT NULL,         -- the outcome codec's JSON
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    key TEXT PRIMARY KEY,          -- request hash
    task TEXT NOT NULL,            -- the SolveTask's JSON
    graph_hash TEXT NOT NULL,
    status TEXT NOT NULL,
    outcome TEXT,                  -- once finished
    progress TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status);
CREATE TABLE IF NOT EXISTS graphs (
    hash TEXT PRIMARY KEY,         -- the graph's content hash
    json TEXT NOT NULL             -- canonical graph JSON
);
"""
_UNFINISHED = (JobStatus.QUEUED, JobStatus.RUNNING)


class SqliteStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > _SCHEMA_VERSION:
                raise RuntimeError(
                    f"{path} has store schema {version}; this build reads {_SCHEMA_VERSION}. "
                    "Point OPTIREMAT_DATA_DIR elsewhere or delete the file."
                )
            if 0 < version < _SCHEMA_VERSION:
                # Answers and jobs are a cache of what the solver computes: start afresh.
                log.warning("%s has store schema %d; starting it afresh as schema %d",
                            path, version, _SCHEMA_VERSION)
                self._db.executescript("DROP TABLE IF EXISTS results; DROP TABLE IF EXISTS jobs;")
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One all-or-nothing write: a failure leaves the store as it was."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def unavailable(self, exc: Exception) -> Unavailable | None:
        if not isinstance(exc, sqlite3.OperationalError):
            return None
        return Unavailable("Store unavailable",
                           f"the result store ({self.path}) failed: {exc}; retry shortly")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def ping(self) -> None:
        with self._lock:
            self._db.execute("SELECT 1").fetchone()

    # ---- answers ------------------------------------------------------------

    def get_answer(self, key: str) -> Answer | None:
        with self._lock:
            row = self._db.execute("SELECT outcome FROM answers WHERE key = ?",
                                   (key,)).fetchone()
        if row is None:
            return None
        answer = decode(row[0])
        assert is_answer(answer)
        return answer

    # ---- jobs ---------------------------------------------------------------

    def get_job(self, key: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute(
                "SELECT task, outcome, progress, created_at, updated_at FROM jobs WHERE key = ?",
                (key,),
            ).fetchone()
        if row is None:
            return None
        task, outcome, progress, created_at, updated_at = row
        return JobRecord(key, SolveTask.model_validate_json(task), created_at, updated_at,
                         None if outcome is None else decode(outcome),
                         None if progress is None else Progress.model_validate_json(progress))

    def put_job(self, key: str, task: SolveTask, graph_json: str) -> None:
        """Create the job, or restart a finished one under the same key, with its graph."""
        now = time.time()
        with self._transaction() as db:
            db.execute("INSERT OR IGNORE INTO graphs (hash, json) VALUES (?, ?)",
                       (task.graph_hash, graph_json))
            db.execute(
                "INSERT INTO jobs (key, task, graph_hash, status, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO UPDATE SET "
                "status = excluded.status, outcome = NULL, progress = NULL, "
                "updated_at = excluded.updated_at",
                (key, task.model_dump_json(), task.graph_hash, JobStatus.QUEUED, now, now),
            )

    def record(self, key: str, outcome: Outcome, progress: Progress | None = None) -> None:
        """How a run ended: its answer (the first one stays: answers never change) and,
        if it is a job, the job's outcome; the job's graph goes when no other
        unfinished job needs it."""
        now = time.time()
        with self._transaction() as db:
            if is_answer(outcome):
                db.execute("INSERT OR IGNORE INTO answers (key, outcome, created_at) "
                           "VALUES (?, ?, ?)", (key, encode(outcome), now))
            db.execute(
                "UPDATE jobs SET status = ?, outcome = ?, progress = COALESCE(?, progress), "
                "updated_at = ? WHERE key = ?",
                (job_status(outcome), encode(outcome),
                 None if progress is None else progress.model_dump_json(), now, key),
            )
            db.execute(
                "DELETE FROM graphs WHERE hash IN (SELECT graph_hash FROM jobs WHERE key = ?) "
                "AND NOT EXISTS (SELECT 1 FROM jobs WHERE graph_hash = graphs.hash "
                "AND status IN (?, ?))", (key, *_UNFINISHED),
            )

    def unfinished_jobs(self) -> list[tuple[str, SolveTask, str]]:
        """(key, task, graph JSON) of the jobs a previous server left queued or running."""
        with self._lock:
            rows = self._db.execute(
                "SELECT jobs.key, jobs.task, graphs.json FROM jobs "
                "JOIN graphs ON graphs.hash = jobs.graph_hash "
                "WHERE jobs.status IN (?, ?) ORDER BY jobs.created_at", _UNFINISHED,
            ).fetchall()
        return [(key, SolveTask.model_validate_json(task), graph) for key, task, graph in rows]
