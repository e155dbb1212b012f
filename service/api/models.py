"""Request bodies of the REST API, what a route keeps of them once validated, and its
health answer. Graph and solution models come from solver/; the resources the run
layer returns (jobs, frontiers) from ``optiremat.service.core.models``.

A route never holds a parsed graph: ``parse_body`` validates a body and hands the
route its ``valid()`` form, where the graph is a ``GraphText`` (why: that module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from optiremat.service.core.graph_text import GraphText
from optiremat.solver.frontier import own_step_seconds
from optiremat.solver.graph import CostGraph, GraphBuilder
from optiremat.solver.peak import resolve_memory
from optiremat.solver.solution import SolveOptions
from optiremat.solver.validation import BoundedInt as NonNegInt

MAX_FRONTIER_POINTS = 64


def _example_graph() -> dict[str, Any]:
    """x -> sin -> tanh, as extraction would write it: the example in openapi.json."""
    b = GraphBuilder("example")
    x = b.input(4096, (1024,), "float32")
    y = b.value(4096, (1024,), "float32")
    z = b.value(4096, (1024,), "float32")
    b.node("sin", [x], [y], key="sin(float32[1024])", flops=1024, source="model.py:3")
    b.node("tanh", [y], [z], key="tanh(float32[1024])", flops=1024, source="model.py:4")
    b.backward_reads += [x, z]  # sin's derivative reads x; tanh's reads its output
    return b.build().model_dump(mode="json")


_EXAMPLE_GRAPH = _example_graph()


@dataclass(frozen=True, slots=True)
class ValidSolve:
    """A validated ``SolveRequest``."""

    graph: GraphText
    budget_bytes: int
    options: SolveOptions


@dataclass(frozen=True, slots=True)
class ValidFrontier:
    """A validated ``FrontierRequest``, with the graph's ``own_step_seconds``."""

    graph: GraphText
    budgets: list[int] | None
    count: int | None
    options: SolveOptions
    step_seconds: float | None


class SolveRequest(BaseModel):
    """One graph, one budget: the body of ``POST /v1/solve`` and ``POST /v1/jobs``."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"graph": _EXAMPLE_GRAPH, "budget_bytes": 8192, "options": {"time_limit_s": 5}},
    ]})

    graph: CostGraph
    budget_bytes: NonNegInt = Field(
        description="Budget in bytes: the peak of the training step for a graph that carries "
                    "its step, else residual bytes (options.memory chooses).")
    options: SolveOptions = Field(default_factory=SolveOptions)

    @model_validator(mode="after")
    def _memory_fits_the_graph(self) -> SolveRequest:
        resolve_memory(self.graph, self.options.memory)  # a clear 422 before any solve
        return self

    def valid(self) -> ValidSolve:
        return ValidSolve(GraphText.of(self.graph), self.budget_bytes, self.options)


class FrontierRequest(BaseModel):
    """A frontier's budgets: explicit ``budgets``, or ``count`` evenly spaced feasible ones."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"graph": _EXAMPLE_GRAPH, "count": 3},
        {"graph": _EXAMPLE_GRAPH, "budgets": [4096, 8192, 12288]},
    ]})

    graph: CostGraph
    budgets: list[NonNegInt] | None = Field(
        default=None, min_length=1, max_length=MAX_FRONTIER_POINTS
    )
    count: int | None = Field(
        default=None, ge=2, le=MAX_FRONTIER_POINTS,
        description="Budgets evenly spaced from the smallest feasible to the largest useful.",
    )
    options: SolveOptions = Field(default_factory=SolveOptions)

    @model_validator(mode="after")
    def _budgets_or_count(self) -> FrontierRequest:
        resolve_memory(self.graph, self.options.memory)
        if (self.budgets is None) == (self.count is None):
            raise ValueError("give exactly one of 'budgets' (a list) or 'count' (an integer)")
        return self

    def valid(self) -> ValidFrontier:
        return ValidFrontier(GraphText.of(self.graph), self.budgets, self.count, self.options,
                             own_step_seconds(self.graph, self.options))


class Health(BaseModel):
    status: Literal["ok"] = "ok"
