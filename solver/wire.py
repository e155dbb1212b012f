"""The service's resources as data: the models the client and the service both read.

Defined once, here in the JAX-free solver package, so that what the service
sends and what ``RematClient`` parses cannot drift: problem details, jobs and
their progress, pages of jobs, frontiers. Readers ignore members they do not
know (a newer server may add some).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from optiremat.solver.solution import Solution, SolveOptions, SolveStatus
from optiremat.solver.step import Memory

# Points of a frontier when neither budgets nor a count is given.
DEFAULT_FRONTIER_POINTS = 12


@dataclass(frozen=True)
class ProblemType:
    """A problem type the service defines: the problems' ``type`` (a URI) and the
    ``title`` they carry (RFC 9457: the same for every problem of the type);
    docs/service.md explains each."""

    uri: str
    title: str


INFEASIBLE_BUDGET = ProblemType("urn:optiremat:problem:infeasible-budget", "Infeasible budget")
# A request refused before it reaches a route may name what is wrong with it in the title
# instead ("Malformed JSON", "Malformed gzip", "Body too large").
INVALID_REQUEST = ProblemType("urn:optiremat:problem:invalid-request", "Invalid request")
GRAPH_TOO_LARGE = ProblemType("urn:optiremat:problem:graph-too-large", "Graph too large")
SOLVE_CANCELLED = ProblemType("urn:optiremat:problem:solve-cancelled", "Solve cancelled")
SOLVE_FAILED = ProblemType("urn:optiremat:problem:solve-failed", "Solve failed")
RATE_LIMITED = ProblemType("urn:optiremat:problem:rate-limited", "Too many requests")
QUEUE_FULL = ProblemType("urn:optiremat:problem:queue-full", "Queue full")
STORE_UNAVAILABLE = ProblemType("urn:optiremat:problem:store-unavailable", "Store unavailable")


class ValidationIssue(BaseModel):
    model_config = ConfigDict(extra="ignore")

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
    def infeasible(cls, budget_bytes: int, min_budget_bytes: int,
                   memory: Memory | None) -> Problem:
        """No plan fits; ``memory`` is what the budget counts (None: not recorded)."""
        fits = {Memory.RESIDUALS: "keeps residuals within",
                Memory.PEAK: "keeps the training step's predicted peak within",
                None: "fits a budget of"}[memory]
        return cls(
            type=INFEASIBLE_BUDGET.uri, title=INFEASIBLE_BUDGET.title, status=422,
            detail=f"no plan {fits} {budget_bytes} bytes; the smallest feasible budget for "
                   f"this graph is {min_budget_bytes} bytes",
            min_budget_bytes=min_budget_bytes,
        )

    @classmethod
    def solve_failed(cls, message: str) -> Problem:
        return cls(type=SOLVE_FAILED.uri, title=SOLVE_FAILED.title, status=500, detail=message)

    @classmethod
    def failed(cls, message: str, invalid: bool) -> Problem:
        """A run that failed: the request's fault (422) when ``invalid``, else the
        solver's (500)."""
        if invalid:
            return cls(type=INVALID_REQUEST.uri, title=INVALID_REQUEST.title, status=422,
                       detail=message)
        return cls.solve_failed(message)


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


class Progress(BaseModel):
    """The solver's latest report: best plan found so far and the proven bound."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    incumbent_flops: int | None = None
    bound_flops: int | None = None
    elapsed_s: float = 0.0


class JobSummary(BaseModel):
    """A job as ``GET /v1/jobs`` lists it: ``GET /v1/jobs/{id}`` has its solution or error."""

    model_config = ConfigDict(extra="ignore")

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

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def incumbent_flops(self) -> int | None:
        """The best plan's recompute FLOPs so far (the answer's, once there is one)."""
        if self.solution is not None:
            return self.solution.recompute_flops
        return None if self.progress is None else self.progress.incumbent_flops

    @property
    def bound_flops(self) -> int | None:
        if self.solution is not None:
            return self.solution.lower_bound_flops
        return None if self.progress is None else self.progress.bound_flops


class JobPage(BaseModel):
    """Jobs newest first. A page may hold fewer than ``limit`` jobs and still have a next
    one: follow ``next_cursor`` until it is null."""

    jobs: list[JobSummary]
    next_cursor: str | None = Field(
        default=None, description="Pass as ``cursor`` for the next page; null on the last.")


class FrontierPoint(BaseModel):
    model_config = ConfigDict(extra="ignore")

    budget_bytes: int
    status: SolveStatus
    residual_bytes: int | None = None
    peak_bytes: int | None = Field(
        default=None, description="The predicted peak of the training step (a step's graph)."
    )
    recompute_flops: int | None = None
    pareto: bool = Field(
        default=False,
        description="No other point has both fewer bytes and fewer FLOPs (with offload "
                    "options: fewer estimated seconds).",
    )
    min_budget_bytes: int | None = Field(
        default=None, description="For an infeasible budget: the smallest feasible one."
    )
    # With offload options the plan may use any of the three levers (recomputation
    # per layer, nested groups, offload); these say which, and what it costs in time.
    estimated_seconds: float | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="With offload options: the seconds the plan adds to the step.")
    host_bytes: int | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="With offload options: residual bytes offloaded to host memory.")
    groups: list[int] | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="Per region of the step, its layers in that many rematerialised groups.")
    layer_groups: list[int] | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="Where the scan's layers are planned apart (a sweep with the function "
                    "at hand): the layers of each group, in program order.")

    @property
    def memory_bytes(self) -> int | None:
        """What the budget counts: the predicted peak, or the residual bytes."""
        return self.peak_bytes if self.peak_bytes is not None else self.residual_bytes

    @property
    def lever(self) -> str:
        """How the plan lowers its peak: "offload", "nested groups" or "recompute per layer"."""
        if self.host_bytes:
            return "offload"
        if self.groups and any(k != 1 for k in self.groups):
            return "nested groups"
        return "recompute per layer"


class Frontier(BaseModel):
    model_config = ConfigDict(extra="ignore")

    graph_hash: str
    options: SolveOptions
    min_feasible_budget: int | None = Field(default=None, description="Set when count was given.")
    max_useful_budget: int | None = Field(default=None, description="Set when count was given.")
    points: list[FrontierPoint]
    step_seconds: float | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="With offload options: the estimated seconds of the step without "
                    "remat, to which each point's estimated_seconds add.")

    @property
    def plans(self) -> list[FrontierPoint]:
        """Points with a plan, by the bytes their budget counts."""
        return sorted((p for p in self.points if p.memory_bytes is not None),
                      key=lambda p: (p.memory_bytes or 0, p.recompute_flops or 0))
