"""Sharding propagation: each variable's spec on a mesh, by per-primitive rules.

An intermediate's spec is propagated through the jaxpr the graph is walked from,
with the rules SPMD partitioning follows for the primitives a layer is made of:
an elementwise op keeps its operands' split, a ``dot_general`` keeps its batch and
free dimensions' and loses a contracted one (its partial sums are all-reduced), a
reshape carries a split onto the major dimension of the group it maps to, a
reduction drops the reduced dimensions, a gather keeps its indices' split and its
operand's on the dimensions it slices whole (an embedding lookup is split as its
tokens), a broadcast takes the split of the elementwise op that reads it,
``with_sharding_constraint`` sets it. A mesh axis splits at most one dimension of
a value (XLA gathers the other, as it does an FSDP parameter a batch-sharded
activation multiplies). Why propagation and not XLA's own shardings:
``docs/design.md``, "Sharded steps".

The rules are tables keyed by JAX's ``Primitive`` objects, as
``client.primitives``'s registry is (``SPEC_RULES``: a primitive's output specs;
``COLLECTIVE_RULES``: the bytes it moves over the interconnect): a primitive with
no entry is elementwise-like and moves nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import optiremat.client._jax_internals as jx
from optiremat.client.interpreter import Analysis, ControlFlow, interpret

if TYPE_CHECKING:  # a mesh's layout reads its specs here: client.sharding imports this
    from optiremat.client.sharding import MeshLayout

# Per dimension, the mesh axes splitting it (``()``: whole on every device).
Spec = tuple[tuple[str, ...], ...]

_lax = jx.lax_ops

# Reductions that drop the dimensions they reduce (cumulative ones keep them).
REDUCTIONS: frozenset[jx.core.Primitive] = frozenset({
    _lax.reduce_sum_p, _lax.reduce_max_p, _lax.reduce_min_p, _lax.reduce_prod_p,
    _lax.reduce_and_p, _lax.reduce_or_p, _lax.reduce_xor_p, _lax.argmax_p, _lax.argmin_p})


def spec_of(sharding: Any, ndim: int) -> Spec:
    """Per dimension, the mesh axes of a ``NamedSharding``'s partition spec."""
    entries = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    out: list[tuple[str, ...]] = []
    for entry in entries[:ndim]:
        if entry is None:
            out.append(())
        elif isinstance(entry, str):
            out.append((entry,))
        else:
            out.append(tuple(entry))
    return tuple(out)


def _dedupe(spec: Sequence[tuple[str, ...]]) -> Spec:
    """A mesh axis splits one dimension of a value: the first keeps it."""
    seen: set[str] = set()
    out = []
    for axes in spec:
        kept = tuple(a for a in axes if a not in seen)
        seen.update(kept)
        out.append(kept)
    return tuple(out)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(getattr(getattr(x, "aval", None), "shape", ()))


def _merge(specs: Sequence[Spec | None], shape: tuple[int, ...],
           shapes: Sequence[tuple[int, ...]]) -> Spec:
    """Operands of the output's shape, combined per dimension (the first split wins)."""
    out: list[tuple[str, ...]] = [()] * len(shape)
    for spec, s in zip(specs, shapes, strict=True):
        if spec and s == shape:
            out = [o or axes for o, axes in zip(out, spec, strict=True)]
    return _dedupe(out)


def _reshape(spec: Spec, old: tuple[int, ...], new: tuple[int, ...],
             sizes: dict[str, int]) -> Spec:
    """A split carried onto the major dimension of the group of dimensions it maps to."""
    out: list[tuple[str, ...]] = [()] * len(new)
    i = j = 0
    while i < len(old) and j < len(new):
        i0, j0 = i, j
        a, b = old[i], new[j]
        i += 1
        j += 1
        while a != b:
            if a < b:
                a *= old[i]
                i += 1
            else:
                b *= new[j]
                j += 1
        axes = spec[i0]
        if axes and j > j0 and new[j0] % math.prod(sizes[x] for x in axes) == 0:
            out[j0] = axes
        while i < len(old) and old[i] == 1:  # trailing unit dimensions join no group
            i += 1
        while j < len(new) and new[j] == 1:
            j += 1
    return _dedupe(out)


