"""The walk: ``partial_eval_jaxpr_custom`` replayed over a JVP'd jaxpr.

Every equation whose inputs are all known becomes a graph node (decided as
the context says); the rest is the backward pass, recorded in the tangent
graph. Primitives that partial evaluation treats specially get a rule, reached
through their object in ``client.interpreter``: calls are flattened, a nested
checkpoint is flattened or (in a plan's step graph) hands its equations to
the solver, a scan's body is walked once and stacked over its length, a while
loop is one fixed node, a cond's branches are summarised alone
(``client.extract.cond``). The walk is the one driver's (``interpret``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import optiremat.client._jax_internals as jx
from optiremat.client.cost_model import eqn_flops
from optiremat.client.extract.cond import cond_rule as walk_cond
from optiremat.client.extract.known import scan_carry_known
from optiremat.client.extract.state import (
    CONSTANT,
    HALF_FLOATS,
    Context,
    Decide,
    ExtractionError,
    Ref,
    TangentGraph,
    decide_by,
    primal_mode,
)
from optiremat.client.interpreter import CONTROL_FLOW, ControlFlow, FixedConstants, interpret
from optiremat.client.keys import policy_key
from optiremat.client.peak.finding import RegionMarker
from optiremat.client.primitives import body, unknown_body
from optiremat.client.sharding import ONE_DEVICE, Layout
from optiremat.solver.graph import GraphBuilder, NodeMode


@dataclass
class Walker:
    builder: GraphBuilder
    decide: Decide
    branch_decide: Decide | None  # fixed decision inside cond branches; None: solver picks
    next_loop: int = 0
    keys_forced_save: set[str] = field(default_factory=set)
    branch_nodes: list[dict] = field(default_factory=list)  # offered to the policy in conds
    tangents: TangentGraph = field(default_factory=TangentGraph)
    names_by_key: dict[str, str] = field(default_factory=dict)  # checkpoint_name equations
    tie_groups: list[set[str]] = field(default_factory=list)  # keys that share one decision
    next_cond: int = 0
    # XLA on CPU in jax 0.10 computes half floats in f32 and widens stacked half
    # residuals for the backward pass: each costs about its size again (bench/peak.py);
    # whether it does is asked of XLA (``widens_stacked_halves``).
    widen_stacked_halves: bool = False
    # Its layout, and each variable's spec on a mesh (``Layout.variable_specs``), so that
    # a value weighs what one device holds of it.
    layout: Layout = ONE_DEVICE
    specs: dict = field(default_factory=dict)

    # ---- values and nodes -------------------------------------------------

    def new_value(self, aval, varying: frozenset[int], ctx: Context, var=None) -> int:
        copies = ctx.stacked(varying)
        nbytes = self.layout.value_bytes(aval, self.specs.get(var)) * copies
        dtype = str(getattr(aval, "dtype", ""))
        widened = self.widen_stacked_halves and copies > 1 and dtype in HALF_FLOATS
        stacked_by = ctx.region if ctx.region_loop in varying else None
        return self.builder.value(nbytes, tuple(getattr(aval, "shape", ())), dtype,
                                  extra=nbytes if widened else 0, region=stacked_by)

    def node(self, eqn, ins: Sequence[Ref], ctx: Context, mode: NodeMode, key: str,
             flops: int) -> list[Ref]:
        varying = frozenset().union(*(r.varying for r in ins))
        values = [self.new_value(v.aval, varying, ctx, v) for v in eqn.outvars]
        moved = self.layout.moved_bytes(eqn, self.specs)
        self.builder.node(
            eqn.primitive.name,
            [r.value for r in ins if r.value is not None],
            values,
            key=key, flops=flops * ctx.stacked(varying), mode=mode,
            repeat=ctx.stacked(varying), source=jx.source_of(eqn), batch_dims=batch_dims(eqn),
            region=ctx.region, collective_bytes=moved * ctx.stacked(varying),
        )
        return [Ref(v, True, varying) for v in values]

    def virtual(self, name: str, inputs: Sequence[int | None], out_avals: Sequence,
                varying: frozenset[int], ctx: Context, *, mode: NodeMode = NodeMode.RECOMPUTE,
                flops: int = 0, source: str = "", key: str = "",
                out_vars: Sequence | None = None) -> list[int]:
        """A node no policy decides: JAX's rule fixes what it does.

        A ``key`` marks work that exists only because of the policy (a cond
        branch recomputed under a names policy): ``everything_saveable``, the
        FLOPs baseline, would have saved it.
        """
        out_vars = out_vars if out_vars is not None else [None] * len(out_avals)
        outs = [self.new_value(a, varying, ctx, v)
                for a, v in zip(out_avals, out_vars, strict=True)]
        self.builder.node(name, sorted({v for v in inputs if v is not None}), outs, key=key,
                          flops=flops * ctx.stacked(varying), mode=mode,
                          repeat=ctx.stacked(varying), source=source, region=ctx.region)
        return outs

    def staged(self, refs: Sequence[Ref], num_out: int,
               extra_reads: Sequence[int] = ()) -> list[Ref]:
        """An equation of the backward pass: it reads tangents and primal values."""
        tangents_in = [r.value for r in refs if not r.known and r.value is not None]
        reads = [r.value for r in refs if r.known and r.value is not None] + list(extra_reads)
        return [Ref(t, False) for t in self.tangents.node(tangents_in, reads, num_out)]

    def finish(self, outs: Sequence[Ref]) -> None:
        """The backward pass needs the output tangents: mark what it reads."""
        sinks = [r.value for r in outs if not r.known and r.value is not None]
        self.builder.backward_reads.extend(self.tangents.live_primal_reads(sinks))

    def alone(self, decide: Decide) -> Walker:
        """A walker on a graph of its own that decides every equation by ``decide``, as
        a cond branch is summarised: it shares nothing with this walk."""
        return Walker(GraphBuilder(), decide, decide)

    # ---- the walk ---------------------------------------------------------

    def walk(self, jaxpr: jx.Jaxpr, ins: Sequence[Ref], ctx: Context) -> list[Ref]:
        """``jaxpr``'s outputs from its inputs' refs, its equations walked under ``ctx``."""
        return interpret(_Walk(self, ctx), jaxpr, ins)[0]

    def plain_eqn(self, eqn, refs: Sequence[Ref], ctx: Context) -> list[Ref]:
        """An equation that runs no jaxpr: a node when its inputs are known, else staged."""
        if (inner := unknown_body(eqn)) is not None:
            raise ExtractionError(
                f"{eqn.primitive.name} at {jx.source_of(eqn)} runs a jaxpr (its {inner!r}) "
                "that optiremat does not look inside yet, so the residuals and FLOPs of "
                "what runs there cannot be predicted. Plan the function it wraps (for "
                "shard_map: the per-shard function, with per-shard argument shapes)")
        if not all(r.known for r in refs):
            return self.staged(refs, len(eqn.outvars))
        return self.known_eqn(eqn, refs, ctx)

    def known_eqn(self, eqn, refs: Sequence[Ref], ctx: Context) -> list[Ref]:
        flops = eqn_flops(eqn)
        if jx.has_effects(eqn):  # always kept in the forward pass, whatever the policy says
            return self.node(eqn, refs, ctx, NodeMode.SAVE, "", flops)
        mode = ctx.decide(eqn)
        if ctx.decide is not self.decide:  # no policy of the plan is offered this equation
            return self.node(eqn, refs, ctx, mode, "", flops)
        key = policy_key(eqn.primitive, [x.aval for x in eqn.invars], eqn.params)
        if eqn.primitive is jx.name_p:
            self.names_by_key[key] = eqn.params["name"]
        return self.node(eqn, refs, ctx, mode, key, flops)

    # ---- rules: call-like primitives are flattened --------------------------

    def call_rule(self, eqn, refs: Sequence[Ref], ctx: Context) -> list[Ref]:
        return self.walk(body(eqn), refs, ctx)

    def checkpoint_rule(self, eqn, refs: Sequence[Ref], ctx: Context) -> list[Ref]:
        """A checkpoint inside a checkpointed function is flattened into it. Outside
        any (a plan's step graph), a region's checkpoint hands its equations to
        the solver and a user's own checkpoint fixes them by its policy."""
        if ctx.under_checkpoint:
            return self.call_rule(eqn, refs, ctx)
        policy = eqn.params["policy"]
        if isinstance(policy, RegionMarker):
            inner = replace(ctx.checkpointed(self.decide), region=policy.index)
            return self.walk(body(eqn), refs, inner)
        return self.walk(body(eqn), refs, ctx.checkpointed(decide_by(policy)))

    # ---- scan: the body once, stacked over the length ---------------------

    def scan_rule(self, eqn, refs: Sequence[Ref], ctx: Context) -> list[Ref]:
        """A ``lax.scan``: its body walked once, as a region repeated ``length`` times.

        (Long on purpose: one primitive's rule; consts, carry and xs are read and
        written back in the order of the scan's operands.)"""
        p = eqn.params
        (n_consts, n_carry), length = jx.scan_counts(p), int(p["length"])
        if length == 0:  # a graph node runs at least once (its repeat is the scan's length)
            raise ExtractionError(
                f"the lax.scan at {jx.source_of(eqn)} has length 0: it runs no iteration, so "
                "there is nothing in it to plan; leave it out or give it at least one")
        body: jx.Jaxpr = p["jaxpr"].jaxpr
        consts, init, xs = refs[:n_consts], refs[n_consts:n_consts + n_carry], \
            refs[n_consts + n_carry:]
        carry_known = scan_carry_known(body, consts, init, xs)
        loop = self.next_loop
        self.next_loop += 1
        inner = ctx.enter(loop, length)
        region = placed_region(body)
        if region is not None:  # the plan's region: its stacked carries belong to it too
            inner = replace(inner, region=region, region_loop=loop)
        here = frozenset({loop})

        carry_in: list[Ref] = []
        for ref, known, var in zip(init, carry_known, body.invars[n_consts:n_consts + n_carry],
                                   strict=True):
            if not known:
                if ref.known:
                    # A known value in a tangent slot is a zero the JVP instantiated
                    # for the carry fixpoint: JAX builds it in the backward pass.
                    carry_in.append(Ref(self.tangents.node([], [], 1)[0], False))
                else:
                    (t,) = self.staged([ref], 1)
                    carry_in.append(t)
                continue
            # Under a checkpoint the staged scan rebuilds the primal carry from the
            # initial value; under jax.vjp the forward scan keeps it per iteration.
            varying = ref.varying | here
            (v,) = self.virtual("scan_carry", [ref.value], [var.aval], varying, inner,
                                source=jx.source_of(eqn), mode=primal_mode(ctx),
                                out_vars=[var])
            carry_in.append(Ref(v, True, varying))
        xs_in = [Ref(r.value, True, r.varying | here) if r.known else r for r in xs]
        outs = self.walk(body, [*consts, *carry_in, *xs_in], inner)
        carry_out = outs[:n_carry]

        for cin, cout in zip(carry_in, carry_out, strict=True):
            if cin.value is None or cout.value is None:
                continue
            if cin.known:
                # Only a staged scan that rebuilds the primal carry needs carry_out
                # whenever it needs carry_in; under jax.vjp the carry is kept.
                if ctx.under_checkpoint:
                    self.builder.carry_in.append(cin.value)
                    self.builder.carry_out.append(cout.value)
            else:
                self.tangents.carries.append((cin.value, cout.value))
        # Primal outputs of a scan are instantiated: the staged scan recomputes them.
        results = []
        for ref, var in zip(outs, eqn.outvars, strict=True):
            if not ref.known:
                results.extend(self.staged([ref], 1))
                continue
            varying = ref.varying - here
            (v,) = self.virtual("scan_output", [ref.value], [var.aval], varying, ctx,
                                source=jx.source_of(eqn), mode=primal_mode(ctx),
                                out_vars=[var])
            results.append(Ref(v, True, varying))
        return results

    # ---- cond: its branches summarised alone -------------------------------

    def cond_rule(self, eqn, refs: Sequence[Ref], ctx: Context) -> list[Ref]:
        return walk_cond(self, eqn, refs, ctx)  # client.extract.cond

    # ---- while: the policy is never consulted -----------------------------

    def while_rule(self, eqn, refs: Sequence[Ref], ctx: Context) -> list[Ref]:
        if not all(r.known for r in refs):
            raise ExtractionError(
                f"while_loop at {jx.source_of(eqn)} carries a differentiated value; JAX cannot "
                "reverse-differentiate it. Use lax.scan or fori_loop with static bounds.")
        # partial_eval keeps the loop in the forward pass and stages a full copy
        # of it: its outputs are recomputed, never residuals.
        varying = frozenset().union(*(r.varying for r in refs))
        outs = self.virtual("while", [r.value for r in refs], [v.aval for v in eqn.outvars],
                            varying, ctx, flops=eqn_flops(eqn),
                            source=jx.source_of(eqn), mode=primal_mode(ctx),
                            out_vars=eqn.outvars)
        return [Ref(v, True, varying) for v in outs]


class _Walk(FixedConstants[Ref]):
    """The walk on the one driver (``client.interpreter``): a ref per variable, under one
    context; a control-flow equation is its object's ``walk`` hook (a rule above, or
    ``client.extract.cond``'s)."""

    constant = CONSTANT

    def __init__(self, walker: Walker, ctx: Context) -> None:
        self.walker, self.ctx = walker, ctx

    def equation(self, eqn: Any, ins: list[Ref], env: dict, scope: Any) -> list[Ref]:
        return self.walker.plain_eqn(eqn, ins, self.ctx)

    def control(self, flow: ControlFlow, eqn: Any, ins: list[Ref]) -> list[Ref]:
        return flow.walk(self.walker, eqn, ins, self.ctx)


def placed_region(body: jx.Jaxpr) -> int | None:
    """The region a scan's body was checkpointed as by ``client.peak.placement``, if any."""
    for eqn in body.eqns:
        flow = CONTROL_FLOW.get(eqn.primitive)
        policy = eqn.params.get("policy") if flow is not None and flow.checkpoint else None
        if isinstance(policy, RegionMarker):
            return policy.index
    return None


def batch_dims(eqn) -> int | None:
    """Batch dimensions of a dot (``dots_with_no_batch_dims_saveable`` looks at them)."""
    if eqn.primitive is not jx.lax_ops.dot_general_p:
        return None
    (_, _), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    return max(len(lhs_batch), len(rhs_batch))
