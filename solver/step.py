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


class RegionMemory(BaseModel):
    """One remat region of the step: a ``lax.scan`` whose body is checkpointed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: StrictStr  # where the scan is in the user's code
    length: Annotated[StrictInt, Field(ge=1, lt=2**31)]  # layers: iterations of the scan
    working_bytes: NonNegInt  # one layer's backward working set, measured
    # What nesting the layers in groups (``solver.nesting``) trades: one layer's input
    # (the scan's carry), and one layer's slice of the stacked operands and of their
    # gradients, which the outer scan copies per group. A scan in reverse cannot nest.
    carry_bytes: NonNegInt = 0
    slice_bytes: NonNegInt = 0
    nestable: bool = False


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
    def working_bytes(self) -> int:
        """The largest transient working set: the backward pass runs one region at a time."""
        return max((r.working_bytes for r in self.regions), default=0)
