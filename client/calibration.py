"""One layer's backward working set, measured with one compile of one layer.

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

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

import optiremat.client._jax_internals as jx
from optiremat.client.placement import Region
from optiremat.solver.semantics import evaluate

_measured: dict[tuple, int] = {}


def working_bytes(region: Region) -> int:
    """One iteration's backward working set of ``region``, in bytes, on the default backend."""
    key = (str(region.body), region.num_consts, region.num_carry, region.differentiated,
           jax.default_backend())
    if key not in _measured:
        _measured[key] = _measure(region)
    return _measured[key]


def _measure(region: Region) -> int:
    from optiremat.client.extract import graph_of_traced, trace
    from optiremat.client.step import memory_analysis

    program, args, flags = _calibration_program(region)
    compiled = jax.jit(jax.grad(program)).lower(*args).compile()
    temp = memory_analysis(compiled).temp_size_in_bytes
    graph = graph_of_traced(trace(program, args, {}), step=True, differentiated=flags).graph
    evaluation = evaluate(graph, [False] * graph.num_nodes)  # every mode is fixed here
    arguments = {graph.value_index[v] for v in graph.inputs}
    stacked = sum(graph.value_bytes[v] for v in evaluation.residuals if v not in arguments)
    return max(temp - stacked, 0)


def _calibration_program(region: Region):
    """The region's scan with its body under ``nothing_saveable``; a scalar of all its
    outputs. Differentiated operands come first, as one argument, as in the step."""
    body, nc, nk = region.body, region.num_consts, region.num_carry
    length = region.length
    avals = list(body.in_avals)
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals[:nc + nk]] + [
        jax.ShapeDtypeStruct((length, *a.shape), a.dtype) for a in avals[nc + nk:]]
    diff = [i for i, d in enumerate(region.differentiated) if d]
    rest = [i for i, d in enumerate(region.differentiated) if not d]

    def layer(*inputs):
        return jx.eval_jaxpr(body.jaxpr, body.consts, *inputs)

    checkpointed = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable,
                                  prevent_cse=False)

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
