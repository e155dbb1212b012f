"""The training step a graph plans for: what it holds whatever the plan, and its regions.

Travels with the cost graph (``CostGraph.step``) so that a server plans peak
budgets exactly as the client would; ``optiremat.solver.peak`` defines what a
peak budget means with it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from optiremat.solver.validation import BoundedInt as NonNegInt
from optiremat.solver.validation import check_step


class Memory(StrEnum):
    PEAK = "peak"  # peak bytes of the training step
    RESIDUALS = "residuals"  # residual bytes of one jax.checkpoint around the function


class RegionKind(StrEnum):
    """What code a region checkpoints (``client.peak.regions`` defines each kind)."""

    SCAN = "scan"  # the body of a differentiated lax.scan, once per iteration (a layer)
    BLOCK = "block"  # a block of straight-line code, checkpointed once


class RegionFound(StrEnum):
    """How a region was found in the traced function."""

    SCAN = "scan"  # a differentiated lax.scan
    CHECKPOINT = "checkpoint"  # a jax.checkpoint the user wrote (nn.remat, eqx, ...)
    REPEATED = "repeated"  # a run of equations repeated in straight-line code (unrolled layers)
    SCOPE = "scope"  # the equations under a name scope the user named


REGION_NAMES = {
    RegionFound.SCAN: "lax.scan",
    RegionFound.CHECKPOINT: "your checkpoint",
    RegionFound.REPEATED: "repeated block",
    RegionFound.SCOPE: "named scope",
}


class RegionMemory(BaseModel):
    """One remat region of the step: a ``lax.scan`` whose body is checkpointed per
    iteration, or a block of straight-line code checkpointed once (``kind``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: StrictStr  # where the region is in the user's code
    length: Annotated[StrictInt, Field(ge=1, lt=2**31)]  # layers: iterations (1 for a block)
    working_bytes: NonNegInt  # one layer's backward working set, measured
    # What nesting the layers in groups (``solver.nesting``) trades: one layer's input
    # (the scan's carry; a block's inputs), and one layer's slice of the stacked operands
    # and of their gradients, which the outer scan copies per group. Only a scan running
    # forward nests.
    carry_bytes: NonNegInt = 0
    slice_bytes: NonNegInt = 0
    nestable: bool = False
    # Left out of the JSON for a scan, so that a graph with scans alone keeps its hash.
    kind: RegionKind = Field(default=RegionKind.SCAN, exclude_if=lambda v: v == RegionKind.SCAN)
    found: RegionFound = Field(default=RegionFound.SCAN,
                               exclude_if=lambda v: v == RegionFound.SCAN)

    def describe(self) -> str:
        """What and where it is: "lax.scan at model.py:12", "repeated block at ..."."""
        return f"{REGION_NAMES[self.found]} at {self.source}"

    @model_validator(mode="after")
    def _kind_and_how_found_agree(self) -> RegionMemory:
        if (self.kind == RegionKind.SCAN) != (self.found == RegionFound.SCAN):
            raise ValueError(f"a {self.kind.value} region cannot be found as "
                             f"{self.found.value!r}: scans are found as 'scan', blocks not")
        if self.kind == RegionKind.BLOCK and (self.length != 1 or self.nestable):
            raise ValueError("a block region runs once (length 1) and does not nest")
        return self


class StepMemory(BaseModel):
    """What the training step holds whatever the plan, and its regions."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    argument_bytes: NonNegInt
    output_bytes: NonNegInt
    alias_bytes: NonNegInt = 0
    regions: list[RegionMemory] = Field(default_factory=list)
    # What the phases outside every region hold beyond the residuals live there (the
    # LM head's logits, softmax and their cotangents, the forward pass's last buffers),
    # measured with one compile of the step (``optiremat.client.peak.calibration``). None (a
    # graph from before phases were priced): every residual counts against every region's
    # backward pass, as it did then (``optiremat.solver.peak.step_phases``).
    outside_working_bytes: NonNegInt | None = Field(default=None,
                                                   exclude_if=lambda v: v is None)

    @model_validator(mode="after")
    def _aliases_within_held(self) -> StepMemory:
        check_step(self)
        return self

    @property
    def held_bytes(self) -> int:
        """Arguments + outputs - aliases: held for the whole step."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes

    @property
    def has_blocks(self) -> bool:
        """Whether a region is not a scan: such a graph is schema version 4."""
        return any(r.kind != RegionKind.SCAN for r in self.regions)

    @property
    def working_bytes(self) -> int:
        """The largest transient working set: the backward pass runs one region at a time."""
        return max((r.working_bytes for r in self.regions), default=0)
