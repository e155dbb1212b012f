"""What optiremat knows about each JAX primitive, in one table keyed by the primitive.

JAX keeps its rules per primitive in tables keyed by ``Primitive`` objects
(``partial_eval_jaxpr_custom_rules``, ``primitive_linearizations``). One entry
here gathers everything this project needs of one primitive, side by side:

* its **role** in extraction: a plain equation, or which control-flow object of
  ``client.interpreter`` runs it (a call flattened where it stands, a nested
  checkpoint, a scan, a cond, a while loop), whose hooks and declared facts the
  walk, the known-outputs pass and the finding of remat regions follow;
* where its **body** is (the parameter holding a call's jaxpr);
* where JAX **offers the policy** inside it (the sub-jaxprs the names form tags);
* its **FLOPs** (the cost model, ``client.cost_model``):

| primitive family | FLOPs |
|---|---|
| ``dot_general`` | 2 x output elements x contracted size |
| ``conv_general_dilated`` | 2 x multiply-adds on real (unpadded) input |
| elementwise arithmetic, comparisons, selects, casts | 1 per output element |
| ``one_minus_square`` (JAX 0.12: ``1 - x**2``) | 2 per output element |
| transcendentals (``exp``, ``tanh``, ``erf``, ...) | 1 per output element |
| reductions, ``argmax``/``argmin`` | 1 per input element |
| cumulative ops (``cumsum``, ...) | 1 per input element |
| ``scatter-add``/``-sub``/``-mul``/``-min``/``-max`` | 1 per update element |
| ``sort`` | n log2 n per sorted row |
| layout ops (reshape, transpose, slice, gather, scatter, pad, ...) | 0 |
| ``scan`` | length x body |
| ``cond`` | the most expensive branch |
| ``while`` | one trip of cond + body (the trip count is dynamic) |
| call-like (``jit``, ``closed_call``, ``custom_jvp_call``, ...) | the inner jaxpr |
| ``custom_lin`` (a custom VJP's linear part) | 0: its transpose is priced |

Entries name primitives as objects, imported from JAX in ``_jax_internals``: a
primitive JAX renames or drops fails at import instead of silently never
matching. A primitive not in the table is treated as elementwise (a plain
node, one FLOP per output element); the tests check that every primitive the
corpora meet, forward and backward, has an entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import optiremat.client._jax_internals as jx
from optiremat.client._jax_internals import ClosedJaxpr, Jaxpr, core


class Role(Enum):
    """How extraction treats a primitive's equations."""

    PLAIN = "plain"  # one node when its inputs are known, staged when not
    CALL = "call"  # its body is walked where it stands (same policy, residuals forwarded)
    CHECKPOINT = "checkpoint"  # a nested jax.checkpoint: flattened, or a plan's region
    SCAN = "scan"
    COND = "cond"
    WHILE = "while"


FlopRule = Callable[[core.JaxprEqn], int]


@dataclass(frozen=True)
class PrimitiveInfo:
    role: Role
    flops: FlopRule
    body: str | None = None  # the parameter holding a call's jaxpr
    policy_jaxprs: tuple[str, ...] = ()  # parameters whose jaxprs JAX offers the policy


# ---- FLOP rules ------------------------------------------------------------------


def shape(atom: core.Atom) -> tuple[int, ...]:
    """The shape of a jaxpr variable or literal (scalars and tokens: ``()``)."""
    return tuple(getattr(atom.aval, "shape", ()))


def _size(aval: core.AbstractValue) -> int:
    return int(math.prod(getattr(aval, "shape", ())))


def per_output_element(eqn: core.JaxprEqn) -> int:
    if not eqn.outvars or not all(hasattr(v.aval, "shape") for v in eqn.outvars):
        return 0
    return sum(_size(v.aval) for v in eqn.outvars)


def two_per_output_element(eqn: core.JaxprEqn) -> int:
    return 2 * per_output_element(eqn)


def free(eqn: core.JaxprEqn) -> int:
    return 0


def per_input_element(eqn: core.JaxprEqn) -> int:
    return sum(_size(v.aval) for v in eqn.invars if not isinstance(v, core.Literal))


def per_update_element(eqn: core.JaxprEqn) -> int:
    return _size(eqn.invars[2].aval)  # scatter operands: (operand, indices, updates)


def dot_general(eqn: core.JaxprEqn) -> int:
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = shape(eqn.invars[0])
    contracted = math.prod(lhs[d] for d in lhs_contract)
    return 2 * per_output_element(eqn) * int(contracted)


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


