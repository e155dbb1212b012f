"""Where a plan puts its remat regions, and the function rebuilt with them.

One ``jax.checkpoint`` around a whole training step leaves the step's peak
where it was: the backward pass recomputes the whole forward pass at once
(measured on a 16-layer ``lax.scan`` stack: 695 MiB of temporaries before and
after cutting residuals from 704 to 54 MiB). A checkpoint around the body of
the scan, applied per iteration, recomputes one layer at a time and brings
the same stack to 74 MiB. So a plan is a placement: a *region* is the body of
a differentiated ``lax.scan`` (the layers of a model, as MaxText and the
``nnx.scan``/``eqx`` idioms write them), checkpointed per iteration with the
plan's policy.

``find_regions`` lists a traced function's regions in program order, looking
through call-like equations (``jit``, ``closed_call``, ``custom_jvp_call``'s
outer call is not entered: JAX differentiates its rule, not its body).
``place`` evaluates the function's jaxpr with each region's scan rebuilt as
``lax.scan`` over ``jax.checkpoint(body, policy=..., prevent_cse=False)``.
``prevent_cse`` is off because the loop already keeps XLA from merging the
recomputation with the forward pass, and the optimization barrier it adds
would stop XLA from fusing across it (JAX's advice for checkpoints in scans).
A checkpoint the user wrote inside a region (``nnx.remat``) is inlined: the
plan's policy governs the whole region.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import optiremat.client._jax_internals as jx
from optiremat.client.cost_model import aval_bytes
from optiremat.client.extract.tracing import Traced, trace
from optiremat.client.primitives import Role, info
from optiremat.client.sharding import MeshLayout, Spec
from optiremat.solver.errors import OptirematError

if TYPE_CHECKING:
    from optiremat.client.step import Step

# The name a layer's input takes inside its checkpoint when a plan may offload it:
# JAX offers a checkpoint's inputs to no policy, so the stacked layer inputs a scan
# keeps for its backward pass could never leave the device (jax#23869); named, the
# layers read the named value, and offloading it leaves the input itself unread.
LAYER_INPUT = "optiremat/layer_input"

# Control flow whose body JAX may run a data-dependent number of times: a scan
# inside one cannot be given a static place (nor a predictable peak).
UNPLACEABLE_PARENTS = {Role.COND: "cond", Role.WHILE: "while_loop"}

Policy = Callable[..., Any]


class PlacementError(OptirematError, ValueError):
    """The function's structure cannot take the plan's regions; names the equation."""


@dataclass(frozen=True)
class Region:
    """The body of one differentiated ``lax.scan``, checkpointed per iteration."""

    index: int  # program order: the order in which ``place`` meets scans
    length: int
    source: str  # the scan's place in the user's code
    num_consts: int
    num_carry: int
    body: jx.ClosedJaxpr  # the scan's body: (consts, carry, x) -> (carry, y)
    differentiated: tuple[bool, ...]  # per operand of the scan: whether it has a tangent
    reverse: bool = False
    # On a mesh: its layout and, per operand of the body (one layer's), its spec.
    layout: MeshLayout | None = None
    operand_specs: tuple[Spec | None, ...] | None = None

    def operand_bytes(self, i: int) -> int:
        """What one device holds of the body's ``i``-th operand (one layer's)."""
        aval = self.body.in_avals[i]
        if self.layout is None or self.operand_specs is None:
            return aval_bytes(aval)
        return self.layout.shard_bytes(aval, self.operand_specs[i])

    @property
    def carry_avals(self) -> list:
        """One layer's input: the types of the scan's carry."""
        return list(self.body.in_avals[self.num_consts:self.num_consts + self.num_carry])

    @property
    def carry_bytes(self) -> int:
        """One layer's input: the bytes of the scan's carry (one device's)."""
        return sum(self.operand_bytes(i)
                   for i in range(self.num_consts, self.num_consts + self.num_carry))

    @property
    def xs_bytes(self) -> int:
        """One layer's slice of the scan's stacked operands (its parameters)."""
        return sum(self.operand_bytes(i)
                   for i in range(self.num_consts + self.num_carry, len(self.body.in_avals)))

    @property
    def xs_gradient_bytes(self) -> int:
        """One layer's slice of the gradients of the stacked operands."""
        first = self.num_consts + self.num_carry
        return sum(self.operand_bytes(i) for i in range(first, len(self.body.in_avals))
                   if self.differentiated[i])

    @property
    def signature(self) -> tuple:
        """What must match when a plan is applied: the length and the body's types."""
        return (self.length, self.num_consts, self.num_carry, self.differentiated,
                tuple(str(a) for a in self.body.in_avals),
                tuple(str(a) for a in self.body.out_avals))


@dataclass(frozen=True)
class RegionMarker:
    """The policy of a region while it is extracted: the walker recognises its
    checkpoints by this object and leaves their equations to the solver."""

    index: int

    def __call__(self, prim, *avals, **params):  # never consulted: extraction only traces
        return jx.Recompute


def _called(eqn) -> jx.ClosedJaxpr:
    """The body of a call-like equation, with its consts."""
    inner = eqn.params[info(eqn.primitive).body]
    return inner if isinstance(inner, jx.ClosedJaxpr) else jx.ClosedJaxpr(inner, ())


def _differentiated_outputs(eqn, ins: Sequence[bool]) -> list[bool]:
    """An output carries a tangent when some input does and it is a float."""
    any_in = any(ins)
    return [any_in and bool(jnp.issubdtype(v.aval.dtype, jnp.inexact)) for v in eqn.outvars]


def _is_region(eqn, ins: Sequence[bool]) -> bool:
    """A differentiated scan that runs: a scan of length 0 is left as it is, for the
    extraction to refuse with its place in the user's code."""
    return info(eqn.primitive).role == Role.SCAN and any(ins) and int(eqn.params["length"]) > 0


def _walk(jaxpr: jx.Jaxpr, differentiated: Sequence[bool], found: list[Region],
          inside: str | None) -> list[bool]:
    env = dict(zip(jaxpr.invars, differentiated, strict=True))

    def read(x) -> bool:
        return False if isinstance(x, jx.Literal) else env.get(x, False)

    for eqn in jaxpr.eqns:
        ins = [read(x) for x in eqn.invars]
        role = info(eqn.primitive).role
        if role == Role.CALL:
            outs = _walk(_called(eqn).jaxpr, ins, found, inside)
        elif _is_region(eqn, ins):
            if inside is not None:
                raise PlacementError(
                    f"a differentiated lax.scan at {jx.source_of(eqn)} sits inside a {inside}: "
                    "its layers cannot be given remat regions. Move the scan out of the "
                    f"{inside}, or plan with memory='residuals'.")
            found.append(_region(len(found), eqn, ins))
            outs = _differentiated_outputs(eqn, ins)
        elif role in UNPLACEABLE_PARENTS and any(ins):
            for sub in _subjaxprs(eqn):
                _walk(sub, [True] * len(sub.invars), found, UNPLACEABLE_PARENTS[role])
            outs = _differentiated_outputs(eqn, ins)
        else:
            outs = _differentiated_outputs(eqn, ins)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(x) for x in jaxpr.outvars]


