"""The working sets of the step's phases, each measured with one compile.

A region's (one layer's backward working set) is measured with one compile of
one layer; the phases outside every region (``outside_working_bytes``: the end
of the forward pass and the backward of what follows the last region, an LM
head's logits, softmax and cotangents) with one compile of the whole step.

The peak model (``optiremat.solver.peak``) is exact about what a step holds
and what its forward pass stacks; the one figure it cannot derive is the
transient working set of the backward pass, which depends on XLA's fusion and
scheduling. One program measures it: ``jax.jit(jax.grad(...))`` of the region's
scan, alone, with its body under ``nothing_saveable``, compiled but never run
(``jax.ShapeDtypeStruct`` shapes suffice). Its temp bytes minus the residuals
it stacks (this project's own exact graph of that program) is the working set.
XLA compiles a loop's body once whatever its trip count, so the scan keeps its
real length at no extra cost, and whatever XLA holds in proportion to the
number of layers beyond the residuals is measured too (on CPU, f32 copies of
stacked bf16 parameters: 37 MiB of a 16-layer bf16 Llama's 55 MiB).

``nothing_saveable`` recomputes the most in the backward pass; on the corpus
its working set is the largest along the frontier of optimal plans but for
one model where saving everything needs 2 MiB more (bench/peak.py prints the
spread). One compile per distinct layer, never one per candidate plan, and
each is remembered for the life of the process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from optiremat.client.extract.state import HALF_FLOATS, widens_stacked_halves
from optiremat.client.peak.block_region import BlockRegion
from optiremat.client.peak.regions import Region
from optiremat.client.policy import KeyPolicy
from optiremat.solver.graph import CostGraph
from optiremat.solver.peak import priced_extra_bytes, step_phases, value_weights
from optiremat.solver.semantics import evaluate
from optiremat.solver.step import RegionMemory, StepMemory

_measured: dict[tuple, tuple[int, int]] = {}

# The step's few small buffers outside every layer (the loss, loop counters and
# XLA's loop-state tuples), which no residual or working set prices: 32 to 72
# bytes on the scan corpus, so a little more is allowed.
SCALARS_BYTES = 128
# How far over the layers' backward a phase outside them must measure to be taken as the
# one that sets the peak: more than the layers' calibration is ever off (48 to 736 bytes).
DOMINATES_BY = 4096


def working_bytes(region: Region, saved_keys: frozenset[str] | None = None) -> int:
    """One iteration's backward working set of ``region``, in bytes, on the default
    platform, as XLA holds it: under ``nothing_saveable``, or with the policy keys
    ``saved_keys`` saved. On CPU it includes XLA's f32 copies of the region's stacked
    half-float residuals."""
    return _working_set(region, saved_keys)[0]


def assumed_working_bytes(region: Region) -> int:
    """The working set a step's graph assumes for ``region``: ``nothing_saveable``'s,
    less the f32 copies of stacked half floats that the graph prices itself
    (``value_extra_bytes``), so that the two add up to what XLA holds."""
    measured, priced = _working_set(region, None)
    return max(measured - priced, 0)


def working_bytes_in_step(region: Region, memory: RegionMemory, saved_keys: frozenset[str],
                          priced_extra: int) -> int:
    """The working set of ``region``'s backward as the step holds it with the policy keys
    ``saved_keys`` saved: its program's figure (``working_bytes``) moved by what the step's
    calibration found ``nothing_saveable``'s to be there (``memory.working_bytes`` against
    ``assumed_working_bytes``), less ``priced_extra``, the f32 copies the graph prices."""
    return (working_bytes(region, saved_keys) - priced_extra - assumed_working_bytes(region)
            + memory.working_bytes)


def _working_set(region: Region, saved_keys: frozenset[str] | None) -> tuple[int, int]:
    key = (region.calibration_key, jax.default_backend(), saved_keys)
    if key not in _measured:
        _measured[key] = _measure(region, saved_keys)
    return _measured[key]


def _measure(region: Region, saved_keys: frozenset[str] | None) -> tuple[int, int]:
    """The working set XLA holds, and the widened copies within it the graph prices."""
    from optiremat.client.extract import graph_of_traced, trace
    from optiremat.client.step import lowered_memory
    from optiremat.solver.step import StepMemory

    program, args, flags = region.calibration_program(saved_keys, _policy)
    temp = lowered_memory(jax.jit(jax.grad(program)).lower(*args),
                          keep_barriers=isinstance(region, BlockRegion)).temp_bytes
    # Extracted as a step's graph is (``step_memory`` given), so that it prices the same
    # widened copies of stacked half floats.
    graph = graph_of_traced(trace(program, args, {}), step=True, differentiated=flags,
                            step_memory=StepMemory(argument_bytes=0, output_bytes=0)).graph
    evaluation = evaluate(graph, [False] * graph.num_nodes)  # every mode is fixed here
    arguments = {graph.value_index[v] for v in graph.inputs}
    stacked = [v for v in evaluation.residuals if v not in arguments]
    extra = graph.value_extra_bytes or [0] * graph.num_values
    held = (temp - sum(graph.value_bytes[v] for v in stacked)
            + region.calibration_correction(_widened) + SCALARS_BYTES)
    return max(held, 0), sum(extra[v] for v in stacked)


def calibrate_phases(graph: CostGraph, regions: Sequence[Region],
                     step_peak: Callable[[Any], int],
                     step_ahead: Callable[[Any], None] = lambda policy: None) -> StepMemory:
    """The step's memory with its phases calibrated against the step itself, compiled
    with every region under a built-in (``step_peak(policy)``: XLA's peak of the step;
    ``step_ahead(policy)`` starts that compile on a worker thread, to be read later).

    Under ``nothing_saveable`` the residuals are fewest and priced exactly (the layers'
    stacked inputs), so the phase that sets that plan's peak is measured to the byte:
    where it is outside the regions (an LM head from a vocabulary of about 8k here),
    ``outside_working_bytes`` is its working set. Where it is the one region's backward,
    that region's working set in the step is (XLA holds up to 6% less there than in the
    layer's own program, on a tied-embedding LM), and the step is compiled once more
    with every region saving everything, the layers' smallest working set (its layer
    program measured too): where the phases outside then set the peak, their working
    set is that plan's; where the layers' backward sets it again, the phases outside
    hold no working set the plans could reach, and none is priced (on the scan corpus,
    a loss over the last layer's output, they hold a few hundred bytes).
    """
    step = graph.step
    assert step is not None
    weights = value_weights(graph, [1] * len(step.regions))

    def bound(policy: Any, saves: bool) -> int:
        residuals = evaluate(graph, [saves] * graph.num_nodes).residuals
        return step_peak(policy) - step.held_bytes - sum(weights[v] for v in residuals)

    phases = step_phases(graph.model_copy(update={"step": step.model_copy(
        update={"outside_working_bytes": 0})}))
    outside_share = phases[-1].fixed_residual_bytes  # every fixed residual

    def outside_sets_it(working: int, region_shares: Sequence[int]) -> bool:
        return working + outside_share > max(region_shares, default=0) + DOMINATES_BY

    lean = bound(jax.checkpoint_policies.nothing_saveable, False)
    if outside_sets_it(lean, [p.fixed_bytes for p in phases[:-1]]):
        return step.model_copy(update={"outside_working_bytes": max(lean, 0)})
    memories = list(step.regions)
    if _one_program(regions):
        # Its backward set the peak (the first of identical blocks' does): the working
        # set as the step holds it.
        for k, phase in enumerate(phases[:-1]):
            in_step = lean + outside_share - phase.fixed_residual_bytes
            memories[k] = memories[k].model_copy(update={"working_bytes": max(in_step, 0)})
    # The step saving everything compiles while the layers' programs saving everything do.
    step_ahead(jax.checkpoint_policies.everything_saveable)
    every = frozenset(k for k in graph.node_key if k)
    extra = priced_extra_bytes(graph, [True] * graph.num_nodes)
    saving = [working_bytes_in_step(r, m, every, extra) + p.fixed_residual_bytes
              for r, m, p in zip(regions, memories, phases[:-1], strict=True)]
    full = bound(jax.checkpoint_policies.everything_saveable, True)
    outside = full if outside_sets_it(full, saving) else 0
    return step.model_copy(update={"outside_working_bytes": max(outside, 0),
                                   "regions": memories})


def _one_program(regions: Sequence[Region]) -> bool:
    """One region, or blocks that are all the same code (the layers of a Python loop)."""
    return len(regions) == 1 or (all(isinstance(r, BlockRegion) for r in regions)
                                 and len({r.program for r in regions}) == 1)


def _widened(aval) -> bool:
    """Whether XLA keeps an f32 copy of this value where a scan stacks it (half floats)."""
    return widens_stacked_halves() and str(aval.dtype) in HALF_FLOATS


def _policy(saved_keys: frozenset[str] | None) -> Any:
    """What a calibration runs its region under: ``nothing_saveable``, or saving the
    policy keys ``saved_keys``."""
    if saved_keys is None:
        return jax.checkpoint_policies.nothing_saveable
    return KeyPolicy(saved_keys)