def _dot(eqn: Any, lhs: Spec, rhs: Spec) -> Spec:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ln, rn = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
    lhs = lhs or ((),) * ln
    rhs = rhs or ((),) * rn
    batch = [lhs[i] or rhs[j] for i, j in zip(lb, rb, strict=True)]
    free_l = [lhs[i] for i in range(ln) if i not in lc and i not in lb]
    free_r = [rhs[i] for i in range(rn) if i not in rc and i not in rb]
    return _dedupe([*batch, *free_l, *free_r])


def _match_batch(eqn: Any, ins: list[Spec | None], env: dict, fixed: set) -> None:
    """A ``dot_general`` operand made here whose batch dimension is whole while the other
    operand's is split takes that split: XLA slices it locally rather than gather the
    other (measured: the keys and values ``jnp.repeat`` widens to every head, on a mesh
    whose model axis splits the heads but not the 2 KV heads they come from)."""
    (_, _), (lb, rb) = eqn.params["dimension_numbers"]
    for mine, other, var, dims in ((0, 1, eqn.invars[0], zip(lb, rb, strict=True)),
                                   (1, 0, eqn.invars[1], zip(rb, lb, strict=True))):
        split = ins[other]
        if isinstance(var, jx.Literal) or var in fixed or not split:
            continue
        spec = list(ins[mine] or ((),) * len(_shape(var)))
        for d, o in dims:
            if not spec[d]:
                spec[d] = split[o]
        env[var] = _dedupe(spec)


def _split_broadcasts(eqn: Any, out: Spec, env: dict, broadcasts: set) -> None:
    """A ``broadcast_in_dim`` made in this jaxpr that an elementwise op meets with a split
    operand takes the op's split: each device builds its own block of a broadcast, so
    XLA splits it as its user (measured: the causal mask ``jnp.where`` broadcasts to the
    scores' shape, and the ``-1e9`` beside it, are one batch row per device on a
    data-parallel mesh in the compiled program, not whole)."""
    shape = _shape(eqn.outvars[0])
    for var in eqn.invars:
        if not isinstance(var, jx.Literal) and var in broadcasts and _shape(var) == shape:
            mine = env.get(var) or ((),) * len(shape)
            env[var] = _dedupe([a or b for a, b in zip(mine, out, strict=True)])