def _region(index: int, eqn, differentiated: Sequence[bool]) -> Region:
    p = eqn.params
    return Region(index, int(p["length"]), jx.source_of(eqn), *jx.scan_counts(p),
                  p["jaxpr"], tuple(differentiated), bool(p["reverse"]))


def _subjaxprs(eqn) -> list[jx.Jaxpr]:
    if info(eqn.primitive).role == Role.COND:
        return [b.jaxpr for b in eqn.params["branches"]]
    return [eqn.params["body_jaxpr"].jaxpr, eqn.params["cond_jaxpr"].jaxpr]


def find_regions(closed: jx.ClosedJaxpr, differentiated: Sequence[bool]) -> list[Region]:
    """The regions of a traced function whose inputs ``differentiated`` get tangents.

    Raises PlacementError for a differentiated scan that cannot be placed (one
    inside a ``cond`` or ``while_loop``).
    """
    found: list[Region] = []
    _walk(closed.jaxpr, differentiated, found, None)
    return found


# ---- the function rebuilt with its regions ------------------------------------


@dataclass
class _Placer:
    policies: Sequence[Policy]
    regions: Sequence[Region]
    groups: Sequence[int]  # per region: 1 checkpoints each layer; k > 1 also k groups of them
    name_inputs: bool = False  # offer each layer's input to the policy (``LAYER_INPUT``)
    next_region: int = 0

    def eval(self, jaxpr: jx.Jaxpr, consts: Sequence, args: Sequence,
             differentiated: Sequence[bool]) -> list:
        env: dict = {}
        flags: dict = {}

        def read(x):
            return x.val if isinstance(x, jx.Literal) else env[x]

        def flag(x) -> bool:
            return False if isinstance(x, jx.Literal) else flags.get(x, False)

        env.update(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        flags.update(zip(jaxpr.invars, differentiated, strict=True))
        for eqn in jaxpr.eqns:
            invals = [read(x) for x in eqn.invars]
            ins = [flag(x) for x in eqn.invars]
            role = info(eqn.primitive).role
            if role == Role.CALL and self._has_region(eqn, ins):
                inner = _called(eqn)
                outs = self.eval(inner.jaxpr, inner.consts, invals, ins)
            elif _is_region(eqn, ins):
                outs = self._placed_scan(eqn, invals, ins)
            else:
                outs = jx.bind_equation(eqn, invals)
            env.update(zip(eqn.outvars, outs, strict=True))
            flags.update(zip(eqn.outvars, _differentiated_outputs(eqn, ins), strict=True))
        return [read(x) for x in jaxpr.outvars]

    def _has_region(self, eqn, ins: Sequence[bool]) -> bool:
        found: list[Region] = []
        _walk(_called(eqn).jaxpr, ins, found, None)
        return bool(found)

    def _placed_scan(self, eqn, invals: Sequence, ins: Sequence[bool]) -> list:
        k = self.next_region
        self.next_region += 1
        if k >= len(self.regions):
            raise PlacementError(
                f"lax.scan at {jx.source_of(eqn)} is region {k} but the plan has "
                f"{len(self.regions)}: the function traced differently from when it was planned")
        p = eqn.params
        region = self.regions[k]
        here = _region(k, eqn, ins)
        if here.signature != region.signature:
            raise PlacementError(
                f"lax.scan at {here.source} does not match region {k} of the plan (planned at "
                f"{region.source}): shapes or length differ; plan again for these arguments")
        body = p["jaxpr"]
        n_consts, n_carry = jx.scan_counts(p)
        consts = list(invals[:n_consts])
        init, xs = list(invals[n_consts:n_consts + n_carry]), list(invals[n_consts + n_carry:])

        def layer(*inputs):
            if self.name_inputs:
                inputs = (*inputs[:n_consts],
                          *(checkpoint_name(c, LAYER_INPUT) for c in
                            inputs[n_consts:n_consts + n_carry]),
                          *inputs[n_consts + n_carry:])
            return _inline_checkpoints(body.jaxpr, body.consts, inputs)

        checkpointed = jx.checkpoint(layer, policy=self.policies[k], prevent_cse=False)

        def step(carry, x):
            out = checkpointed(*consts, *carry, *x)
            return list(out[:n_carry]), list(out[n_carry:])

        length = int(p["length"])
        # The rebuilt scan keeps the user's scan's place in their code (what explain and
        # error messages name), not this line's.
        with jx.user_context_of(eqn):
            if self.groups[k] == 1:
                carry, ys = lax.scan(step, init, xs, length=length, reverse=p["reverse"],
                                     unroll=p["unroll"])
                return [*carry, *ys]
            return _grouped_scan(step, init, xs, length, self.groups[k], p["unroll"])


def divisors(length: int) -> list[int]:
    """The group counts a scan of ``length`` layers can take."""
    return [k for k in range(1, length + 1) if length % k == 0]


def check_groups(region: Region, groups: int) -> None:
    """Refuse a group count the scan cannot take, naming the ones it can."""
    if groups == 1:
        return
    if region.reverse:
        raise PlacementError(f"the lax.scan at {region.source} runs in reverse: its layers "
                             "can only be checkpointed one by one (groups=1)")
    if groups not in divisors(region.length):
        # A remainder group slices the stacked parameters, and XLA copies the slice:
        # +45 to +58 MiB on a 64-layer stack whose nesting saves 39 MiB (bench/peak.py).
        raise PlacementError(
            f"{groups} groups of the {region.length} layers of the lax.scan at {region.source} "
            f"leave a remainder, whose slice XLA copies; it takes {divisors(region.length)}")


def _grouped_scan(step: Callable, init: list, xs: list, length: int, groups: int,
                  unroll: int | bool) -> list:
    """The scan as an outer scan over ``groups`` rematerialised groups of layers.

    Only each group's input is kept for the backward pass; a group's layers are
    recomputed (under their own checkpoint) when its backward pass comes. The
    stacked operands are reshaped to ``[groups, layers per group, ...]``, which
    XLA does for free.
    """
    per_group = length // groups

    def group(carry, xs_group):
        return lax.scan(step, carry, xs_group, length=per_group, unroll=unroll)

    rematerialised = jx.checkpoint(group, policy=jax.checkpoint_policies.nothing_saveable,
                                   prevent_cse=False)
    grouped = [x.reshape(groups, per_group, *x.shape[1:]) for x in xs]
    carry, ys = lax.scan(rematerialised, init, grouped, length=groups)
    return [*carry, *(y.reshape(length, *y.shape[2:]) for y in ys)]


def _inline_checkpoints(jaxpr: jx.Jaxpr, consts: Sequence, args: Sequence) -> list:
    """Evaluate a region's body with the user's own checkpoints inlined."""
    env: dict = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(x):
        return x.val if isinstance(x, jx.Literal) else env[x]

    for eqn in jaxpr.eqns:
        invals = [read(x) for x in eqn.invars]
        if info(eqn.primitive).role == Role.CHECKPOINT:
            inner = _called(eqn)
            outs = _inline_checkpoints(inner.jaxpr, inner.consts, invals)
        else:
            outs = jx.bind_equation(eqn, invals)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(x) for x in jaxpr.outvars]


