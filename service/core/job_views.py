"""A job as a client sees it: its summary and view (what a withdrawn submission
shows), and the cursors of a listing's pages."""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from datetime import UTC, datetime

from optiremat.service.core.outcome import Cancelled, Failed, Infeasible, Outcome, Solved
from optiremat.service.core.runs import JobRecord, Position, job_status, shows_run
from optiremat.solver.solution import Solution
from optiremat.solver.wire import Job, JobStatus, JobSummary, Problem


def job_summary(record: JobRecord, status: JobStatus) -> JobSummary:
    task = record.task
    return JobSummary(
        id=record.key, status=status, graph_hash=task.graph_hash,
        budget_bytes=task.budget_bytes, options=task.options,
        created_at=datetime.fromtimestamp(record.created_at, UTC),
        updated_at=datetime.fromtimestamp(record.updated_at, UTC),
        progress=record.progress,
    )


def job_view(record: JobRecord, outcome: Outcome | None, running: bool = False) -> Job:
    """The API's Job: ``outcome`` is the record's, or the live run's once it ended. A
    submission withdrawn shows nothing of a run that went on without it."""
    status = job_status(outcome, running, record.withdrawn)
    solution = error = None
    if not shows_run(record.withdrawn, outcome):
        record, outcome = replace(record, progress=None), None
    if outcome is not None:
        if isinstance(outcome, Cancelled):
            solution = outcome.partial if isinstance(outcome.partial, Solved) else None
        elif isinstance(outcome, Solved):
            solution = outcome
        elif isinstance(outcome, Infeasible):
            error = Problem.infeasible(outcome.budget_bytes, outcome.min_budget_bytes,
                                       outcome.memory)
        else:
            error = (Problem.failed(outcome.message, outcome.invalid)
                     if isinstance(outcome, Failed) else Problem.solve_failed(repr(outcome)))
    return Job(
        **job_summary(record, status).model_dump(),
        solution=None if solution is None else Solution.model_validate_json(solution.solution_json),
        error=error,
    )


def encode_cursor(position: Position) -> str:
    return base64.urlsafe_b64encode(json.dumps(position).encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> Position:
    try:
        created_at, key = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        return float(created_at), str(key)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{cursor!r} is not a cursor this server handed out") from exc
