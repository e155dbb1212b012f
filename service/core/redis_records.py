"""A cluster run's record in Redis: its key and its fields as a ``RunRecord``.

The record is a hash at ``{PREFIX}:run:{key}`` (``redis_store`` lists every key of
the layout); ``redis_store`` writes it, ``redis_jobs`` reads it for listings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from optiremat.service.core.outcome import Outcome, decode
from optiremat.service.core.runs import JobRecord
from optiremat.service.core.tasks import TASKS, SolveTask, Task
from optiremat.solver.wire import Progress

# 2: one outcome codec for both stores, runs keyed by their task (1 had its own codec)
PREFIX = "optiremat:v2"


def run_key(key: str) -> str:
    return f"{PREFIX}:run:{key}"


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class RunRecord:
    key: str
    task: Task
    job: bool
    generation: str
    created_at: float
    updated_at: float
    progress: Progress | None
    outcome: Outcome | None
    started: bool = False  # a worker took it (it may since have died and been requeued)

    def as_job(self) -> JobRecord:
        assert isinstance(self.task, SolveTask)
        return JobRecord(self.key, self.task, self.created_at, self.updated_at, self.outcome,
                         self.progress, self.started)


def run_record(key: str, raw: Mapping[Any, Any]) -> RunRecord | None:
    """The run from its hash's fields (``HGETALL``); None when there is no run."""
    fields = {text(k): text(v) for k, v in raw.items()}
    if "generation" not in fields:
        return None  # no run, or a stray write to an expired one
    progress = fields.get("progress")
    outcome = fields.get("outcome")
    return RunRecord(
        key=key,
        task=TASKS.validate_json(fields["task"]),
        job=fields.get("job") == "1",
        generation=fields["generation"],
        created_at=float(fields["created_at"]),
        updated_at=float(fields["updated_at"]),
        progress=Progress.model_validate_json(progress) if progress else None,
        outcome=None if outcome is None else decode(outcome),
        started="started_at" in fields,
    )