def place(closed: jx.ClosedJaxpr, args: Sequence, regions: Sequence[Region],
          policies: Sequence[Policy], differentiated: Sequence[bool],
          groups: Sequence[int] | None = None, name_inputs: bool = False) -> list:
    """Evaluate ``closed`` at ``args`` with each region checkpointed by its policy (and,
    where ``groups`` says k > 1, in k rematerialised groups of layers); ``differentiated``
    flags the inputs that get tangents, as ``find_regions`` took them. With
    ``name_inputs``, each layer's input is named ``LAYER_INPUT`` inside its checkpoint,
    so that the policy is offered it (to offload it)."""
    groups = [1] * len(regions) if groups is None else list(groups)
    if not len(policies) == len(groups) == len(regions):
        raise ValueError(f"{len(regions)} regions but {len(policies)} policies and "
                         f"{len(groups)} group counts")
    for region, k in zip(regions, groups, strict=True):
        check_groups(region, k)
    placer = _Placer(policies, regions, groups, name_inputs)
    outs = placer.eval(closed.jaxpr, closed.consts, args, differentiated)
    if placer.next_region != len(regions):
        raise PlacementError(
            f"the function has {placer.next_region} differentiated lax.scan(s) but the plan "
            f"placed {len(regions)}: it traced differently from when it was planned")
    return outs


