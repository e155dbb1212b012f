"""Offload as a third choice: the request options, how a transfer is priced, and
how a plan's residuals split between device and host memory.

JAX 0.10 turns ``Offloadable(src="device", dst="pinned_host")`` into one
``device_put`` to host memory in the forward pass and one back to the device in
the backward pass, for each output the backward pass reads (partial_eval's
``_partial_eval_jaxpr_custom_cached``; unread ones are dead-code eliminated
with their copies). So an offloaded value is needed exactly when a saved one
would be, its bytes leave device residuals for host residuals, and every host
byte crosses the link twice. ``tests/test_offload.py`` checks this against the
jaxpr JAX produces.

So the device/host split of a plan's residuals is by producer
(``evaluate_offload``), on top of ``semantics.evaluate``.

The solve minimises estimated seconds,
``recompute_flops / device_flop_rate + transfer_bytes / host_bandwidth``,
as integer FLOP-equivalents (``recompute_flops + transfer_bytes * rate``, with
the exact rational ``rate = device_flop_rate / host_bandwidth`` FLOPs per byte).
The estimate overlaps nothing: XLA may hide transfers behind compute, so it is
an upper bound on the time a plan adds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from optiremat.solver.graph import CostGraph
from optiremat.solver.semantics import Evaluation, evaluate

TRANSFERS_PER_BYTE = 2  # device -> host in the forward pass, host -> device in the backward

# PCIe 4.0 x16 moves ~25 GB/s per direction in practice (32 GB/s nominal): the
# usual link between an accelerator and pinned host memory.
DEFAULT_HOST_BANDWIDTH = 25_000_000_000  # bytes/s
# Dense bf16 throughput of a current accelerator at realistic utilisation
# (A100 peaks at 312 TFLOP/s, H100 at 989): an order of magnitude, not a datasheet.
DEFAULT_DEVICE_FLOP_RATE = 400_000_000_000_000  # FLOP/s
# Pinned host memory one accelerator can count on sharing a host with several.
DEFAULT_HOST_BUDGET = 64 * 2**30  # bytes


class OffloadOptions(BaseModel):
    """Offload residuals to host memory; ``host_budget_bytes=0`` offloads nothing."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host_budget_bytes: StrictInt = Field(default=DEFAULT_HOST_BUDGET, ge=0)
    host_bandwidth: StrictInt = Field(default=DEFAULT_HOST_BANDWIDTH, gt=0)  # bytes/s
    device_flop_rate: StrictInt = Field(default=DEFAULT_DEVICE_FLOP_RATE, gt=0)  # FLOP/s

    @property
    def flops_per_transfer_byte(self) -> Fraction:
        """What one byte over the link costs, in device FLOPs (exact)."""
        return Fraction(self.device_flop_rate, self.host_bandwidth)

    def cost_flops(self, recompute_flops: int, host_bytes: int) -> Fraction:
        """A plan's cost in FLOP-equivalents: the objective the solve minimises."""
        transfer = TRANSFERS_PER_BYTE * host_bytes
        return recompute_flops + transfer * self.flops_per_transfer_byte

    def seconds(self, cost_flops: Fraction) -> float:
        return float(cost_flops / self.device_flop_rate)


class OffloadReport(BaseModel):
    """What an offload solve adds to a Solution (exact, from ``semantics.evaluate``)."""

    model_config = ConfigDict(frozen=True)

    host_bytes: StrictInt  # residual bytes kept in host memory
    transfer_bytes: StrictInt  # bytes over the link, both directions
    estimated_seconds: float  # recompute and transfer time the plan adds, not overlapped
    lower_bound_seconds: float  # the solver's bound on that


@dataclass(frozen=True)
class OffloadPlan:
    """Decisions priced exactly: per node save flags and which saves are offloaded."""

    saves: tuple[bool, ...]
    offloaded: tuple[bool, ...]
    evaluation: Evaluation
    device_bytes: int
    host_bytes: int


def evaluate_offload(graph: CostGraph, saves: Sequence[bool], offloaded: Sequence[bool],
                     evaluation: Evaluation | None = None) -> OffloadPlan:
    """Device and host residual bytes of a plan (an offloaded node must be saved);
    ``evaluation`` is ``evaluate(graph, saves)`` when the caller has it."""
    ev = evaluate(graph, saves) if evaluation is None else evaluation
    host = 0
    if any(offloaded):
        host = sum(graph.value_bytes[v] for v in ev.residuals
                   if (p := graph.producer[v]) is not None and offloaded[p])
    return OffloadPlan(tuple(saves), tuple(offloaded), ev, ev.residual_bytes - host, host)
