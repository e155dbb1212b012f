"""The resources the run layer keeps and returns: jobs, frontiers, readiness, problems.

Plain pydantic, no FastAPI: the run layer builds them, the HTTP layer sends them
(and publishes their schemas in ``openapi.json``). Request bodies are the HTTP
layer's (``optiremat.service.api.models``).
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from optiremat.solver.solution import Solution, SolveOptions, SolveStatus

# Problem types the service defines; docs/service.md explains each.
INFEASIBLE_BUDGET = "urn:optiremat:problem:infeasible-budget"
INVALID_REQUEST = "urn:optiremat:problem:invalid-request"
GRAPH_TOO_LARGE = "urn:optiremat:problem:graph-too-large"
SOLVE_CANCELLED = "urn:optiremat:problem:solve-cancelled"
SOLVE_FAILED = "urn:optiremat:problem:solve-failed"
RATE_LIMITED = "urn:optiremat:problem:rate-limited"
QUEUE_FULL = "urn:optiremat:problem:queue-full"
STORE_UNAVAILABLE = "urn:optiremat:problem:store-unavailable"


class ValidationIssue(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class Problem(BaseModel):
    """A problem detail; extension members carry what a client needs to fix the request."""

    model_config = ConfigDict(extra="allow")

    type: str = "about:blank"
    title: str
    status: int
    detail: str
    instance: str | None = None
    request_id: str | None = None
    min_budget_bytes: int | None = Field(
        default=None, description="For an infeasible budget: the smallest feasible one."
    )
    errors: list[ValidationIssue] | None = None

    @classmethod
    def infeasible(cls, budget_bytes: int, min_budget_bytes: int) -> Problem:
        return cls(
            type=INFEASIBLE_BUDGET, title="Infeasible budget", status=422,
            detail=f"no plan keeps residuals within {budget_bytes} bytes; the smallest "
                   f"feasible budget for this graph is {min_budget_bytes} bytes",
            min_budget_bytes=min_budget_bytes,
        )

    @classmethod
    def solve_failed(cls, message: str) -> Problem:
        return cls(type=SOLVE_FAILED, title="Solve failed", status=500, detail=message)


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Progress(BaseModel):
    """The solver's latest report: best plan found so far and the proven bound."""

    model_config = ConfigDict(frozen=True)

    incumbent_flops: int | None = None
    bound_flops: int | None = None
    elapsed_s: float = 0.0


class JobSummary(BaseModel):
    """A job as ``GET /v1/jobs`` lists it: ``GET /v1/jobs/{id}`` has its solution or error."""

    id: str
    status: JobStatus
    graph_hash: str
    budget_bytes: int
    options: SolveOptions
    created_at: datetime
    updated_at: datetime
    progress: Progress | None = None


class Job(JobSummary):
    """A background solve. ``id`` is the request hash, so resubmitting finds the same job."""

    solution: Solution | None = Field(
        default=None,
        description="When succeeded; when cancelled, the best plan found before the cancel.",
    )
    error: Problem | None = Field(default=None, description="When failed: what went wrong.")


class JobPage(BaseModel):
    """Jobs newest first. A page may hold fewer than ``limit`` jobs and still have a next
    one: follow ``next_cursor`` until it is null."""

    jobs: list[JobSummary]
    next_cursor: str | None = Field(
        default=None, description="Pass as ``cursor`` for the next page; null on the last.")


class FrontierPoint(BaseModel):
    budget_bytes: int
    status: SolveStatus
    residual_bytes: int | None = None
    peak_bytes: int | None = Field(
        default=None, description="The predicted peak of the training step (a step's graph)."
    )
    recompute_flops: int | None = None
    pareto: bool = Field(
        default=False, description="No other point has both fewer bytes and fewer FLOPs."
    )
    min_budget_bytes: int | None = Field(
        default=None, description="For an infeasible budget: the smallest feasible one."
    )


class Frontier(BaseModel):
    graph_hash: str
    options: SolveOptions
    min_feasible_budget: int | None = Field(default=None, description="Set when count was given.")
    max_useful_budget: int | None = Field(default=None, description="Set when count was given.")
    points: list[FrontierPoint]


class Readiness(BaseModel):
    status: Literal["ready"] = "ready"
    workers: int
    queue_depth: int
