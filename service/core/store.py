"""SQLite store for answers and jobs: the embedded default's only state on disk.

(Over 400 lines on purpose: the schema, every statement on it and the bounds that
evict from it are read together.)

Methods are blocking and thread-safe; the async layer calls them through
``asyncio.to_thread`` so a slow disk never stalls the event loop. Outcomes are
kept in the one codec of ``optiremat.service.core.outcome``. Every write is one
transaction: a failure (a full disk, a read-only one) leaves the store as it was.

Tables: ``answers`` (request hash -> answer), ``jobs`` (request hash -> task,
status, outcome, progress, times), ``job_owners`` (each owner's submission of a job:
when, and whether withdrawn) and ``graphs`` (content hash -> canonical graph JSON),
which holds the graphs of unfinished jobs, to run them again after a restart; a
graph goes once no unfinished job needs it.

The store is bounded (``max_bytes``, ``ttl_s``). Answers and finished jobs record
when they were last used; reads note it in memory and ``maintain`` writes it, so
a cache hit never waits on a write. An entry unused for ``ttl_s`` goes; past
``max_bytes`` the least recently used go until the pages in use are back under
``LOW_WATER`` of it, and the freed pages are handed back to the file system
(incremental vacuum, then a WAL checkpoint that truncates the log). Unfinished
jobs, and jobs finished in the last ``job_grace_s``, are never evicted.
The data directory then holds at most ``max_bytes`` of pages, plus the WAL (capped
at a sixteenth of ``max_bytes``, 4 MiB at the most) and the largest single write.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from optiremat.service.core.errors import Unavailable
from optiremat.service.core.outcome import Answer, Outcome, decode, encode, is_answer
from optiremat.service.core.runs import (
    ANONYMOUS,
    JobRecord,
    Position,
    Withdrawal,
    job_status,
)
from optiremat.service.core.tasks import SolveTask
from optiremat.solver.wire import STORE_UNAVAILABLE, JobStatus, Progress

log = logging.getLogger("optiremat.service")

# 1: the first release's layout and codec; 2: one outcome codec, graphs apart, sizes and
# last use for eviction; 3: submissions withdrawn (job_owners.cancelled), and one for
# every job (ANONYMOUS's with keys off).
_SCHEMA_VERSION = 3
_SCHEMA = """
CREATE TABLE IF NOT EXISTS answers (
    key TEXT PRIMARY KEY,          -- request hash
    outcome TEXT NOT NULL,         -- the outcome codec's JSON
    size INTEGER NOT NULL,         -- bytes kept, for eviction
    used_at REAL NOT NULL          -- last written or read
);
CREATE INDEX IF NOT EXISTS answers_by_use ON answers (used_at);
CREATE TABLE IF NOT EXISTS jobs (
    key TEXT PRIMARY KEY,          -- request hash
    task TEXT NOT NULL,            -- the SolveTask's JSON
    graph_hash TEXT NOT NULL,
    status TEXT NOT NULL,
    outcome TEXT,                  -- once finished
    progress TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    size INTEGER NOT NULL,
    used_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status);
