"""One ``lax.scan``'s layers in consecutive groups, each checkpointed by its own policy.

On a scan every layer runs the same body, so one policy per stack gives every
layer the same saves, and the frontier moves in steps of L x a tensor: a budget
between two steps is answered by the step below it. Layers planned apart fill
it: the first layers take the leaner policy, the last the one that saves more.

Placing that as one ``lax.scan`` per group over a slice of the stacked
operands costs what it saves: XLA copies each slice (the backward pass reads
it, so it lives through the step) and assembles the gradient from the groups'
pieces. Measured on the 8-layer Llama of issue 39 (jax 0.10.2, CPU; 21.14 MiB
of parameters): ``nothing_saveable`` in two scans of 4 layers peaks at 140.01
MiB against 110.92 in one; reading the layers' parameters by index from the
whole array instead (a scan over layer indices) still peaks at 133.44, since
each group's backward accumulates a gradient of the whole array. The same two
scans over parameters split *before* the step measure 110.92: the cost is the
slices and the gradient's assembly, not the groups.

So ``grouped_scan`` runs the groups under one ``jax.custom_vjp`` whose forward
pass reads each layer's operands by index from the whole stacked arrays and
keeps what each layer's checkpoint keeps, as JAX's scan keeps it: the residuals
that are the layer's own operands or the scan's constants are read again by
index, the loop-invariant ones (a causal mask, RoPE tables) are computed once
before the loop, and the rest are stacked. Its backward pass walks the groups in
reverse, rebuilding each layer's VJP from those and writing its gradient into one
buffer for the whole stack. Measured on the same stack: ``nothing_saveable`` in
two groups 110.92 MiB, as one scan; ``nothing_saveable`` on layers 0-3 and
``dots_saveable`` on layers 4-7 162.63 MiB (the other order 178.42: the last
group's backward runs first, with every residual live, so the group that saves
more goes last); gradients equal to the bit, and ``saved_residuals`` lists what
the one scan's plans list, each group's own. One group is placed as JAX's own
scan, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import optiremat.client._jax_internals as jx
from optiremat.client.extract.known import known_outputs

# One layer: (consts, carry, x) -> (carry, y), each a list of arrays.
Layer = Callable[[list, list, list], tuple[list, list]]


@dataclass(frozen=True)
class _Residuals:
    """What one layer's VJP keeps, leaf by leaf (its tree's leaves, in order): stacked
    over the group's layers, read again from the layer's operands (``forwarded``: leaf,
    index into consts + x), or computed once before the loop (``hoisted``: the leaves
    that depend on no carry and no layer operand, as JAX's scan hoists them)."""

    tree: Any
    jaxpr: Any  # closed: (consts, carry, x) -> leaves
    stacked: list[int]
    forwarded: list[tuple[int, int]]
    hoisted: list[int]

    @classmethod
    def of(cls, layer: Layer, consts: list, carry: list, x: list) -> _Residuals:
        trees = []

        def leaves_of(k: list, c: list, x: list) -> list:
            leaves, tree = jax.tree_util.tree_flatten(jax.vjp(layer, k, c, x)[1])
            trees.append(tree)
            return leaves

        closed = jax.make_jaxpr(leaves_of)(consts, carry, x)
        nk, nc = len(consts), len(carry)
        invars = closed.jaxpr.invars
        operand_at = {v: o for o, v in enumerate(invars[:nk])}
        operand_at.update({v: nk + o for o, v in enumerate(invars[nk + nc:])})
        # Known with the constants known and the carry and the layer's operands not:
        # what partial evaluation of JAX's scan finds loop-invariant.
        invariant = known_outputs(closed.jaxpr, [True] * nk + [False] * (len(invars) - nk))
        stacked, forwarded, hoisted = [], [], []
        for j, (out, fixed) in enumerate(zip(closed.jaxpr.outvars, invariant, strict=True)):
            if not isinstance(out, jx.Literal) and out in operand_at:
                forwarded.append((j, operand_at[out]))
            elif fixed:
                hoisted.append(j)
            else:
                stacked.append(j)
        return cls(trees[0], closed, stacked, forwarded, hoisted)

    def hoisted_values(self, consts: list, carry: list, x: list) -> list:
        outs = jx.eval_jaxpr(self.jaxpr.jaxpr, self.jaxpr.consts, *consts, *carry, *x)
        return [outs[j] for j in self.hoisted]

    def vjp(self, stacked: Sequence, hoisted: Sequence, operands: Sequence) -> Callable:
        """The layer's VJP function, rebuilt from its leaves."""
        leaves: list = [None] * (len(self.stacked) + len(self.forwarded) + len(self.hoisted))
        for j, leaf in zip(self.stacked, stacked, strict=True):
            leaves[j] = leaf
        for j, leaf in zip(self.hoisted, hoisted, strict=True):
            leaves[j] = leaf
        for j, o in self.forwarded:
            leaves[j] = operands[o]
        return jax.tree_util.tree_unflatten(self.tree, leaves)


def grouped_scan(groups: Sequence[tuple[int, Layer]], consts: Sequence, init: Sequence,
                 xs: Sequence, unroll: int | bool = 1) -> tuple[list, list]:
    """``lax.scan`` of the layers in ``groups`` (``(layers, layer)`` in program order,
    ``layer`` already checkpointed with its group's policy) over ``xs`` stacked along
    their leading axis: the final carry and the stacked per-layer outputs."""
    sizes = [n for n, _ in groups]
    layers = [f for _, f in groups]
    starts = [int(s) for s in np.cumsum([0, *sizes[:-1]])]
    # Per group, what one layer's VJP keeps: found while the forward pass traces.
    kept: dict[int, _Residuals] = {}

    def forward(consts: list, init: list, xs: list) -> tuple[list, list, list]:
        carry, ys_parts, residuals = list(init), [], []
        for g, (start, size, layer) in enumerate(zip(starts, sizes, layers, strict=True)):
            first = _layer_slice(xs, start)
            what = kept[g] = _Residuals.of(layer, consts, carry, first)
            hoisted = what.hoisted_values(consts, carry, first)

            def body(carry: Any, i: Any, layer: Layer = layer,
                     what: _Residuals = what) -> tuple[Any, Any]:
                out, vjp = jax.vjp(layer, consts, carry, _layer_slice(xs, i))
                leaves = jax.tree_util.tree_leaves(vjp)
                return out[0], (out[1], [leaves[j] for j in what.stacked])

            carry, (ys, stacked) = lax.scan(body, carry, jnp.arange(start, start + size),
                                            unroll=unroll)
            ys_parts.append(ys)
            residuals.append((stacked, hoisted))
        ys = [jnp.concatenate(parts) if len(parts) > 1 else parts[0]
              for parts in zip(*ys_parts, strict=True)]
        return carry, ys, residuals

    @jax.custom_vjp
    def run(consts: list, init: list, xs: list) -> tuple[list, list]:
        carry, ys, _ = forward(consts, init, xs)
        return carry, ys

    def run_fwd(consts: list, init: list, xs: list) -> tuple[tuple[list, list], Any]:
        carry, ys, residuals = forward(consts, init, xs)
        # Only the operands some layer's VJP reads again are kept: as JAX's scan does, so
        # that saved_residuals lists what the one scan's plans list.
        read = {o for what in kept.values() for _, o in what.forwarded}
        nk = len(consts)
        return (carry, ys), ([c if o in read else None for o, c in enumerate(consts)],
                             [x if nk + o in read else None for o, x in enumerate(xs)],
                             residuals)

    def run_bwd(saved: Any, cotangents: Any) -> tuple[list, list, list]:
        consts, xs, residuals = saved
        ct_carry, ct_ys = cotangents
        # Only inexact values have cotangents to carry through the loops: integer and
        # boolean ones are float0 zeros, made where they are needed.
        dk, dc, dx = (_inexact(v) for v in (const_types, init, xs_types))
        ct_consts = [jnp.zeros(const_types[j].shape, const_types[j].dtype) for j in dk]
        ct_xs = [jnp.zeros(xs_types[j].shape, xs_types[j].dtype) for j in dx]
        ct_carry = [ct_carry[j] for j in dc]
        for g in reversed(range(len(groups))):
            what, (stacked, hoisted) = kept[g], residuals[g]
            start, size = starts[g], sizes[g]

            def body(state: Any, step: Any, what: _Residuals = what,
                     hoisted: list = hoisted) -> tuple[Any, None]:
                ct_carry, ct_consts, ct_xs = state
                i, stacked, ct_y = step
                vjp = what.vjp(stacked, hoisted, [*consts, *_layer_slice(xs, i)])
                d_consts, d_carry, d_x = vjp((_spread(ct_carry, dc, init), ct_y))
                ct_consts = [a + d_consts[j] for a, j in zip(ct_consts, dk, strict=True)]
                ct_xs = [lax.dynamic_update_index_in_dim(b, d_x[j].astype(b.dtype), i, 0)
                         for b, j in zip(ct_xs, dx, strict=True)]
                return ([d_carry[j] for j in dc], ct_consts, ct_xs), None

            ct_ys_group = [_layer_range(y, start, size) for y in ct_ys]
            (ct_carry, ct_consts, ct_xs), _ = lax.scan(
                body, (ct_carry, ct_consts, ct_xs),
                (jnp.arange(start, start + size), stacked, ct_ys_group),
                reverse=True, unroll=unroll)
        return (_spread(ct_consts, dk, const_types), _spread(ct_carry, dc, init),
                _spread(ct_xs, dx, xs_types))

    # The operands' types, for the cotangents of those the backward pass does not read.
    const_types = [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in consts]
    xs_types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs]
    run.defvjp(run_fwd, run_bwd)
    carry, ys = run(list(consts), list(init), list(xs))
    return list(carry), list(ys)


def _layer_slice(xs: Sequence, i: Any) -> list:
    """Layer ``i``'s slice of each stacked operand (None where the operand is not kept)."""
    return [None if x is None else lax.dynamic_index_in_dim(x, i, keepdims=False) for x in xs]


def _layer_range(y: Any, start: int, size: int) -> Any:
    if _is_float0(y):
        return np.zeros((size, *y.shape[1:]), y.dtype)
    return lax.slice_in_dim(y, start, start + size)


def _is_float0(x: Any) -> bool:
    return getattr(x, "dtype", None) == jax.dtypes.float0


def _inexact(values: Sequence) -> list[int]:
    """The positions of the values that have cotangents of their own type."""
    return [j for j, v in enumerate(values) if jnp.issubdtype(v.dtype, jnp.inexact)]


def _spread(cotangents: Sequence, at: Sequence[int], like: Sequence) -> list:
    """Cotangents of ``like``: ``cotangents`` at the positions ``at``, float0 zeros at
    the others."""
    out: list = [np.zeros(v.shape, jax.dtypes.float0) for v in like]
    for j, ct in zip(at, cotangents, strict=True):
        out[j] = ct
    return out
