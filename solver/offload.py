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

The solve minimises the seconds a plan adds to the step, as integer
FLOP-equivalents: a transfer of ``b`` bytes costs ``b * rate`` with the exact
rational ``rate = device_flop_rate / host_bandwidth`` FLOPs per byte
(``PlanTime``). Inside a ``lax.scan`` of layers a transfer overlaps compute: a
layer's copies to host run while the next layers compute their forward pass,
and its copies back are fetched while the layer after it runs its backward pass
(XLA's host-offload scheduling; torchtitan bounds the same copy window). So per
region of the step, with ``F`` its forward FLOPs, ``R`` its recomputation and
``T`` its offloaded bytes times ``rate`` (one direction), the plan adds

    max(F, T) - F          to the forward pass, and
    max(2F + R, T) - 2F    to the backward pass (about 2F of gradient FLOPs)

which is ``max(R, T - 2F)`` there: transfers cost nothing until they outrun the
compute that hides them. That is per layer max(compute, transfer), summed over
the layers, because every layer of a scan runs the same plan. Outside scan
regions (and on graphs without a step) nothing overlaps: ``R + 2T``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import chain

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from optiremat.solver.graph import CostGraph
from optiremat.solver.semantics import Evaluation, baseline_evaluation, evaluate
from optiremat.solver.validation import INT_BOUND

TRANSFERS_PER_BYTE = 2  # device -> host in the forward pass, host -> device in the backward
# A layer's backward pass runs about twice its forward FLOPs (a matmul's two
# gradients), the compute its fetches from host hide behind.
BACKWARD_PER_FORWARD = 2

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

    host_budget_bytes: StrictInt = Field(default=DEFAULT_HOST_BUDGET, ge=0, lt=INT_BOUND)
    host_bandwidth: StrictInt = Field(default=DEFAULT_HOST_BANDWIDTH, gt=0,
                                      lt=INT_BOUND)  # bytes/s
    device_flop_rate: StrictInt = Field(default=DEFAULT_DEVICE_FLOP_RATE, gt=0,
                                        lt=INT_BOUND)  # FLOP/s

    @property
    def flops_per_transfer_byte(self) -> Fraction:
        """What one byte over the link costs, in device FLOPs (exact)."""
        return Fraction(self.device_flop_rate, self.host_bandwidth)

    def cost_flops(self, recompute_flops: int, host_bytes: int) -> Fraction:
        """What recomputation and transfers that overlap nothing cost, in FLOP-equivalents
        (a plan outside scan regions; ``PlanTime`` prices a whole plan)."""
        transfer = TRANSFERS_PER_BYTE * host_bytes
        return recompute_flops + transfer * self.flops_per_transfer_byte

    def seconds(self, cost_flops: Fraction) -> float:
        return float(cost_flops / self.device_flop_rate)


class OffloadReport(BaseModel):
    """What an offload solve adds to a Solution (exact, from ``semantics.evaluate``)."""

    model_config = ConfigDict(frozen=True)

    host_bytes: StrictInt  # residual bytes kept in host memory
    transfer_bytes: StrictInt  # bytes over the link, both directions
    estimated_seconds: float  # recompute and transfer time the plan adds (``PlanTime``)
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


def step_seconds(graph: CostGraph, options: OffloadOptions) -> float:
    """The step without remat, estimated: its forward FLOPs and the backward pass's
    ``BACKWARD_PER_FORWARD`` times as many, at the device's rate."""
    return (1 + BACKWARD_PER_FORWARD) * sum(graph.node_flops) / options.device_flop_rate


@dataclass(frozen=True)
class RegionTime:
    """What one scan region's plans share: the compute that hides its transfers and
    the recomputation everything_saveable already runs there."""

    forward_flops: int
    baseline_flops: int


class PlanTime:
    """The time a plan adds to the step, in FLOP-equivalents (the module docstring):
    ``cost`` prices a plan exactly, and the formulation's offload layer poses the
    same sum with one integer per region and pass for each max."""

    def __init__(self, graph: CostGraph, options: OffloadOptions) -> None:
        self.options = options
        node_region = graph.node_region or [-1] * graph.num_nodes
        stacked_by = graph.value_region or [-1] * graph.num_values
        self.node_region = list(node_region)
        # A value belongs to the region that stacks it, else to its producer's.
        self.value_region = [
            r if r >= 0 else (-1 if (p := graph.producer[v]) is None else node_region[p])
            for v, r in enumerate(stacked_by)]
        count = max(chain(node_region, self.value_region), default=-1) + 1
        forward, baseline = [0] * count, [0] * count
        for n, r in enumerate(node_region):
            if r >= 0:
                forward[r] += graph.node_flops[n]
        self.baseline_outside = 0
        for n in baseline_evaluation(graph).active:
            r = node_region[n]
            if r >= 0:
                baseline[r] += graph.node_flops[n]
            else:
                self.baseline_outside += graph.node_flops[n]
        self.regions = tuple(RegionTime(f, b) for f, b in zip(forward, baseline, strict=True))
        self._flops = graph.node_flops
        self._bytes = graph.value_bytes
        self._producer = graph.producer

    def cost(self, plan: OffloadPlan) -> Fraction:
        """The plan's added time in FLOP-equivalents (exact)."""
        rate = self.options.flops_per_transfer_byte
        recompute = [0] * len(self.regions)
        host = [0] * len(self.regions)
        outside = -self.baseline_outside
        for n in plan.evaluation.active:
            r = self.node_region[n]
            if r >= 0:
                recompute[r] += self._flops[n]
            else:
                outside += self._flops[n]
        total = Fraction(outside)
        for v in plan.evaluation.residuals:
            p = self._producer[v]
            if p is None or not plan.offloaded[p]:
                continue
            r = self.value_region[v]
            if r >= 0:
                host[r] += self._bytes[v]
            else:
                total += TRANSFERS_PER_BYTE * self._bytes[v] * rate
        for region, flops, nbytes in zip(self.regions, recompute, host, strict=True):
            forward, transfer = region.forward_flops, nbytes * rate
            total += max(Fraction(0), transfer - forward)
            total += max(Fraction(flops - region.baseline_flops),
                         transfer - BACKWARD_PER_FORWARD * forward)
        return total