@dataclass(frozen=True)
class Placement:
    """Where a peak plan checkpoints: its regions and the step they were found in."""

    regions: tuple[Region, ...]
    differentiated: tuple[bool, ...]  # per flattened argument, as the step differentiates
    step: Step
    name_inputs: bool = False  # layer inputs offered to the policy (offload plans)

    def apply(self, fun: Callable, policy: Policy,
              groups: Sequence[int] | None = None) -> Callable:
        """``fun`` with every region checkpointed by ``policy`` (in ``groups[r]``
        rematerialised groups of layers where that is more than 1): same signature and
        outputs. Like ``jax.jit``, ``fun`` is traced once per structure and types of its
        arguments and the jaxpr reused (not where it closes over another trace's values)."""
        jaxprs = TraceCache(fun)

        @functools.wraps(fun)
        def placed(*args, **kwargs):
            traced = jaxprs.traced(args, kwargs)
            if len(traced.flat_args) != len(self.differentiated):
                raise PlacementError(
                    f"the plan was made for {len(self.differentiated)} array arguments, the "
                    f"function got {len(traced.flat_args)}")
            return self.evaluate(traced, jax.tree_util.tree_leaves((args, kwargs)), policy,
                                 groups)

        return placed

    def evaluate(self, traced: Traced, leaves: Sequence, policy: Policy,
                 groups: Sequence[int] | None = None) -> Any:
        """``traced``'s function at the flat arguments ``leaves`` with every region
        checkpointed by ``policy``: its outputs, as the function returns them."""
        closed = jx.ClosedJaxpr(traced.open_jaxpr, traced.consts)
        out = place(closed, leaves, self.regions, [policy] * len(self.regions),
                    self.differentiated, groups, self.name_inputs)
        return jax.tree_util.tree_unflatten(traced.out_tree, out)


class TraceCache:
    """``fun`` traced once per tree structure and types (``jax.typeof``) of its arguments."""

    def __init__(self, fun: Callable) -> None:
        self.fun = fun
        self._traced: dict[Any, Traced] = {}

    def traced(self, args: Sequence, kwargs: dict) -> Traced:
        leaves, tree = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)))
        key = (tree, tuple(jax.typeof(x) for x in leaves))
        found = self._traced.get(key)
        if found is None:
            found = trace(self.fun, args, kwargs)
            # A jaxpr holding a value of an enclosing trace (a closed-over tracer) is that
            # trace's alone: reused in another it would leak the tracer.
            if not any(isinstance(c, jax.core.Tracer) for c in found.consts):
                self._traced[key] = found
        return found
