"""What a solve returns: pydantic models shared by the library and the service."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from optiremat.solver.baselines import BaselineResult
from optiremat.solver.errors import OptirematError
from optiremat.solver.offload import OffloadOptions, OffloadReport
from optiremat.solver.step import Memory
from optiremat.solver.validation import INT_BOUND

# What one accelerator moves to the others of its mesh in a collective, in practice
# (NVLink and TPU ICI links run at hundreds of GB/s nominal; ring collectives over
# several hops see about this much bus bandwidth per device): an order of magnitude.
DEFAULT_INTERCONNECT_BANDWIDTH = 100_000_000_000  # bytes/s

# progress(incumbent, bound, elapsed_s), called by a search as it finds plans: the cost in
# recompute FLOPs (with offload, FLOP-equivalents rounded down).
ProgressCallback = Callable[[int, int, float], None]


class SolveStatus(StrEnum):
    OPTIMAL = "optimal"
    FEASIBLE = "feasible"  # a plan within budget, optimality not proven (gap > requested)
    INFEASIBLE = "infeasible"
    TIMED_OUT = "timed_out"  # time limit hit before any plan was found


# The values are the wire format of ``Solution.node_decisions`` (so part of every
# fingerprint and recorded answer), and their order is the schema's enum order.
class Decision(StrEnum):
    """What a plan does with a node's outputs: saves them in device memory, offloads
    them to host memory, or recomputes them in the backward pass."""

    SAVE = "save"  # kept in device memory for the backward pass
    OFFLOAD = "offload"  # kept in host memory, copied back for the backward pass
    RECOMPUTE = "recompute"  # recomputed in the backward pass


class Backend(StrEnum):
    SCIP = "scip"
    CPSAT = "cpsat"


class SolveOptions(BaseModel):
    """Request options; their defaults are part of the request hash."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tie: bool = True  # one decision per policy key (what a stateless policy can express)
    time_limit_s: float = Field(default=60.0, gt=0)
    relative_gap: float = Field(default=0.0, ge=0, le=1)
    # CP-SAT: with repeated layers folded (solver.repeats) tied solves of 1k-10k-node
    # graphs take under a second with either backend (CP-SAT fastest on 7 of 9), and
    # untied, where nothing folds, CP-SAT's plans and bounds are far better: SCIP
    # through pywraplp ends 10 s solves with no bound at all (bench/solver_backends.py).
    backend: Backend = Backend.CPSAT
    # Options added after the first release are left out of the JSON at their
    # defaults: earlier requests keep their hash, earlier readers parse the JSON.
    # The direct formulation: no dominated choices fixed and an untied solve not
    # started from the tied plan; the reference for tests and benchmarks.
    direct: bool = Field(default=False, exclude_if=lambda v: v is False)
    # Evaluate JAX's built-in policies and the greedy knapsack on the graph and
    # report them in ``Solution.baselines``.
    compare_baselines: bool = Field(default=False, exclude_if=lambda v: v is False)
    # Offload as a third choice (``optiremat.solver.offload``): the budget then caps device
    # residual bytes and the objective is estimated seconds.
    # (FastAPI leaves the null default out of the response schema: so does the request's.)
    offload: OffloadOptions | None = Field(
        default=None, exclude_if=lambda v: v is None,
        json_schema_extra=lambda schema: schema.pop("default", None),  # type: ignore[arg-type]
    )
    # What a budget means (``optiremat.solver.peak``): the peak bytes of the training
    # step or the residual bytes of one checkpoint. Unset: peak when the graph
    # carries its step, residuals otherwise.
    memory: Memory | None = Field(
        default=None, exclude_if=lambda v: v is None,
        json_schema_extra=lambda schema: schema.pop("default", None),  # type: ignore[arg-type]
    )
    # Peak budgets: let the plan nest a region's layers in rematerialised groups
    # (``solver.nesting``) when that costs fewer FLOPs than a checkpoint per layer.
    nest: bool = Field(default=True, exclude_if=lambda v: v is True)
    # Graphs of a step on a mesh: the bytes per second one device moves in a collective,
    # which prices what a recomputed node moves (``optiremat.solver.collectives``).
    interconnect_bandwidth: StrictInt = Field(
        default=DEFAULT_INTERCONNECT_BANDWIDTH, gt=0, lt=INT_BOUND,
        exclude_if=lambda v: v == DEFAULT_INTERCONNECT_BANDWIDTH)


