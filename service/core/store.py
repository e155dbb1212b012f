"""SQLite store for jobs and results: the embedded default's only state on disk.

Methods are blocking and thread-safe; the async layer calls them through
``asyncio.to_thread`` so a slow disk never stalls the event loop.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optiremat.service.core.worker import BudgetRange, Infeasible, Solved

StoredResult = Solved | Infeasible | BudgetRange

_SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    key TEXT PRIMARY KEY,          -- request hash
    kind TEXT NOT NULL,            -- solution | infeasible | budget_range
    body TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,           -- request hash
    status TEXT NOT NULL,
    spec TEXT NOT NULL,            -- graph_hash, budget_bytes, options
    graph TEXT NOT NULL,           -- canonical graph JSON, to rerun after a restart
    solution TEXT,
    error TEXT,
    progress TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status);
"""


@dataclass(frozen=True)
class JobRecord:
    id: str
    status: str
    spec: dict[str, Any]
    solution_json: str | None
    error: dict[str, Any] | None
    progress: dict[str, Any] | None
    created_at: float
    updated_at: float


def _encode(result: StoredResult) -> tuple[str, str]:
    if isinstance(result, Solved):
        return "solution", result.solution_json
    if isinstance(result, Infeasible):
        return "infeasible", json.dumps({"budget_bytes": result.budget_bytes,
                                         "min_budget_bytes": result.min_budget_bytes})
    return "budget_range", json.dumps(
        {"min": result.min_feasible_budget, "max": result.max_useful_budget}
    )


def _decode(kind: str, body: str) -> StoredResult:
    if kind == "solution":
        return Solved(body)
    data = json.loads(body)
    if kind == "infeasible":
        return Infeasible(data["budget_bytes"], data["min_budget_bytes"])
    return BudgetRange(data["min"], data["max"])


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


class Store:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, _SCHEMA_VERSION):
                raise RuntimeError(
                    f"{path} has store schema {version}; this build reads {_SCHEMA_VERSION}. "
                    "Point OPTIREMAT_DATA_DIR elsewhere or delete the file."
                )
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def ping(self) -> None:
        with self._lock:
            self._db.execute("SELECT 1").fetchone()

    # ---- results ------------------------------------------------------------

    def get_result(self, key: str) -> StoredResult | None:
        with self._lock:
            row = self._db.execute("SELECT kind, body FROM results WHERE key = ?",
                                   (key,)).fetchone()
        return None if row is None else _decode(*row)

    def put_result(self, key: str, result: StoredResult) -> None:
        kind, body = _encode(result)
        with self._lock:
            self._db.execute(
                "INSERT OR IGNORE INTO results (key, kind, body, created_at) VALUES (?, ?, ?, ?)",
                (key, kind, body, time.time()),
            )

    # ---- jobs ---------------------------------------------------------------

    def get_job(self, job_id: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, status, spec, solution, error, progress, created_at, updated_at "
                "FROM jobs WHERE id = ?", (job_id,),
            ).fetchone()
        if row is None:
            return None
        return JobRecord(row[0], row[1], json.loads(row[2]), row[3], _loads(row[4]),
                         _loads(row[5]), row[6], row[7])

    def put_job(self, job_id: str, status: str, spec: dict[str, Any], graph_json: str) -> None:
        """Create the job, or restart a finished one under the same id."""
        now = time.time()
        with self._lock:
            self._db.execute(
                "INSERT INTO jobs (id, status, spec, graph, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET status = excluded.status,"
                " solution = NULL, error = NULL, progress = NULL, updated_at = excluded.updated_at",
                (job_id, status, json.dumps(spec), graph_json, now, now),
            )

    def update_job(self, job_id: str, status: str, *, solution_json: str | None = None,
                   error: dict[str, Any] | None = None,
                   progress: dict[str, Any] | None = None) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE jobs SET status = ?, solution = ?, error = ?, "
                "progress = COALESCE(?, progress), updated_at = ? WHERE id = ?",
                (status, solution_json, None if error is None else json.dumps(error),
                 None if progress is None else json.dumps(progress), time.time(), job_id),
            )

    def unfinished_jobs(self) -> list[tuple[str, dict[str, Any], str]]:
        """(id, spec, graph JSON) of jobs a previous server left queued or running."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, spec, graph FROM jobs WHERE status IN ('queued', 'running') "
                "ORDER BY created_at"
            ).fetchall()
        return [(r[0], json.loads(r[1]), r[2]) for r in rows]
