"""PLAN.json: a solved plan as a file, the graph and its solution together.

The file stands alone: ``optiremat explain`` reads it without the model, and
``load_plan(path).policy()`` rebuilds the checkpoint policy. Its
``key_aliases`` expand a cond's representative key to every key inside its
branches (a plan written from ``optiremat.optimize`` has them; one solved from a
bare graph file has none, and its policy then saves no equation inside a
cond's branches).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from optiremat.solver.errors import OptirematError
from optiremat.solver.graph import CostGraph
from optiremat.solver.semantics import Evaluation, evaluate
from optiremat.solver.solution import Decision, Solution
from optiremat.solver.validation_message import validation_message

if TYPE_CHECKING:
    from optiremat.client.plan import Plan
    from optiremat.client.policy import KeyPolicy


class PlanFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["optiremat-plan"] = "optiremat-plan"
    # Version 2 carries ``checkpoint_names``; a plan without them is written as version 1.
    version: Literal[1, 2] = 1
    graph: CostGraph
    solution: Solution
    key_aliases: dict[str, list[str]] = Field(default_factory=dict)
    # Policy key -> the ``checkpoint_name`` it binds: what ``optiremat export`` writes a
    # framework's config from (``client.frameworks``).
    checkpoint_names: dict[str, str] = Field(default_factory=dict,
                                             exclude_if=lambda v: not v)

    @model_validator(mode="after")
    def _solution_of_this_graph(self) -> PlanFile:
        if self.checkpoint_names and self.version < 2:
            raise ValueError("checkpoint_names came with version 1: a plan file with names "
                             "is version 2")
        if self.solution.graph_hash != self.graph.content_hash:
            raise ValueError(
                f"the solution is for graph {self.solution.graph_hash[:12]}, not for the "
                f"graph in this file ({self.graph.content_hash[:12]})")
        decisions = self.solution.node_decisions
        # Empty when the solver stopped before any plan; else one decision per node.
        if decisions and len(decisions) != self.graph.num_nodes:
            raise ValueError(
                f"solution.node_decisions has {len(decisions)} entries but the graph has "
                f"{self.graph.num_nodes} nodes: one decision per node")
        if Decision.OFFLOAD in decisions and self.solution.options.offload is None:
            raise ValueError("solution.node_decisions offloads a node, but the solution's "
                             "options have no offload")
        return self

    @classmethod
    def of(cls, plan: Plan) -> PlanFile:
        aliases = {k: sorted(v) for k, v in plan.key_aliases.items()}
        names = dict(plan.checkpoint_names)
        return cls(version=2 if names else 1, graph=plan.graph, solution=plan.solution,
                   key_aliases=aliases, checkpoint_names=names)

    def names_decided(self, framework: str) -> dict[str, str]:
        """Per ``checkpoint_name``, where the plan keeps it, as ``framework`` writes it
        (``client.frameworks.names_decided``; ``ExportError`` where it cannot)."""
        from optiremat.client.frameworks import ExportError, framework_named, names_decided

        if not self.checkpoint_names:
            raise ExportError("the plan file names no checkpoint_name (written by optiremat "
                              "solve, or before version 2): write it from optimize(..., "
                              f"saveable={framework!r}) with PlanFile.of(plan).write(path)")
        return names_decided(self.graph, self.solution, self.key_aliases,
                             self.checkpoint_names, framework_named(framework))

    @property
    def saved_keys(self) -> frozenset[str]:
        return self._expanded(self.solution.saved_keys)

    @property
    def offloaded_keys(self) -> frozenset[str]:
        return self._expanded(self.solution.offloaded_keys)

    def _expanded(self, keys: list[str]) -> frozenset[str]:
        """``keys``, each a graph key standing for several expanded to all of them."""
        return frozenset(k for key in keys for k in self.key_aliases.get(key, [key]))

    def evaluation(self) -> Evaluation:
        """The plan replayed on its graph: residuals and the equations recomputed."""
        # An offloaded node is saved (its residual lives in host memory).
        return evaluate(self.graph, self.solution.kept())

    def policy(self) -> KeyPolicy:
        """The policy for ``jax.checkpoint`` (tied plans only). A plan whose scan layers
        are planned apart (``solution.layer_groups``) gives its first group's here, the
        one that saves least; ``layer_policies`` gives each group's."""
        from optiremat.client.policy import KeyPolicy, warn_under_remat3

        warn_under_remat3()
        if not self.solution.options.tie:
            raise ValueError("an untied plan has no stateless policy: re-run optimize() "
                             "for its names form")
        return KeyPolicy(self.saved_keys, self.offloaded_keys)

    def layer_policies(self) -> list[tuple[int, KeyPolicy]]:
        """Per group of a scan's layers planned apart, in program order: (layers, the
        policy of ``jax.checkpoint`` around each of them); for repeated blocks planned
        apart, (1, the policy of its checkpoint) per block of the run, in program order.
        Empty for one policy per stack."""
        from optiremat.client.policy import KeyPolicy

        return [(group.layers, KeyPolicy(self._expanded(group.saved_keys)))
                for group in self.solution.layer_groups or []]

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.model_dump_json(indent=None) + "\n")
        return path


class PlanFileError(OptirematError, ValueError):
    """A file that is not a plan optiremat can use; the message names the file and field."""


def load_plan(path: str | Path) -> PlanFile:
    """The plan in ``path``, checked: its solution is for its graph, a decision per node."""
    data = Path(path).read_bytes()
    try:
        return PlanFile.model_validate_json(data)
    except ValidationError as exc:
        if _is_graph(data):
            raise PlanFileError(f"{path} is a cost graph, not a plan: solve it first "
                                "(optiremat solve GRAPH.json --budget SIZE)") from None
        raise PlanFileError(f"{path} is not a valid plan file: {validation_message(exc)}"
                            ) from None


def _is_graph(data: bytes) -> bool:
    try:
        top = json.loads(data)
    except ValueError:
        return False
    return isinstance(top, dict) and "schema_version" in top and "format" not in top