class LayerGroup(BaseModel):
    """Consecutive layers of one scan region, or one block of a run of repeated blocks
    (``layers`` 1), that a plan gives saves of their own (``Solution.layer_groups``): the
    region, how many layers, and the policy keys they save."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    region: StrictInt = Field(ge=0)
    layers: StrictInt = Field(ge=1)
    saved_keys: list[str]


class Solution(BaseModel):
    """A plan for one graph and budget.

    Everything but ``solve_seconds`` is a pure function of the request: the same
    graph, budget and options give the same fields, bit for bit, on every host. A
    refined peak plan's record (``client.peak.refine``) is one such answer, solved at a
    shifted budget, with the client's measurement written over it: the budget asked,
    ``working_bytes`` and the ``peak_bytes`` they make. It is the same on every host
    whose XLA measures the same step.
    """

    model_config = ConfigDict(frozen=True)

    graph_hash: str
    budget_bytes: StrictInt
    options: SolveOptions
    status: SolveStatus
    residual_bytes: StrictInt
    recompute_flops: StrictInt  # backward FLOPs beyond those of saving everything
    lower_bound_flops: StrictInt
    gap: float
    saved_keys: list[str]  # policy keys decided "save" (tied plans)
    offloaded_keys: list[str] = Field(default_factory=list)
    # Per graph node, forced modes applied; OFFLOAD only with ``options.offload``.
    # Empty when the solver stopped before a plan.
    node_decisions: list[Decision]
    solver: str
    solver_version: str
    solve_seconds: float = 0.0
    # With ``options.compare_baselines``: each baseline's cost and its distance
    # from this plan (``optiremat.solver.baselines``). Left out of the JSON when unset.
    baselines: list[BaselineResult] | None = Field(default=None, exclude_if=lambda v: v is None)
    # With ``options.offload``: host bytes and estimated seconds. ``residual_bytes``
    # is then device bytes, and ``lower_bound_flops``/``gap`` are on the objective
    # in FLOP-equivalents (recompute FLOPs plus transfers priced in FLOPs).
    offload: OffloadReport | None = Field(default=None, exclude_if=lambda v: v is None)
    # With a peak budget: the predicted peak bytes of the training step
    # (``residual_bytes`` stays every residual, arguments included).
    peak_bytes: StrictInt | None = Field(default=None, exclude_if=lambda v: v is None)
    # Set by the client when it measured the plan's own backward working set (one
    # compile of one layer under the plan's policy, ``client.peak.refine``): what
    # ``peak_bytes`` counts instead of the step's calibrated working set.
    working_bytes: StrictInt | None = Field(default=None, exclude_if=lambda v: v is None)
    # With nested groups: per region of the step, its layers in that many rematerialised
    # groups (1: a checkpoint per layer). ``recompute_flops`` then counts the groups'
    # second forward pass.
    groups: list[StrictInt] | None = Field(default=None, exclude_if=lambda v: v is None)
    # On a graph whose nodes move bytes between devices (``node_collective_bytes``): the
    # bytes per device the plan's recomputation adds on the interconnect. The search
    # minimises recompute FLOPs plus these at ``options.interconnect_bandwidth``, so
    # ``lower_bound_flops`` and ``gap`` are then on that sum (``solver.collectives``).
    collective_bytes: StrictInt | None = Field(default=None, exclude_if=lambda v: v is None)
    # A peak plan whose scan layers are planned apart (``client.peak.mixing``): per group
    # of consecutive layers, in program order, the keys it saves; or whose repeated
    # blocks are (``client.peak.block_mixing``): per block of the run, its keys (every
    # other region takes ``saved_keys``). ``saved_keys`` and ``node_decisions`` are then
    # the plan of the first group, which saves least; ``recompute_flops`` and
    # ``residual_bytes`` count every group's layers.
    layer_groups: list[LayerGroup] | None = Field(default=None, exclude_if=lambda v: v is None)
    # A peak plan whose step without any checkpoint fits the budget as measured
    # (``client.peak.planner``): applied, the function is left as it is. Every node is then
    # saved and ``peak_bytes`` is that step's measured peak.
    no_checkpoint: bool | None = Field(default=None, exclude_if=lambda v: v is None)

    @property
    def planned(self) -> bool:
        """Whether the answer carries a plan (a solve stopped before one, by its time
        limit or a cancel, answers none: no ``node_decisions``)."""
        return bool(self.node_decisions)

    @property
    def host_bytes(self) -> int:
        """Residual bytes offloaded to host memory (0 without offload)."""
        return self.offload.host_bytes if self.offload is not None else 0

    def kept(self) -> list[bool]:
        """Per node, whether its outputs are kept for the backward pass (saved or
        offloaded, i.e. not recomputed): the flags ``semantics.evaluate`` prices."""
        return [d != Decision.RECOMPUTE for d in self.node_decisions]

    def saved(self) -> list[bool]:
        """Per node, whether its outputs are saved in device memory (offloaded: no)."""
        return [d == Decision.SAVE for d in self.node_decisions]

    def offloaded(self) -> list[bool]:
        """Per node, whether its outputs are offloaded to host memory."""
        return [d == Decision.OFFLOAD for d in self.node_decisions]

    def recomputed(self) -> list[bool]:
        """Per node, whether its outputs are recomputed in the backward pass."""
        return [d == Decision.RECOMPUTE for d in self.node_decisions]

    def fingerprint(self) -> str:
        """sha256 over every deterministic field (all but ``solve_seconds``)."""
        data = self.model_dump(mode="json", exclude={"solve_seconds"})
        return hashlib.sha256(
            json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest()


class InfeasibleBudgetError(OptirematError, ValueError):
    """No plan fits the budget; ``min_budget_bytes`` is the smallest one that does."""

    def __init__(self, budget_bytes: int, min_budget_bytes: int, why: str = "") -> None:
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes
        self.why = why  # what keeps plans from going lower, and what would help
        super().__init__(
            f"budget of {budget_bytes} bytes is infeasible: the smallest feasible budget "
            f"for this graph is {min_budget_bytes} bytes" + (f". {why}" if why else "")
        )

    def __reduce__(self) -> tuple[Any, ...]:  # pickled with its reason (the service's workers)
        return type(self), (self.budget_bytes, self.min_budget_bytes, self.why)
