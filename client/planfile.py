"""PLAN.json: a solved plan as a file, the graph and its solution together.

The file stands alone: ``optiremat explain`` reads it without the model, and
``load_plan(path).policy()`` rebuilds the checkpoint policy. Its
``key_aliases`` expand a cond's representative key to every key inside its
branches (a plan written from ``optiremat.optimize`` has them; one solved from a
bare graph file has none, and its policy then saves no equation inside a
cond's branches).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from optiremat.solver.graph import CostGraph
from optiremat.solver.semantics import Evaluation, evaluate
from optiremat.solver.solution import Solution

if TYPE_CHECKING:
    from optiremat.client.plan import Plan
    from optiremat.client.policy import KeyPolicy


class PlanFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["optiremat-plan"] = "optiremat-plan"
    version: Literal[1] = 1
    graph: CostGraph
    solution: Solution
    key_aliases: dict[str, list[str]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _solution_of_this_graph(self) -> PlanFile:
        if self.solution.graph_hash != self.graph.content_hash:
            raise ValueError(
                f"the solution is for graph {self.solution.graph_hash[:12]}, not for the "
                f"graph in this file ({self.graph.content_hash[:12]})")
        return self

    @classmethod
    def of(cls, plan: Plan) -> PlanFile:
        aliases = {k: sorted(v) for k, v in plan.key_aliases.items()}
        return cls(graph=plan.graph, solution=plan.solution, key_aliases=aliases)

    @property
    def saved_keys(self) -> frozenset[str]:
        keys: set[str] = set()
        for key in self.solution.saved_keys:
            keys |= set(self.key_aliases.get(key, [key]))
        return frozenset(keys)

    @property
    def offloaded_keys(self) -> frozenset[str]:
        keys: set[str] = set()
        for key in self.solution.offloaded_keys:
            keys |= set(self.key_aliases.get(key, [key]))
        return frozenset(keys)

    def evaluation(self) -> Evaluation:
        """The plan replayed on its graph: residuals and the equations recomputed."""
        # An offloaded node is saved (its residual lives in host memory).
        return evaluate(self.graph, [d != "recompute" for d in self.solution.node_decisions])

    def policy(self) -> KeyPolicy:
        """The policy for ``jax.checkpoint`` (tied plans only)."""
        from optiremat.client.policy import KeyPolicy

        if not self.solution.options.tie:
            raise ValueError("an untied plan has no stateless policy: re-run optimize() "
                             "for its names form")
        return KeyPolicy(self.saved_keys, self.offloaded_keys)

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.model_dump_json(indent=None) + "\n")
        return path


def load_plan(path: str | Path) -> PlanFile:
    return PlanFile.model_validate_json(Path(path).read_bytes())