def conv_general_dilated(eqn: core.JaxprEqn) -> int:
    """2 x multiply-adds that touch real input (padding excluded, as XLA counts)."""
    lhs, rhs, out = shape(eqn.invars[0]), shape(eqn.invars[1]), shape(eqn.outvars[0])
    p = eqn.params
    dn = p["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    macs = out[out_spec[0]] * out[out_spec[1]] * rhs[rhs_spec[1]]
    macs //= max(p.get("batch_group_count", 1), 1)
    for i in range(len(lhs_spec) - 2):
        macs *= _valid_taps(
            lhs[lhs_spec[2 + i]], out[out_spec[2 + i]], rhs[rhs_spec[2 + i]],
            p["window_strides"][i], p["padding"][i][0], p["lhs_dilation"][i],
            p["rhs_dilation"][i])
    return 2 * macs


def sort(eqn: core.JaxprEqn) -> int:
    dims = shape(eqn.invars[0])
    dim = eqn.params.get("dimension", len(dims) - 1)
    n = dims[dim] if dims else 1
    rows = math.prod(dims) // max(n, 1)
    return int(rows * n * max(math.ceil(math.log2(n)), 1)) if n > 1 else 0


def jaxpr_flops(jaxpr: Jaxpr) -> int:
    """FLOPs of one execution of ``jaxpr``."""
    return sum(info(e.primitive).flops(e) for e in jaxpr.eqns)


def _as_jaxpr(param) -> Jaxpr:
    return param.jaxpr if isinstance(param, ClosedJaxpr) else param


def _body(name: str) -> FlopRule:
    return lambda eqn: jaxpr_flops(_as_jaxpr(eqn.params[name]))


def scan(eqn: core.JaxprEqn) -> int:
    return int(eqn.params["length"]) * jaxpr_flops(eqn.params["jaxpr"].jaxpr)


def cond(eqn: core.JaxprEqn) -> int:
    return max(jaxpr_flops(b.jaxpr) for b in eqn.params["branches"])


def while_loop(eqn: core.JaxprEqn) -> int:
    p = eqn.params
    return jaxpr_flops(p["cond_jaxpr"].jaxpr) + jaxpr_flops(p["body_jaxpr"].jaxpr)


# ---- the table -------------------------------------------------------------------

_lax, _slicing, _loops = jx.lax_ops, jx.slicing, jx.loops

ELEMENTWISE = (
    _lax.abs_p, _lax.acos_p, _lax.acosh_p, _lax.add_p, _lax.and_p, _lax.asin_p, _lax.asinh_p,
    _lax.atan_p, _lax.atan2_p, _lax.atanh_p, _lax.cbrt_p, _lax.ceil_p, _lax.clamp_p,
    _lax.clz_p, _lax.complex_p, _lax.conj_p, _lax.convert_element_type_p, _lax.cos_p,
    _lax.cosh_p, _lax.div_p, _lax.eq_p, _lax.exp_p, _lax.exp2_p, _lax.expm1_p, _lax.floor_p,
    _lax.ge_p, _lax.gt_p, _lax.imag_p, _lax.integer_pow_p, _lax.is_finite_p, _lax.le_p,
    _lax.log_p, _lax.log1p_p, _lax.logistic_p, _lax.lt_p, _lax.max_p, _lax.min_p, _lax.mul_p,
    _lax.ne_p, _lax.neg_p, _lax.nextafter_p, _lax.not_p, _lax.or_p, _lax.population_count_p,
    _lax.pow_p, _lax.real_p, _lax.rem_p, _lax.round_p, _lax.rsqrt_p, _lax.select_n_p,
    _lax.shift_left_p, _lax.shift_right_arithmetic_p, _lax.shift_right_logical_p,
    _lax.sign_p, _lax.sin_p, _lax.sinh_p, _lax.sqrt_p, _lax.square_p, _lax.sub_p, _lax.tan_p,
    _lax.tanh_p, _lax.xor_p, jx.special.erf_p, jx.special.erf_inv_p, jx.special.erfc_p,
    jx.special.lgamma_p, jx.special.digamma_p, jx.ad_util.add_jaxvals_p,
)
# 1 - x^2 (0.12, in tanh's, asin's and atanh's derivatives): a multiply and a subtract.
TWO_PER_ELEMENT = tuple(jx.OPTIONAL_PRIMITIVES[name] for name in ("one_minus_square",)
                        if name in jx.OPTIONAL_PRIMITIVES)
LAYOUT = (
    _lax.reshape_p, _lax.broadcast_in_dim_p, _lax.transpose_p, _lax.squeeze_p,
    _lax.concatenate_p, _lax.pad_p, _lax.rev_p, _lax.copy_p, _lax.iota_p, _lax.split_p,
    _lax.empty2_p, _lax.reduce_precision_p, _lax.bitcast_convert_type_p,
    _lax.optimization_barrier_p, _slicing.slice_p, _slicing.dynamic_slice_p,
    _slicing.dynamic_update_slice_p, _slicing.gather_p, _slicing.scatter_p,
    jx.windowed_reductions.select_and_gather_add_p, jx.ad_util.stop_gradient_p, jx.name_p,
    jx.dispatch.device_put_p, jx.pjit.sharding_constraint_p, jx.pjit.reshard_p,
    jx.core.pvary_p, jx.prng.random_bits_p, jx.prng.random_seed_p, jx.prng.random_wrap_p,
    jx.prng.random_unwrap_p,
)
REDUCTIONS = (
    _lax.reduce_sum_p, _lax.reduce_max_p, _lax.reduce_min_p, _lax.reduce_prod_p,
    _lax.reduce_and_p, _lax.reduce_or_p, _lax.reduce_xor_p, _lax.argmax_p, _lax.argmin_p,
    _loops.cumsum_p, _loops.cumprod_p, _loops.cummax_p, _loops.cummin_p,
    _loops.cumlogsumexp_p,
)
SCATTER_COMBINE = (_slicing.scatter_add_p, _slicing.scatter_sub_p, _slicing.scatter_mul_p,
                   _slicing.scatter_min_p, _slicing.scatter_max_p)

REGISTRY: dict[core.Primitive, PrimitiveInfo] = {
    **{p: PrimitiveInfo(Role.PLAIN, per_output_element) for p in ELEMENTWISE},
    **{p: PrimitiveInfo(Role.PLAIN, two_per_output_element) for p in TWO_PER_ELEMENT},
    **{p: PrimitiveInfo(Role.PLAIN, free) for p in LAYOUT},
    **{p: PrimitiveInfo(Role.PLAIN, per_input_element) for p in REDUCTIONS},
    **{p: PrimitiveInfo(Role.PLAIN, per_update_element) for p in SCATTER_COMBINE},
    _lax.dot_general_p: PrimitiveInfo(Role.PLAIN, dot_general),
    jx.convolution.conv_general_dilated_p: PrimitiveInfo(Role.PLAIN, conv_general_dilated),
    _lax.sort_p: PrimitiveInfo(Role.PLAIN, sort),
    # JAX differentiates a custom rule, not the body: one equation, priced by its body.
    jx.custom_derivatives.custom_jvp_call_p:
        PrimitiveInfo(Role.PLAIN, _body("call_jaxpr"), body="call_jaxpr"),
    jx.custom_derivatives.custom_vjp_call_p:
        PrimitiveInfo(Role.PLAIN, _body("call_jaxpr"), body="call_jaxpr"),
    jx.ad.custom_lin_p: PrimitiveInfo(Role.PLAIN, free),
    jx.pjit.jit_p: PrimitiveInfo(Role.CALL, _body("jaxpr"), "jaxpr", ("jaxpr",)),
    jx.core.closed_call_p:
        PrimitiveInfo(Role.CALL, _body("call_jaxpr"), "call_jaxpr", ("call_jaxpr",)),
    jx.core.call_p: PrimitiveInfo(Role.CALL, _body("call_jaxpr"), "call_jaxpr", ("call_jaxpr",)),
    jx.remat_p: PrimitiveInfo(Role.CHECKPOINT, _body("jaxpr"), "jaxpr", ("jaxpr",)),
    _loops.scan_p: PrimitiveInfo(Role.SCAN, scan, policy_jaxprs=("jaxpr",)),
    jx.conditionals.cond_p: PrimitiveInfo(Role.COND, cond, policy_jaxprs=("branches",)),
    # JAX never offers the policy a while loop's equations.
    _loops.while_p: PrimitiveInfo(Role.WHILE, while_loop),
}
UNKNOWN = PrimitiveInfo(Role.PLAIN, per_output_element)


def info(primitive: core.Primitive) -> PrimitiveInfo:
    """The entry of ``primitive``; an unknown one counts as elementwise."""
    return REGISTRY.get(primitive, UNKNOWN)


def unknown_body(eqn: core.JaxprEqn) -> str | None:
    """The parameter naming a jaxpr in an equation whose primitive has no entry
    (``shard_map``, say): counted as one elementwise equation, whatever runs inside it
    would be missing from the graph, so extraction refuses it."""
    if eqn.primitive in REGISTRY:
        return None
    for name, param in eqn.params.items():
        values = param if isinstance(param, tuple | list) else (param,)
        if any(isinstance(v, Jaxpr | ClosedJaxpr) for v in values):
            return name
    return None


def body(eqn: core.JaxprEqn) -> Jaxpr:
    """The jaxpr a call-like equation runs."""
    name = info(eqn.primitive).body
    if name is None:
        raise ValueError(f"{eqn.primitive.name} has no body")
    return _as_jaxpr(eqn.params[name])
