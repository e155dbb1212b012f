"""How a run ends, and its one codec.

Worker processes return these, the SQLite store and Redis keep them (``encode`` /
``decode``), and the routes turn them into answers or problems. They are frozen
pydantic models, so the same objects cross a process pipe (pickle) and a store
(JSON, tagged by ``type``).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, TypeGuard

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from optiremat.solver.solution import SolveStatus
from optiremat.solver.step import Memory


class _Outcome(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Solved(_Outcome):
    """A plan. ``solution_json`` is ``Solution.model_dump_json()``, served byte for byte."""

    type: Literal["solved"] = "solved"
    solution_json: str


class Infeasible(_Outcome):
    """No plan fits ``budget_bytes``; ``min_budget_bytes`` is the smallest budget that does.
    ``memory`` is what the budget counts (None in a record stored before it was kept)."""

    type: Literal["infeasible"] = "infeasible"
    budget_bytes: int
    min_budget_bytes: int
    memory: Memory | None = None


class BudgetRange(_Outcome):
    """The ends of a frontier's budgets: the smallest feasible and the largest useful one."""

    type: Literal["budget_range"] = "budget_range"
    min_feasible_budget: int
    max_useful_budget: int


class Failed(_Outcome):
    """The run did not finish; ``message`` says why."""

    type: Literal["failed"] = "failed"
    message: str
    # The request is what is wrong (the solver's integers cannot hold it): a 422, not a 500.
    invalid: bool = Field(default=False, exclude_if=lambda v: v is False)


Answer = Solved | Infeasible | BudgetRange
"""What a request hash is cached as: the same request always gets it again."""
TaskResult = Annotated[Answer | Failed, Field(discriminator="type")]
"""What running a task returns (``tasks.run_task``)."""


class Cancelled(_Outcome):
    """The run was cancelled; ``partial`` is what the solver returned after the cancel."""

    type: Literal["cancelled"] = "cancelled"
    partial: TaskResult | None = None


class Interrupted(_Outcome):
    """This process stopped before the run finished; the run is not recorded."""

    type: Literal["interrupted"] = "interrupted"


Outcome = Annotated[Solved | Infeasible | BudgetRange | Failed | Cancelled | Interrupted,
                    Field(discriminator="type")]

_CODEC: TypeAdapter[Outcome] = TypeAdapter(Outcome)


def encode(outcome: Outcome) -> str:
    return _CODEC.dump_json(outcome).decode()


def decode(text: str | bytes) -> Outcome:
    return _CODEC.validate_json(text)


def is_answer(outcome: Outcome | None) -> TypeGuard[Answer]:
    return isinstance(outcome, Solved | Infeasible | BudgetRange)


def settled(outcome: Outcome) -> Outcome:
    """A cancel that landed after the solver proved optimality changes nothing: the
    proven plan is the request's answer, cached like any other."""
    if (isinstance(outcome, Cancelled) and isinstance(outcome.partial, Solved)
            and json.loads(outcome.partial.solution_json)["status"] == SolveStatus.OPTIMAL):
        return outcome.partial
    return outcome


def reusable(outcome: Outcome | None) -> bool:
    """A run still going, or one that answered with a plan or a range: joined, never
    started again. A failed, cancelled or infeasible one is started again by the next
    submission (an infeasible budget is then answered from the cache)."""
    return outcome is None or isinstance(outcome, Solved | BudgetRange)