def _gather(eqn: Any, operand: Spec | None, indices: Spec | None) -> Spec:
    """A gather's output dimensions are its indices' batch dimensions (all but the last,
    the index vector), split as the indices are, and the operand's offset dimensions in
    order, split as the operand is where the whole dimension is sliced. A split of an
    indexed (collapsed) dimension is lost: XLA gathers from its shard with the indices
    outside masked and all-reduces, or all-gathers the table; either way each device
    holds every row it asked for (measured: an embedding table split by vocabulary
    rows, over the batch's own axis (FSDP) or another (tensor parallel), gives the
    token batch's split and whole rows, in the compiled program's shapes)."""
    dn = eqn.params["dimension_numbers"]
    op_shape, out_rank = _shape(eqn.invars[0]), len(_shape(eqn.outvars[0]))
    operand = operand or ((),) * len(op_shape)
    indices = indices or ((),) * len(_shape(eqn.invars[1]))
    sliced = [d for d in range(len(op_shape))
              if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    batched = dict(zip(dn.start_indices_batching_dims, dn.operand_batching_dims, strict=True))
    out: list[tuple[str, ...]] = []
    offsets, batches = iter(sliced), iter(range(len(indices) - 1))
    for d in range(out_rank):
        if d in dn.offset_dims:
            o = next(offsets)
            whole = eqn.params["slice_sizes"][o] == op_shape[o]
            out.append(operand[o] if whole else ())
        else:
            i = next(batches)
            out.append(indices[i] or (operand[batched[i]] if i in batched else ()))
    return _dedupe(out)



def _elementwise(eqn: Any, ins: list[Spec | None]) -> list[Spec]:
    """Elementwise ops, selects, casts (a primitive with no rule): operands of the output's
    shape; slices, pads, gathers along some dimension keep the split of the others."""
    first = ins[0] if ins else None
    in_shapes = [_shape(v) for v in eqn.invars]
    results = []
    for shape in (_shape(v) for v in eqn.outvars):
        spec = _merge(ins, shape, in_shapes)
        if not any(spec) and first and len(in_shapes[0]) == len(shape):
            spec = _dedupe([a if n == m else () for a, n, m in zip(first, in_shapes[0], shape,
                                                                   strict=True)])
        results.append(spec)
    return results


# ---- the rules: a primitive's output specs --------------------------------------------

# A rule's answer of None: its operand is not split, and the elementwise rule applies.
SpecRule = Callable[[Any, list[Spec | None], dict[str, int]], list[Spec] | None]


def _constraint(eqn: Any, ins: list[Spec | None], sizes: dict[str, int]) -> list[Spec] | None:
    return [spec_of(eqn.params["sharding"], len(_shape(eqn.outvars[0])))]


def _dot_general(eqn: Any, ins: list[Spec | None], sizes: dict[str, int]) -> list[Spec] | None:
    return [_dot(eqn, ins[0] or (), ins[1] or ())]


def _gather_rule(eqn: Any, ins: list[Spec | None], sizes: dict[str, int]) -> list[Spec] | None:
    return [_gather(eqn, ins[0], ins[1])]


def _transpose(eqn: Any, ins: list[Spec | None], sizes: dict[str, int]) -> list[Spec] | None:
    first = ins[0]
    return [tuple(first[p] for p in eqn.params["permutation"])] if first else None


def _broadcast(eqn: Any, ins: list[Spec | None], sizes: dict[str, int]) -> list[Spec] | None:
    first = ins[0]
    if not first:
        return None
    old, new = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    out: list[tuple[str, ...]] = [()] * len(new)
    for i, d in enumerate(eqn.params["broadcast_dimensions"]):
        if old[i] == new[d]:
            out[d] = first[i]
    return [_dedupe(out)]


def _reshape_rule(eqn: Any, ins: list[Spec | None], sizes: dict[str, int]) -> list[Spec] | None:
    first = ins[0]
    return [_reshape(first, _shape(eqn.invars[0]), _shape(eqn.outvars[0]), sizes)] \
        if first else None


def _drop_dimensions(eqn: Any, ins: list[Spec | None],
                     sizes: dict[str, int]) -> list[Spec] | None:
    """A reduction (``axes``) or a squeeze (``dimensions``) drops those dimensions."""
    first = ins[0]
    if not first:
        return None
    dropped = set(eqn.params.get("axes", eqn.params.get("dimensions", ())))
    return [tuple(a for i, a in enumerate(first) if i not in dropped)] * len(eqn.outvars)


def _concatenate(eqn: Any, ins: list[Spec | None], sizes: dict[str, int]) -> list[Spec] | None:
    d = eqn.params["dimension"]
    out = _shape(eqn.outvars[0])
    merged = [list(s) if s else [()] * len(out) for s in ins]
    for m in merged:
        m[d] = ()
    return [_merge([tuple(m) for m in merged], out, [out] * len(merged))]


SPEC_RULES: dict[jx.core.Primitive, SpecRule] = {
    jx.pjit.sharding_constraint_p: _constraint,
    _lax.dot_general_p: _dot_general,
    jx.slicing.gather_p: _gather_rule,
    _lax.transpose_p: _transpose,
    _lax.broadcast_in_dim_p: _broadcast,
    _lax.reshape_p: _reshape_rule,
    _lax.squeeze_p: _drop_dimensions,
    _lax.concatenate_p: _concatenate,
    **{p: _drop_dimensions for p in REDUCTIONS},
}


def _equation(eqn: Any, ins: list[Spec | None], sizes: dict[str, int]) -> list[Spec]:
    rule = SPEC_RULES.get(eqn.primitive)
    outs = None if rule is None else rule(eqn, ins, sizes)
    return _elementwise(eqn, ins) if outs is None else outs


class _Specs(Analysis):
    """Each variable's spec (None: not split, or not known to be); one environment
    across inner jaxprs, by variable (a scan body's per iteration)."""

    def __init__(self, sizes: dict[str, int], env: dict) -> None:
        self.sizes, self.env = sizes, env

    def read(self, env: dict, x: Any) -> Spec | None:
        return None if isinstance(x, jx.Literal) else env.get(x)

    def scope(self, jaxpr: jx.Jaxpr) -> tuple[set, set]:
        return set(), set(jaxpr.invars)  # the variables broadcast_in_dim makes here; inputs

    def equation(self, eqn: Any, ins: list, env: dict, scope: tuple[set, set]) -> list:
        broadcasts, inputs = scope
        outs = list(_equation(eqn, ins, self.sizes))
        if eqn.primitive is _lax.dot_general_p:
            _match_batch(eqn, ins, env, inputs)
        elif eqn.primitive is _lax.broadcast_in_dim_p:
            broadcasts.add(eqn.outvars[0])
        elif eqn.primitive not in SPEC_RULES and outs and outs[0] and any(outs[0]):
            _split_broadcasts(eqn, outs[0], env, broadcasts)
        return outs

    def control(self, flow: ControlFlow, eqn: Any, ins: list) -> list:
        return flow.specs(self, eqn, ins)

    def inner(self, jaxpr: jx.Jaxpr, ins: Sequence) -> list:
        return interpret(self, jaxpr, ins, self.env)[0]


def propagate(jaxpr: jx.Jaxpr, specs: Sequence[Spec | None], sizes: dict[str, int],
              into: dict | None = None) -> tuple[list[Spec | None], dict]:
    """Specs of ``jaxpr``'s outputs given its inputs', and of every variable on the way
    (inner jaxprs' too, by variable: a scan body's per iteration)."""
    analysis = _Specs(sizes, {} if into is None else into)
    return interpret(analysis, jaxpr, specs, analysis.env)


# ---- collectives: the bytes a primitive moves -----------------------------------------

# specs: each variable's spec (``propagate``'s environment).
CollectiveRule = Callable[[Any, dict, "MeshLayout"], int]


def _spec(x: Any, specs: dict) -> Spec | None:
    return None if isinstance(x, jx.Literal) else specs.get(x)


def _all_reduce(eqn: Any, split: set[str], specs: dict, layout: MeshLayout) -> int:
    """A ring all-reduce of the partial sums over the ``split`` axes: ``2 (k - 1) / k``
    times one device's block of the result."""
    if not split:
        return 0
    out = eqn.outvars[0]
    k = math.prod(layout.sizes[a] for a in split)
    return 2 * (k - 1) * layout.value_bytes(out.aval, _spec(out, specs)) // k


def _contracted(eqn: Any, specs: dict, layout: MeshLayout) -> int:
    """A ``dot_general`` contracting a dimension both operands split on the same axes."""
    (lc, rc), _ = eqn.params["dimension_numbers"]
    lhs, rhs = _spec(eqn.invars[0], specs) or (), _spec(eqn.invars[1], specs) or ()
    split: set[str] = set()
    for i, j in zip(lc, rc, strict=True):
        if lhs and rhs and lhs[i] and lhs[i] == rhs[j]:
            split.update(lhs[i])
    return _all_reduce(eqn, split, specs, layout)


def _reduced(eqn: Any, specs: dict, layout: MeshLayout) -> int:
    """A reduction over a split dimension."""
    first = _spec(eqn.invars[0], specs) or ()
    split: set[str] = set()
    for d in eqn.params.get("axes", ()):
        if first and d < len(first):
            split.update(first[d])
    return _all_reduce(eqn, split, specs, layout)


def _regathered(eqn: Any, specs: dict, layout: MeshLayout) -> int:
    """An equation that moves a value without changing its elements: when one device's
    block of the output is larger than of the input, the split was lost and XLA gathers
    the blocks it receives."""
    src, out = eqn.invars[0], eqn.outvars[0]
    if isinstance(src, jx.Literal):
        return 0
    held = math.prod(layout.shard_shape(_shape(src), _spec(src, specs)))
    wanted = math.prod(layout.shard_shape(_shape(out), _spec(out, specs)))
    block = layout.value_bytes(out.aval, _spec(out, specs))
    return block * (wanted - held) // wanted if wanted > held else 0


COLLECTIVE_RULES: dict[jx.core.Primitive, CollectiveRule] = {
    _lax.dot_general_p: _contracted,
    **{p: _reduced for p in REDUCTIONS},
    **{p: _regathered for p in (_lax.reshape_p, _lax.transpose_p, jx.pjit.sharding_constraint_p,
                                _lax.convert_element_type_p, _lax.copy_p, _lax.squeeze_p)},
}


def collective_bytes(eqn: Any, specs: dict, layout: MeshLayout) -> int:
    """The bytes one device moves over the interconnect when ``eqn`` runs once, as SPMD
    partitioning lowers it under the propagated ``specs``.

    Two kinds, each of which a recomputation repeats: the all-reduce of partial sums
    (``_contracted``, ``_reduced``) and the gather of a value whose split an equation
    that only moves elements cannot keep (``_regathered``). A gather of a dot's operand
    is not counted: the gradient reads that operand too and XLA gathers it once for both
    (``solver.collectives``)."""
    rule = COLLECTIVE_RULES.get(eqn.primitive)
    return 0 if rule is None or not eqn.outvars else rule(eqn, specs, layout)
