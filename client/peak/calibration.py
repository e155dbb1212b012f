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
import jax.numpy as jnp
from jax import lax

import optiremat.client._jax_internals as jx
from optiremat.client.extract.state import HALF_FLOATS, widens_stacked_halves
from optiremat.client.peak.placement import Region
from optiremat.client.policy import KeyPolicy
from optiremat.client.sharding import Spec
from optiremat.solver.graph import CostGraph
from optiremat.solver.peak import priced_extra_bytes, step_phases, value_weights
from optiremat.solver.semantics import evaluate
from optiremat.solver.step import StepMemory

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


def _working_set(region: Region, saved_keys: frozenset[str] | None) -> tuple[int, int]:
    key = (str(region.body), region.num_consts, region.num_carry, region.differentiated,
           jax.default_backend(), saved_keys, region.layout, region.operand_specs)
    if key not in _measured:
        _measured[key] = _measure(region, saved_keys)
    return _measured[key]


def _measure(region: Region, saved_keys: frozenset[str] | None) -> tuple[int, int]:
    """The working set XLA holds, and the widened copies within it the graph prices."""
    from optiremat.client.extract import graph_of_traced, trace
    from optiremat.client.step import compiled_for_memory, memory_analysis
    from optiremat.solver.step import StepMemory

    program, args, flags = _calibration_program(region, saved_keys)
    compiled = compiled_for_memory(jax.jit(jax.grad(program)).lower(*args))
    temp = memory_analysis(compiled).temp_size_in_bytes
    # Extracted as a step's graph is (``step_memory`` given), so that it prices the same
    # widened copies of stacked half floats.
    graph = graph_of_traced(trace(program, args, {}), step=True, differentiated=flags,
                            step_memory=StepMemory(argument_bytes=0, output_bytes=0)).graph
    evaluation = evaluate(graph, [False] * graph.num_nodes)  # every mode is fixed here
    arguments = {graph.value_index[v] for v in graph.inputs}
    stacked = [v for v in evaluation.residuals if v not in arguments]
    extra = graph.value_extra_bytes or [0] * graph.num_values
    # Less one layer's input: the scan stacks every layer's input, the first one's
    # too, which is an argument here (priced at nothing) and in the step a value its
    # graph prices where it is made. Measured: without this the prediction ran one
    # carry high on every model of the scan corpus (two on CPU for bf16: its f32 copy).
    carries = range(region.num_consts, region.num_consts + region.num_carry)
    first_input = sum(region.operand_bytes(i) * (2 if _widened(a) else 1)
                      for i, a in zip(carries, region.carry_avals, strict=True))
    # Plus the cotangent of the last layer's output, which the step's backward hands the
    # region and holds through it; this program's is a broadcast of ones XLA never makes.
    # Measured: without it the layers' phase ran one carry low on the scan corpus once
    # the residuals outside the region (the last layer's output among them) left it.
    cotangent = sum(region.operand_bytes(i)
                    for i, a in zip(carries, region.carry_avals, strict=True)
                    if jnp.issubdtype(a.dtype, jnp.inexact))
    held = (temp - sum(graph.value_bytes[v] for v in stacked) - first_input + cotangent
            + SCALARS_BYTES)
    return max(held, 0), sum(extra[v] for v in stacked)


def calibrate_phases(graph: CostGraph, regions: Sequence[Region],
                     step_peak: Callable[[Any], int]) -> StepMemory:
    """The step's memory with its phases calibrated against the step itself, compiled
    with every region under a built-in (``step_peak(policy)``: XLA's peak of the step).

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
    if len(memories) == 1:  # its backward set the peak: its working set as the step holds it
        in_step = lean + outside_share - phases[0].fixed_residual_bytes
        memories[0] = memories[0].model_copy(update={"working_bytes": max(in_step, 0)})
    every = frozenset(k for k in graph.node_key if k)
    extra = priced_extra_bytes(graph, [True] * graph.num_nodes)
    saving = [working_bytes(r, every) - extra - assumed_working_bytes(r) + m.working_bytes
              + p.fixed_residual_bytes
              for r, m, p in zip(regions, memories, phases[:-1], strict=True)]
    full = bound(jax.checkpoint_policies.everything_saveable, True)
    outside = full if outside_sets_it(full, saving) else 0
    return step.model_copy(update={"outside_working_bytes": max(outside, 0),
                                   "regions": memories})


def _widened(aval) -> bool:
    """Whether XLA keeps an f32 copy of this value where a scan stacks it (half floats)."""
    return widens_stacked_halves() and str(aval.dtype) in HALF_FLOATS


def _calibration_program(region: Region, saved_keys: frozenset[str] | None):
    """The region's scan with its body under ``nothing_saveable`` (or saving
    ``saved_keys``); a scalar of all its outputs. Differentiated operands come first,
    as one argument, as in the step."""
    body, nc, nk = region.body, region.num_consts, region.num_carry
    length = region.length
    avals = list(body.in_avals)
    specs = list(region.operand_specs or [None] * len(avals))

    def struct(shape: tuple[int, ...], dtype: Any, spec: Any) -> jax.ShapeDtypeStruct:
        # On a mesh, each operand split as the step splits it: the compile is partitioned
        # as the step's is, and its figures are one device's.
        if region.layout is None:
            return jax.ShapeDtypeStruct(shape, dtype)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=region.layout.sharding(spec))

    def stacked_spec(spec: Spec | None) -> Spec | None:  # the layers' axis is whole
        return None if spec is None else ((), *spec)

    structs = [struct(a.shape, a.dtype, specs[i]) for i, a in enumerate(avals[:nc + nk])] + [
        struct((length, *a.shape), a.dtype, stacked_spec(specs[i]))
        for i, a in enumerate(avals[nc + nk:], start=nc + nk)]
    diff = [i for i, d in enumerate(region.differentiated) if d]
    rest = [i for i, d in enumerate(region.differentiated) if not d]

    def layer(*inputs):
        return jx.eval_jaxpr(body.jaxpr, body.consts, *inputs)

    policy = (jax.checkpoint_policies.nothing_saveable if saved_keys is None
              else KeyPolicy(saved_keys))
    checkpointed = jx.checkpoint(layer, policy=policy, prevent_cse=False)

    def program(differentiated: Sequence, others: Sequence):
        operands: list = [None] * len(structs)
        for i, x in zip(diff, differentiated, strict=True):
            operands[i] = x
        for i, x in zip(rest, others, strict=True):
            operands[i] = x
        consts, init, xs = operands[:nc], operands[nc:nc + nk], operands[nc + nk:]

        def step(carry, x):
            out = checkpointed(*consts, *carry, *x)
            return list(out[:nk]), list(out[nk:])

        carry, ys = lax.scan(step, list(init), list(xs), length=length)
        return sum((jnp.sum(o.astype(jnp.float32)) for o in [*carry, *ys]
                    if jnp.issubdtype(o.dtype, jnp.inexact)), jnp.float32(0))

    args = ([structs[i] for i in diff], [structs[i] for i in rest])
    flags = [True] * len(diff) + [False] * len(rest)
    return program, args, flags
