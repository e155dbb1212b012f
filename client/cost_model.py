"""FLOPs per primitive: the project's one cost model.

Extraction prices every node with it, and the tests count the FLOPs of JAX's
backward jaxpr with it, so plan predictions and measurements use one scale.

| primitive family | FLOPs |
|---|---|
| ``dot_general`` | 2 x output elements x contracted size |
| ``conv_general_dilated`` | 2 x multiply-adds on real (unpadded) input |
| elementwise arithmetic, comparisons, selects, casts | 1 per output element |
| transcendentals (``exp``, ``tanh``, ``erf``, ...) | 1 per output element |
| reductions, ``argmax``/``argmin`` | 1 per input element |
| cumulative ops (``cumsum``, ...) | 1 per input element |
| ``scatter-add``/``-mul``/``-min``/``-max`` | 1 per update element |
| ``sort`` | n log2 n per sorted row |
| layout ops (reshape, transpose, slice, gather, scatter, pad, ...) | 0 |
| ``scan`` | length x body |
| ``cond`` | the most expensive branch |
| ``while`` | one trip of cond + body (the trip count is dynamic) |
| call-like (``jit``, ``closed_call``, ``custom_jvp_call``, ...) | the inner jaxpr |
| anything else | 1 per output element |
"""

from __future__ import annotations

import math

import numpy as np

from optiremat.client._jax_internals import ClosedJaxpr, Jaxpr, core

LAYOUT_OPS = frozenset({
    "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "slice",
    "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "rev", "copy", "copy_p",
    "iota", "gather", "scatter", "select_and_gather_add", "stop_gradient", "name",
    "device_put", "reduce_precision", "bitcast_convert_type", "split", "optimization_barrier",
    "random_bits", "random_seed", "random_wrap", "random_unwrap", "threefry2x32",
    "sharding_constraint", "mesh_cast", "reshard", "pvary", "squeeze_p", "full_like",
})
REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin",
    "cumlogsumexp", "reduce_precision_sum",
})
SCATTER_COMBINE = frozenset({"scatter-add", "scatter_add", "scatter-mul", "scatter_mul",
                             "scatter-min", "scatter_min", "scatter-max", "scatter_max"})
CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _size(aval) -> int:
    shape = getattr(aval, "shape", ())
    return int(math.prod(shape))


def _out_size(eqn: core.JaxprEqn) -> int:
    return sum(_size(v.aval) for v in eqn.outvars)


def _dot_general(eqn: core.JaxprEqn) -> int:
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    contracted = math.prod(lhs.shape[d] for d in lhs_contract)
    return 2 * _out_size(eqn) * int(contracted)


def _valid_taps(in_size: int, out_size: int, k_size: int, stride: int, pad_lo: int,
                lhs_dil: int, rhs_dil: int) -> int:
    """(output position, kernel tap) pairs that land on real input, not padding."""
    count = 0
    for o in range(out_size):
        for k in range(k_size):
            pos = o * stride - pad_lo + k * rhs_dil  # in the dilated, padded input
            if 0 <= pos <= (in_size - 1) * lhs_dil and pos % lhs_dil == 0:
                count += 1
    return count


def _conv(eqn: core.JaxprEqn) -> int:
    """2 x multiply-adds that touch real input (padding excluded, as XLA counts)."""
    lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
    out = eqn.outvars[0].aval
    p = eqn.params
    dn = p["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    macs = out.shape[out_spec[0]] * out.shape[out_spec[1]] * rhs.shape[rhs_spec[1]]
    macs //= max(p.get("batch_group_count", 1), 1)
    for i in range(len(lhs_spec) - 2):
        macs *= _valid_taps(
            lhs.shape[lhs_spec[2 + i]], out.shape[out_spec[2 + i]], rhs.shape[rhs_spec[2 + i]],
            p["window_strides"][i], p["padding"][i][0], p["lhs_dilation"][i],
            p["rhs_dilation"][i])
    return 2 * macs


def _sort(eqn: core.JaxprEqn) -> int:
    aval = eqn.invars[0].aval
    dim = eqn.params.get("dimension", len(aval.shape) - 1)
    n = aval.shape[dim] if aval.shape else 1
    rows = _size(aval) // max(n, 1)
    return int(rows * n * max(math.ceil(math.log2(n)), 1)) if n > 1 else 0


def _inner(param) -> Jaxpr | None:
    if isinstance(param, ClosedJaxpr):
        return param.jaxpr
    if isinstance(param, Jaxpr):
        return param
    return None


def eqn_flops(eqn: core.JaxprEqn) -> int:
    """FLOPs of one execution of ``eqn`` (nested jaxprs included)."""
    name = eqn.primitive.name
    p = eqn.params
    if name == "dot_general":
        return _dot_general(eqn)
    if name == "conv_general_dilated":
        return _conv(eqn)
    if name == "scan":
        return int(p["length"]) * jaxpr_flops(p["jaxpr"].jaxpr)
    if name == "cond":
        return max(jaxpr_flops(b.jaxpr) for b in p["branches"])
    if name == "while":
        return jaxpr_flops(p["cond_jaxpr"].jaxpr) + jaxpr_flops(p["body_jaxpr"].jaxpr)
    for key in CALL_PARAMS:
        inner = _inner(p.get(key))
        if inner is not None:
            return jaxpr_flops(inner)
    if name in LAYOUT_OPS:
        return 0
    if name in REDUCTIONS:
        return sum(_size(v.aval) for v in eqn.invars if not isinstance(v, core.Literal))
    if name in SCATTER_COMBINE:
        return _size(eqn.invars[2].aval)
    if name == "sort":
        return _sort(eqn)
    if name == "custom_lin":  # linear part of a custom_vjp: priced by its transpose
        return 0
    if not eqn.outvars or not all(hasattr(v.aval, "shape") for v in eqn.outvars):
        return 0
    return _out_size(eqn)


def jaxpr_flops(jaxpr: Jaxpr) -> int:
    return sum(eqn_flops(e) for e in jaxpr.eqns)


def aval_bytes(aval) -> int:
    """Bytes of one array of this abstract value (sub-byte dtypes round up)."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return 0
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys) know their own size
        itemsize = getattr(dtype, "itemsize", 0)
    return _size(aval) * int(itemsize)