CREATE INDEX IF NOT EXISTS jobs_by_use ON jobs (used_at);
CREATE INDEX IF NOT EXISTS jobs_newest_first ON jobs (created_at DESC, key DESC);
CREATE TABLE IF NOT EXISTS job_owners (
    owner TEXT NOT NULL,           -- the key id of an API key that submitted the job
    key TEXT NOT NULL,
    created_at REAL NOT NULL,      -- the submission's, to list an owner's jobs newest first
    cancelled INTEGER NOT NULL DEFAULT 0,  -- withdrawn by its owner: runs.Withdrawal
    PRIMARY KEY (owner, key)
);
CREATE INDEX IF NOT EXISTS job_owners_newest_first ON job_owners (owner, created_at DESC, key DESC);
CREATE TABLE IF NOT EXISTS graphs (
    hash TEXT PRIMARY KEY,         -- the graph's content hash
    json TEXT NOT NULL             -- canonical graph JSON
);
"""
_UNFINISHED = (JobStatus.QUEUED, JobStatus.RUNNING)
# Evicting down to 90% of the bound, not just under it, lets a few writes pass before
# the next eviction instead of evicting on every write.
LOW_WATER = 0.9
_EVICT_BATCH = 256
# Free space a store in fault wants before it is called writable again: a few answers
# and the WAL's growth, not the few kB a full disk may have left.
PROBE_FREE_BYTES = 1 << 20


def _seen_by(owner: str | None) -> tuple[str, str, str]:
    """(columns, source, order) of jobs as ``owner`` sees them, the source taking the
    owner as its one parameter: its submissions, or with None every job, withdrawn
    when ``ANONYMOUS`` withdrew it."""
    created, withdrawn, join = (("jobs.created_at", "coalesce(mine.cancelled, 0)", "LEFT JOIN")
                                if owner is None else ("mine.created_at", "mine.cancelled", "JOIN"))
    return (f"jobs.key, task, outcome, progress, {created}, updated_at, status, {withdrawn}",
            f"jobs {join} job_owners AS mine ON mine.key = jobs.key AND mine.owner = ?",
            created)


def _job_record(row: tuple[str, str, str | None, str | None, float, float, str, int]
                ) -> JobRecord:
    key, task, outcome, progress, created_at, updated_at, status, withdrawn = row
    return JobRecord(key, SolveTask.model_validate_json(task), created_at, updated_at,
                     None if outcome is None else decode(outcome),
                     None if progress is None else Progress.model_validate_json(progress),
                     started=status == JobStatus.RUNNING, withdrawn=Withdrawal(withdrawn))


@dataclass(frozen=True)
class Evicted:
    expired: int = 0  # unused for the TTL
    evicted: int = 0  # least recently used, past the size bound


class SqliteStore:
    def __init__(self, path: Path, *, max_bytes: int = 1 << 30, ttl_s: float = 7 * 24 * 3600.0,
                 job_grace_s: float = 600.0,
                 on_evict: Callable[[Evicted], None] | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.job_grace_s = job_grace_s
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._used: dict[tuple[str, str], float] = {}  # (table, key) -> last read
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        with self._lock:
            self._open()

    def _open(self) -> None:
        db = self._db
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > _SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.path} has store schema {version}; this build reads {_SCHEMA_VERSION}. "
                "Point OPTIREMAT_DATA_DIR elsewhere or delete the file."
            )
        if version == 2:  # submissions gain their withdrawal; jobs owned by nobody, ANONYMOUS
            db.execute("ALTER TABLE job_owners ADD COLUMN cancelled INTEGER NOT NULL DEFAULT 0")
            db.execute("INSERT INTO job_owners (owner, key, created_at) SELECT ?, key, "
                       "created_at FROM jobs WHERE key NOT IN (SELECT key FROM job_owners)",
                       (ANONYMOUS,))
        elif 0 < version < _SCHEMA_VERSION:
            # Answers and jobs are a cache of what the solver computes: start afresh.
            log.warning("%s has store schema %d; starting it afresh as schema %d",
                        self.path, version, _SCHEMA_VERSION)
            db.executescript("DROP TABLE IF EXISTS results; DROP TABLE IF EXISTS jobs;")
        if db.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:  # 2: incremental
            db.execute("PRAGMA auto_vacuum=INCREMENTAL")
            db.execute("VACUUM")  # takes effect only through a VACUUM (instant when empty)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # WAL: a committed write survives a crash
        page_size = db.execute("PRAGMA page_size").fetchone()[0]
        wal_pages = max(16, min(1000, self.max_bytes // (16 * page_size)))
        db.execute(f"PRAGMA wal_autocheckpoint={wal_pages}")
        db.execute(f"PRAGMA journal_size_limit={wal_pages * page_size}")
        db.executescript(_SCHEMA)
        db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")

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
        return Unavailable.of(STORE_UNAVAILABLE,
                              f"the result store ({self.path}) failed: {exc}; retry shortly")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def ping(self) -> None:
        with self._lock:
            self._db.execute("SELECT 1").fetchone()

    def probe(self) -> None:
        """Raises ``sqlite3.OperationalError`` unless writes can go through: the file
        system writable with ``PROBE_FREE_BYTES`` free, and a write of nothing (the
        schema version again) committed. A small write alone would prove little: it
        may fit in the WAL's space already allocated on a disk still full."""
        stat = os.statvfs(self.path.parent)
        if stat.f_flag & os.ST_RDONLY:
            raise sqlite3.OperationalError("attempt to write a readonly database")
        free = stat.f_bavail * stat.f_frsize
        if free < PROBE_FREE_BYTES:
            raise sqlite3.OperationalError(
                f"database or disk is full ({free} bytes free, {PROBE_FREE_BYTES} wanted)")
        with self._transaction() as db:
            db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")

    # ---- answers ------------------------------------------------------------

    def get_answer(self, key: str) -> Answer | None:
        with self._lock:
            row = self._db.execute("SELECT outcome FROM answers WHERE key = ?",
                                   (key,)).fetchone()
            if row is None:
                return None
            self._used["answers", key] = time.time()
        answer = decode(row[0])
        assert is_answer(answer)
        return answer

    # ---- jobs ---------------------------------------------------------------

    def get_job(self, key: str, owner: str | None = None) -> JobRecord | None:
        columns, source, _ = _seen_by(owner)
        with self._lock:
            row = self._db.execute(f"SELECT {columns} FROM {source} WHERE jobs.key = ?",
                                   (ANONYMOUS if owner is None else owner, key)).fetchone()
            if row is None:
                return None
            self._used["jobs", key] = time.time()
        return _job_record(row)

    def submit(self, key: str, owner: str) -> None:
        with self._transaction() as db:
            db.execute("INSERT INTO job_owners (owner, key, created_at) VALUES (?, ?, ?) "
                       "ON CONFLICT (owner, key) DO UPDATE SET created_at = "
                       "excluded.created_at, cancelled = 0 WHERE cancelled != 0",
                       (owner, key, time.time()))

    def withdraw(self, key: str, owner: str | None) -> bool:
        with self._transaction() as db:
            self._move(db, key, owner, Withdrawal.NONE, Withdrawal.LEFT)
            return self._wanted(db, key)

    def stopped_for(self, key: str, owner: str | None) -> None:
        with self._transaction() as db:
            self._move(db, key, owner, Withdrawal.LEFT, Withdrawal.STOPPED)

    @staticmethod
    def _move(db: sqlite3.Connection, key: str, owner: str | None, old: Withdrawal,
              new: Withdrawal) -> None:
        """``owner``'s submission of the job (every one when None) from ``old`` to ``new``."""
        mine = "" if owner is None else " AND owner = ?"
        db.execute(f"UPDATE job_owners SET cancelled = ? WHERE key = ? AND cancelled = ?{mine}",
                   (new, key, old, *(() if owner is None else (owner,))))

    def wanted(self, key: str) -> bool:
        with self._lock:
            return self._wanted(self._db, key)

    @staticmethod
    def _wanted(db: sqlite3.Connection, key: str) -> bool:
        return db.execute("SELECT 1 FROM job_owners WHERE key = ? AND cancelled = 0",
                          (key,)).fetchone() is not None

    def list_jobs(self, owner: str | None, status: JobStatus | None, after: Position | None,
                  limit: int) -> tuple[list[JobRecord], Position | None]:
        columns, source, order = _seen_by(owner)
        args: list[object] = [ANONYMOUS if owner is None else owner]
        where = ["1"]
        if status is not None:
            # job_status in SQL: what the submission shows (runs.shows_run)
            where.append(f"(CASE WHEN coalesce(mine.cancelled, 0) = {Withdrawal.NONE} OR "
                         f"(mine.cancelled = {Withdrawal.STOPPED} AND status NOT IN "
                         f"('{JobStatus.QUEUED}', '{JobStatus.RUNNING}')) THEN status "
                         f"ELSE '{JobStatus.CANCELLED}' END) = ?")
            args.append(status)
        if after is not None:
            where.append(f"({order}, jobs.key) < (?, ?)")
            args += after
        with self._lock:
            rows = self._db.execute(
                f"SELECT {columns} FROM {source} WHERE {' AND '.join(where)} "
                f"ORDER BY {order} DESC, jobs.key DESC LIMIT ?", (*args, limit + 1)).fetchall()
        jobs = [_job_record(row) for row in rows[:limit]]
        more = len(rows) > limit
        return jobs, (jobs[-1].created_at, jobs[-1].key) if more else None

    def mark_running(self, key: str) -> None:
        """A worker took the queued job."""
        with self._transaction() as db:
            db.execute("UPDATE jobs SET status = ?, updated_at = ? WHERE key = ? AND status = ?",
                       (JobStatus.RUNNING, time.time(), key, JobStatus.QUEUED))

    def put_job(self, key: str, task: SolveTask, graph_json: str) -> None:
        """Create the job, or restart a finished one under the same key, with its graph."""
        now = time.time()
        task_json = task.model_dump_json()
        with self._transaction() as db:
            db.execute("INSERT OR IGNORE INTO graphs (hash, json) VALUES (?, ?)",
                       (task.graph_hash, graph_json))
            db.execute(
                "INSERT INTO jobs (key, task, graph_hash, status, created_at, updated_at, size, "
                "used_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO UPDATE SET "
                "status = excluded.status, outcome = NULL, progress = NULL, "
                "updated_at = excluded.updated_at, size = excluded.size, "
                "used_at = excluded.used_at",
                (key, task_json, task.graph_hash, JobStatus.QUEUED, now, now, len(task_json), now),
            )
        self._bound()

    def record(self, key: str, outcome: Outcome, progress: Progress | None = None) -> None:
        """How a run ended: its answer (the first one stays: answers never change) and,
        if it is a job, the job's outcome; the job's graph goes when no other
        unfinished job needs it."""
        now = time.time()
        text = encode(outcome)
        progress_json = None if progress is None else progress.model_dump_json()
        with self._transaction() as db:
            if is_answer(outcome):
                db.execute("INSERT OR IGNORE INTO answers (key, outcome, size, used_at) "
                           "VALUES (?, ?, ?, ?)", (key, text, len(text), now))
            db.execute(
                "UPDATE jobs SET status = ?, outcome = ?, progress = COALESCE(?, progress), "
                "updated_at = ?, used_at = ?, size = length(task) + ? + length(COALESCE(?, "
                "progress, '')) WHERE key = ?",
                (job_status(outcome), text, progress_json, now, now, len(text), progress_json,
                 key),
            )
            db.execute(
                "DELETE FROM graphs WHERE hash IN (SELECT graph_hash FROM jobs WHERE key = ?) "
                "AND NOT EXISTS (SELECT 1 FROM jobs WHERE graph_hash = graphs.hash "
                "AND status IN (?, ?))", (key, *_UNFINISHED),
            )
        self._bound()

    def unfinished_jobs(self) -> list[tuple[str, SolveTask, str]]:
        """(key, task, graph JSON) of the jobs a previous server left queued or running;
        they are queued again."""
        with self._lock:
            with suppress(sqlite3.OperationalError):  # a read-only store still lists them
                self._db.execute("UPDATE jobs SET status = ? WHERE status = ?",
                                 (JobStatus.QUEUED, JobStatus.RUNNING))
            rows = self._db.execute(
                "SELECT jobs.key, jobs.task, graphs.json FROM jobs "
                "JOIN graphs ON graphs.hash = jobs.graph_hash "
                "WHERE jobs.status IN (?, ?) ORDER BY jobs.created_at", _UNFINISHED,
            ).fetchall()
        return [(key, SolveTask.model_validate_json(task), graph) for key, task, graph in rows]

    # ---- bounds -------------------------------------------------------------

    def disk_bytes(self) -> int:
        """What the store takes on disk: the database, its WAL and shared memory."""
        total = 0
        for suffix in ("", "-wal", "-shm"):
            with suppress(FileNotFoundError):
                total += os.stat(f"{self.path}{suffix}").st_size
        return total

    def _pages_bytes(self) -> int:
        """Bytes of the database's pages in use (free pages excluded)."""
        db = self._db
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        free = db.execute("PRAGMA freelist_count").fetchone()[0]
        return int((pages - free) * db.execute("PRAGMA page_size").fetchone()[0])

    def _bound(self) -> None:
        """After a write: evict if the pages in use passed the bound."""
        with self._lock:
            if self._pages_bytes() <= self.max_bytes:
                return
        self.maintain()

    def maintain(self, now: float | None = None) -> Evicted:
        """Write the last uses noted by reads, drop what the TTL or the size bound
        evicts, and give the freed pages back to the file system."""
        now = time.time() if now is None else now
        evictable_jobs = (f"status NOT IN ('{JobStatus.QUEUED}', '{JobStatus.RUNNING}') "
                          f"AND updated_at < {now - self.job_grace_s}")
        with self._transaction() as db:
            for table in ("answers", "jobs"):
                db.executemany(f"UPDATE {table} SET used_at = max(used_at, ?) WHERE key = ?",
                               [(at, key) for (t, key), at in self._used.items() if t == table])
            self._used.clear()  # under the lock, in the transaction: kept if it fails
            stale = now - self.ttl_s
            expired = db.execute("DELETE FROM answers WHERE used_at < ?", (stale,)).rowcount
            expired += db.execute(f"DELETE FROM jobs WHERE used_at < ? AND {evictable_jobs}",
                                  (stale,)).rowcount
            evicted = 0
            while (excess := self._pages_bytes() - int(LOW_WATER * self.max_bytes)) > 0:
                victims = db.execute(
                    "SELECT 'answers', key, size, used_at FROM answers UNION ALL "
                    f"SELECT 'jobs', key, size, used_at FROM jobs WHERE {evictable_jobs} "
                    "ORDER BY used_at LIMIT ?", (_EVICT_BATCH,)).fetchall()
                if not victims:
                    log.warning("the store holds %d bytes, over OPTIREMAT_STORE_MAX_BYTES, in "
                                "unfinished and just finished jobs only", self._pages_bytes())
                    break
                freed = 0
                for table, key, size, _ in victims:
                    db.execute(f"DELETE FROM {table} WHERE key = ?", (key,))
                    evicted += 1
                    freed += size
                    if freed >= excess:
                        break
            if expired or evicted:
                db.execute("DELETE FROM job_owners WHERE key NOT IN (SELECT key FROM jobs)")
        if expired or evicted:
            with self._lock:
                # executescript steps the vacuum to its end (execute frees one page)
                self._db.executescript(
                    "PRAGMA incremental_vacuum; PRAGMA wal_checkpoint(TRUNCATE);")
            log.info("store: %d entries expired, %d evicted; %d bytes on disk", expired,
                     evicted, self.disk_bytes())
        done = Evicted(expired, evicted)
        if self._on_evict is not None:
            self._on_evict(done)
        return done
