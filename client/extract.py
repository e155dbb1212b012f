"""From a JAX function to the cost graph ``jax.checkpoint`` will see.

``jax.checkpoint`` JVPs the traced function and splits it with
``partial_eval_jaxpr_custom``: primal inputs known, tangents unknown. Every
equation whose inputs are all known is offered to the policy; the rest is the
backward pass. ``_Walker`` replays that split as one walk over the JVP'd jaxpr,
with rules in a table for the primitives that partial_eval treats specially
(call-like primitives are flattened, ``scan`` bodies become sub-graphs whose
residuals are stacked over the length, ``cond`` and ``while`` become fixed
nodes). The walk records, for every value, whether the backward pass reads it,
and leaves the save/recompute choice to the solver.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import jax
import numpy as np

from optiremat.client import _jax_internals as jx
from optiremat.client.cost_model import aval_bytes, eqn_flops
from optiremat.client.keys import policy_key
from optiremat.client.placement import Region, RegionMarker, find_regions, place
from optiremat.client.step import Step
from optiremat.solver.graph import CostGraph, GraphBuilder, NodeMode
from optiremat.solver.semantics import evaluate
from optiremat.solver.step import RegionMemory, StepMemory

NAME_PREFIX = "optiremat/"
HALF_FLOATS = frozenset({"bfloat16", "float16"})


class ExtractionError(ValueError):
    """The function uses something whose remat behaviour optiremat cannot predict."""


@dataclass(frozen=True)
class Ref:
    """What a jaxpr variable holds during the walk.

    A known (primal) variable refers to a graph value; an unknown one (a
    tangent) to a value of the walker's tangent graph, which exists only to
    find the tangent equations JAX's dead-code elimination keeps.
    """

    value: int | None  # graph or tangent value; None for literals and closed-over constants
    known: bool
    varying: frozenset[int] = frozenset()  # the enclosing scans it changes across


CONSTANT = Ref(None, True)


@dataclass
class _TangentGraph:
    """The staged (backward) equations: which tangents they read and write,
    and which primal values they read."""

    producer: dict[int, int] = field(default_factory=dict)
    inputs: list[list[int]] = field(default_factory=list)
    primal_reads: list[list[int]] = field(default_factory=list)
    carries: list[tuple[int, int]] = field(default_factory=list)  # (carry in, carry out)
    count: int = 0

    def node(self, tangents_in: Sequence[int], primal_reads: Sequence[int],
             num_out: int) -> list[int]:
        outs = list(range(self.count, self.count + num_out))
        self.count += num_out
        for t in outs:
            self.producer[t] = len(self.inputs)
        self.inputs.append(list(tangents_in))
        self.primal_reads.append(list(primal_reads))
        return outs

    def live_primal_reads(self, sinks: Sequence[int]) -> list[int]:
        """Primal values read by the staged equations that survive DCE."""
        carry_of: dict[int, list[int]] = {}
        for cin, cout in self.carries:
            carry_of.setdefault(cin, []).append(cout)
        live_t: set[int] = set()
        live_n: set[int] = set()
        stack = list(sinks)
        while stack:
            t = stack.pop()
            if t in live_t:
                continue
            live_t.add(t)
            stack.extend(carry_of.get(t, ()))
            n = self.producer.get(t)
            if n is not None and n not in live_n:
                live_n.add(n)
                stack.extend(self.inputs[n])
        return sorted({v for n in live_n for v in self.primal_reads[n]})


# How a known equation's decision is fixed: FREE leaves it to the solver.
Decide = Callable[[jx.core.JaxprEqn], NodeMode]


def save_everything(eqn: jx.core.JaxprEqn) -> NodeMode:
    """Outside every checkpoint ``jax.vjp`` keeps what the backward pass reads."""
    return NodeMode.SAVE


@dataclass(frozen=True)
class Context:
    loops: tuple[tuple[int, int], ...] = ()  # (scan id, length) from outermost in
    decide: Decide = save_everything  # who decides the known equations met here
    # Inside a jax.checkpoint, scans follow partial_eval_jaxpr_custom (the primal
    # carry is rebuilt in the backward pass); outside, jax.vjp's linearization
    # (the forward scan keeps its carries and stacks what the backward reads).
    under_checkpoint: bool = True
    region: int | None = None  # the plan's region being walked (step graphs)

    def stacked(self, varying: frozenset[int]) -> int:
        """How many times a value or an equation exists: once per iteration of
        each enclosing scan it varies across. JAX hoists loop-invariant work
        (and residuals) out of scans, in the forward and the backward pass."""
        return math.prod(length for loop, length in self.loops if loop in varying)

    def enter(self, loop_id: int, length: int) -> Context:
        return replace(self, loops=(*self.loops, (loop_id, length)))

    def checkpointed(self, decide: Decide) -> Context:
        return replace(self, decide=decide, under_checkpoint=True)


def decide_by_policy(eqn: jx.core.JaxprEqn) -> NodeMode:
    """Tied graphs: the plan's policy decides every equation it is offered."""
    return NodeMode.FREE


def decide_by_names(eqn: jx.core.JaxprEqn) -> NodeMode:
    """Names graphs: ``save_only_these_names`` recomputes all but ``name`` equations."""
    return NodeMode.FREE if eqn.primitive is jx.name_p else NodeMode.RECOMPUTE


@dataclass
class _Walker:
    builder: GraphBuilder
    decide: Decide
    branch_decide: Decide | None  # fixed decision inside cond branches; None: solver picks
    next_loop: int = 0
    keys_forced_save: set[str] = field(default_factory=set)
    branch_nodes: list[dict] = field(default_factory=list)  # offered to the policy in conds
    tangents: _TangentGraph = field(default_factory=_TangentGraph)
    names_by_key: dict[str, str] = field(default_factory=dict)  # checkpoint_name equations
    tie_groups: list[set[str]] = field(default_factory=list)  # keys that share one decision
    next_cond: int = 0
    # XLA on CPU computes half-precision floats in f32 and widens stacked half
    # residuals for the backward pass: each costs about its size again (bench/peak.py).
    widen_stacked_halves: bool = False

    # ---- values and nodes -------------------------------------------------

    def new_value(self, aval, varying: frozenset[int], ctx: Context) -> int:
        copies = ctx.stacked(varying)
        nbytes = aval_bytes(aval) * copies
        dtype = str(getattr(aval, "dtype", ""))
        widened = self.widen_stacked_halves and copies > 1 and dtype in HALF_FLOATS
        return self.builder.value(nbytes, tuple(getattr(aval, "shape", ())), dtype,
                                  extra=nbytes if widened else 0)

    def node(self, eqn, ins: Sequence[Ref], ctx: Context, mode: NodeMode, key: str,
             flops: int) -> list[Ref]:
        varying = frozenset().union(*(r.varying for r in ins))
        outs = [Ref(self.new_value(v.aval, varying, ctx), True, varying) for v in eqn.outvars]
        self.builder.node(
            eqn.primitive.name,
            [r.value for r in ins if r.value is not None],
            [r.value for r in outs],
            key=key, flops=flops * ctx.stacked(varying), mode=mode,
            repeat=ctx.stacked(varying), source=jx.source_of(eqn), batch_dims=_batch_dims(eqn),
            region=ctx.region,
        )
        return outs

    def virtual(self, name: str, inputs: Sequence[int | None], out_avals: Sequence,
                varying: frozenset[int], ctx: Context, *, mode: NodeMode = NodeMode.RECOMPUTE,
                flops: int = 0, source: str = "", key: str = "") -> list[int]:
        """A node no policy decides: JAX's rule fixes what it does.

        A ``key`` marks work that exists only because of the policy (a cond
        branch recomputed under a names policy): ``everything_saveable``, the
        FLOPs baseline, would have saved it.
        """
        outs = [self.new_value(a, varying, ctx) for a in out_avals]
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

    # ---- the walk ---------------------------------------------------------

    def walk(self, jaxpr: jx.Jaxpr, ins: Sequence[Ref], ctx: Context) -> list[Ref]:
        env: dict = dict(zip(jaxpr.invars, ins, strict=True))
        env.update((v, CONSTANT) for v in jaxpr.constvars)

        def read(x) -> Ref:
            return CONSTANT if isinstance(x, jx.Literal) else env[x]

        for eqn in jaxpr.eqns:
            refs = [read(x) for x in eqn.invars]
            rule = RULES.get(eqn.primitive.name)
            if rule is not None:
                outs = rule(self, eqn, refs, ctx)
            elif not all(r.known for r in refs):
                outs = self.staged(refs, len(eqn.outvars))
            else:
                outs = self.known_eqn(eqn, refs, ctx)
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(x) for x in jaxpr.outvars]

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
        return self.walk(_called_jaxpr(eqn), refs, ctx)

    def checkpoint_rule(self, eqn, refs: Sequence[Ref], ctx: Context) -> list[Ref]:
        """A checkpoint inside a checkpointed function is flattened into it. Outside
        any (a plan's step graph), a region's checkpoint hands its equations to
        the solver and a user's own checkpoint fixes them by its policy."""
        if ctx.under_checkpoint:
            return self.call_rule(eqn, refs, ctx)
        policy = eqn.params["policy"]
        if isinstance(policy, RegionMarker):
            inner = replace(ctx.checkpointed(self.decide), region=policy.index)
            return self.walk(_called_jaxpr(eqn), refs, inner)
        return self.walk(_called_jaxpr(eqn), refs, ctx.checkpointed(_decide_by(policy)))

    # ---- scan: the body once, stacked over the length ---------------------

    def scan_rule(self, eqn, refs: Sequence[Ref], ctx: Context) -> list[Ref]:
        p = eqn.params
        n_consts, n_carry, length = p["num_consts"], p["num_carry"], int(p["length"])
        body: jx.Jaxpr = p["jaxpr"].jaxpr
        consts, init, xs = refs[:n_consts], refs[n_consts:n_consts + n_carry], \
            refs[n_consts + n_carry:]
        carry_known = _scan_carry_known(body, consts, init, xs)
        loop = self.next_loop
        self.next_loop += 1
        inner = ctx.enter(loop, length)
        region = _placed_region(body)
        if region is not None:  # the plan's region: its stacked carries belong to it too
            inner = replace(inner, region=region)
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
                                source=jx.source_of(eqn), mode=_primal_mode(ctx))
            carry_in.append(Ref(v, True, varying))
        xs_in = [Ref(r.value, True, r.varying | here) if r.known else r for r in xs]
        outs = self.walk(body, [*consts, *carry_in, *xs_in], inner)
        carry_out = outs[:n_carry]

        for cin, cout in zip(carry_in, carry_out, strict=True):
            if cout.value is None:
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
                                source=jx.source_of(eqn), mode=_primal_mode(ctx))
            results.append(Ref(v, True, varying))
        return results

    # ---- cond: branches under a fixed decision ----------------------------

    def cond_rule(self, eqn, refs: Sequence[Ref], ctx: Context) -> list[Ref]:
        """The staged cond reads merged branch residuals, or recomputes its branches.

        A stateless policy gives every branch equation the decision of its key.
        Tied graphs offer the solver two configurations per cond, tied to one
        decision together with every key inside the branches: all saved (the
        residuals merged across branches as JAX merges them) or all recomputed
        (the staged branches rerun from the operands). Names graphs fix the
        branches to what a names policy does: names saved, the rest recomputed.
        Outside every checkpoint (a plan's step graph) jax.vjp keeps what the
        staged branches read: the branches are saved and no policy is offered them.
        """
        index, ops = refs[0], refs[1:]
        if not index.known:
            return self.staged(refs, len(eqn.outvars))
        _reject_nested_control_flow(eqn)
        unoffered = not ctx.under_checkpoint
        tied = self.branch_decide is None and not unoffered
        varying = frozenset().union(*(r.varying for r in refs))
        fixed = _fixed_save if tied or unoffered else self.branch_decide
        saved = [_BranchSummary.of(b.jaxpr, ops, fixed) for b in eqn.params["branches"]]
        out_known = [all(b.out_known[k] for b in saved) for k in range(len(eqn.outvars))]
        sinks = [None, *(k for k, known in enumerate(out_known) if known)]
        source = jx.source_of(eqn)

        # JAX merges residuals across branches by type: the i-th residual of a
        # given aval in any branch shares one slot.
        slot_of: dict[tuple[str, int], int] = {}
        slot_avals: list = []
        for b in saved:
            for tag, aval in b.residual_tags():
                if tag not in slot_of:
                    slot_of[tag] = len(slot_avals)
                    slot_avals.append(aval)

        token = None
        if tied:
            recomputed = [_BranchSummary.of(b.jaxpr, ops, _fixed_recompute)
                          for b in eqn.params["branches"]]
            operands, flops = set(), 0
            for b in recomputed:
                ops_b, flops_b = b.needs_all(sinks)
                operands |= {ops[i].value for i in ops_b}
                flops = max(flops, flops_b)
            key = f"cond-branches:{self.next_cond}"
            self.next_cond += 1
            self.tie_groups.append({key, *(k for b in saved for k in b.keys)})
            slots = self.virtual("cond_branches", sorted(operands - {None}), slot_avals, varying,
                                 ctx, mode=NodeMode.FREE, flops=flops,
                                 source=source, key=key)
            # A zero-byte output every reader takes, so that recomputing the
            # branches is charged even when no residual slot exists.
            token = self.builder.value(0, (), "token")
            self.builder.nodes[-1]["outputs"].append(token)
        elif unoffered:
            slots = self.virtual("cond_residuals", [], slot_avals, varying, ctx,
                                 mode=NodeMode.SAVE, source=source) if slot_avals else []
        else:
            for b in saved:
                self.branch_nodes.extend(b.keyed_nodes)
                self.names_by_key.update(b.names_by_key)
                self.keys_forced_save.update(b.keys_forced_save)
            slots = self.virtual("cond_residuals", [], slot_avals, varying, ctx,
                                 mode=NodeMode.SAVE, source=source) if slot_avals else []

        def needs(sink: int | None) -> tuple[list[int], int]:
            vals, flops = {index.value, token} - {None}, 0
            for b in saved:
                res, operands, f = b.needs(sink)
                vals |= {slots[slot_of[t]] for t in res}
                vals |= {ops[i].value for i in operands if ops[i].value is not None}
                flops = max(flops, f)
            return sorted(vals), flops

        # Work a names policy makes the staged branches redo carries a key:
        # everything_saveable, the FLOPs baseline, would have saved it.
        tangent_vals, tangent_flops = needs(None)
        tangent_outs: list[Ref] = []
        if not all(out_known):
            (marker,) = self.virtual("cond_backward", tangent_vals,
                                     [jax.core.ShapedArray((), np.bool_)], varying, ctx,
                                     flops=tangent_flops,
                                     key="" if tied or unoffered else "cond_backward",
                                     source=source)
            tangent_outs = self.staged([r for r in ops if not r.known],
                                       len(out_known) - sum(out_known), [marker])
        results = []
        for k, var in enumerate(eqn.outvars):
            if not out_known[k]:
                results.append(tangent_outs.pop(0))
                continue
            vals, flops = needs(k)
            (v,) = self.virtual("cond_output", vals, [var.aval], varying, ctx,
                                flops=max(flops - tangent_flops, 0), mode=_primal_mode(ctx),
                                key="" if tied or unoffered else "cond_output", source=source)
            results.append(Ref(v, True, varying))
        return results

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
                            source=jx.source_of(eqn), mode=_primal_mode(ctx))
        return [Ref(v, True, varying) for v in outs]


RULES: dict[str, Callable[[_Walker, object, Sequence[Ref], Context], list[Ref]]] = {
    "jit": _Walker.call_rule,
    "pjit": _Walker.call_rule,
    "closed_call": _Walker.call_rule,
    "core_call": _Walker.call_rule,
    "call": _Walker.call_rule,
    "remat2": _Walker.checkpoint_rule,
    "checkpoint": _Walker.checkpoint_rule,
    "scan": _Walker.scan_rule,
    "cond": _Walker.cond_rule,
    "while": _Walker.while_rule,
}


def _placed_region(body: jx.Jaxpr) -> int | None:
    """The region a scan's body was checkpointed as by ``client.placement``, if any."""
    for eqn in body.eqns:
        policy = eqn.params.get("policy") if eqn.primitive.name in ("remat2", "checkpoint") \
            else None
        if isinstance(policy, RegionMarker):
            return policy.index
    return None


def _primal_mode(ctx: Context) -> NodeMode:
    """Primal values a control-flow rule produces: rebuilt in the backward pass
    under a checkpoint, kept by the forward pass under jax.vjp."""
    return NodeMode.RECOMPUTE if ctx.under_checkpoint else NodeMode.SAVE


def _decide_by(policy) -> Decide:
    """A user's own checkpoint outside the plan's regions: its policy fixes each equation."""
    def decide(eqn) -> NodeMode:
        if jx.has_effects(eqn):
            return NodeMode.SAVE
        answer = policy(eqn.primitive, *[x.aval for x in eqn.invars], **eqn.params)
        # Offloaded values are kept too, in host memory.
        saved = answer is True or answer is jx.Saveable or isinstance(answer, jx.Offloadable)
        return NodeMode.SAVE if saved else NodeMode.RECOMPUTE
    return decide


def _called_jaxpr(eqn) -> jx.Jaxpr:
    """The body of a call-like equation (``jit`` keeps it as ``jaxpr``, calls as ``call_jaxpr``)."""
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    return inner.jaxpr if isinstance(inner, jx.ClosedJaxpr) else inner


def _batch_dims(eqn) -> int | None:
    """Batch dimensions of a dot (``dots_with_no_batch_dims_saveable`` looks at them)."""
    if eqn.primitive.name != "dot_general":
        return None
    (_, _), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    return max(len(lhs_batch), len(rhs_batch))


def _reject_nested_control_flow(eqn) -> None:
    for branch in eqn.params["branches"]:
        for e in branch.jaxpr.eqns:
            if e.primitive.name in ("scan", "cond", "while"):
                raise ExtractionError(
                    f"{e.primitive.name} inside a cond branch ({jx.source_of(eqn)}) is not "
                    "supported: its residuals could not be predicted exactly")


def _known_outputs(jaxpr: jx.Jaxpr, known_in: Sequence[bool]) -> list[bool]:
    """Which outputs partial_eval will find known, without building anything."""
    env = dict(zip(jaxpr.invars, known_in, strict=True))
    env.update((v, True) for v in jaxpr.constvars)

    def read(x) -> bool:
        return True if isinstance(x, jx.Literal) else env[x]

    for eqn in jaxpr.eqns:
        ins = [read(x) for x in eqn.invars]
        name = eqn.primitive.name
        if RULES.get(name) in (_Walker.call_rule, _Walker.checkpoint_rule):
            outs = _known_outputs(_called_jaxpr(eqn), ins)
        elif name == "scan":
            p = eqn.params
            nc, nk = p["num_consts"], p["num_carry"]
            body = p["jaxpr"].jaxpr
            carry = _scan_carry_known_flags(body, ins[:nc], ins[nc:nc + nk], ins[nc + nk:])
            outs = _known_outputs(body, [*ins[:nc], *carry, *ins[nc + nk:]])
            outs = [*carry, *outs[nk:]]
        elif name == "cond":
            if not ins[0]:
                outs = [False] * len(eqn.outvars)
            else:
                per = [_known_outputs(b.jaxpr, ins[1:]) for b in eqn.params["branches"]]
                outs = [all(col) for col in zip(*per, strict=True)]
        else:
            outs = [all(ins)] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(x) for x in jaxpr.outvars]


def _scan_carry_known_flags(body, consts: Sequence[bool], init: Sequence[bool],
                            xs: Sequence[bool]) -> list[bool]:
    """The carry fixpoint of ``_scan_partial_eval_custom``."""
    carry = list(init)
    for _ in range(len(carry) + 1):
        outs = _known_outputs(body, [*consts, *carry, *xs])
        new = [c and o for c, o in zip(carry, outs[:len(carry)], strict=True)]
        if new == carry:
            return carry
        carry = new
    return carry


def _scan_carry_known(body, consts: Sequence[Ref], init: Sequence[Ref],
                      xs: Sequence[Ref]) -> list[bool]:
    return _scan_carry_known_flags(body, [r.known for r in consts], [r.known for r in init],
                                   [r.known for r in xs])


@dataclass
class _BranchSummary:
    """One cond branch, partially evaluated under the fixed branch decision."""

    graph: CostGraph
    operand_inputs: dict[int, int]  # local input value position -> operand index
    out_refs: list[Ref]
    out_known: list[bool]
    avals: list  # per local value
    keyed_nodes: list[dict] = field(default_factory=list)  # equations the policy is offered
    keys_forced_save: set[str] = field(default_factory=set)
    names_by_key: dict[str, str] = field(default_factory=dict)
    _tag_of: dict[int, tuple[str, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, jaxpr: jx.Jaxpr, ops: Sequence[Ref], decide: Decide) -> _BranchSummary:
        b = GraphBuilder()
        walker = _Walker(b, decide, decide)
        ins, operand_inputs = [], {}
        for i, (ref, var) in enumerate(zip(ops, jaxpr.invars, strict=True)):
            if not ref.known:
                ins.append(Ref(walker.tangents.node([], [], 1)[0], False))
                continue
            v = b.input(aval_bytes(var.aval), tuple(var.aval.shape), str(var.aval.dtype))
            operand_inputs[v] = i
            ins.append(Ref(v, True))
        outs = walker.walk(jaxpr, ins, Context(decide=decide))
        walker.finish(outs)
        keyed = [n for n in b.nodes if n["key"]]
        forced = {n["key"] for n in keyed if n["mode"] == NodeMode.SAVE}
        avals = [jax.core.ShapedArray(tuple(shape), jax.numpy.dtype(dtype))
                 for _, shape, dtype in b.values]
        return cls(b.build(), operand_inputs, outs, [r.known for r in outs], avals,
                   keyed_nodes=keyed, keys_forced_save=forced,
                   names_by_key=dict(walker.names_by_key))

    @property
    def keys(self) -> set[str]:
        return {n["key"] for n in self.keyed_nodes}

    def _sink(self, sink: int | None) -> list[int]:
        if sink is None:
            return list(self.graph.backward_reads)
        ref = self.out_refs[sink]
        return [] if ref.value is None else [ref.value]

    def _residuals(self, sink: int | None):
        g = self.graph.model_copy(update={"backward_reads": self._sink(sink)})
        ev = evaluate(g, [True] * g.num_nodes)
        produced = [v for v in ev.residuals if g.producer[v] is not None]
        operands = sorted(self.operand_inputs[v] for v in ev.residuals if v in self.operand_inputs)
        return produced, operands, ev.backward_flops

    def residual_order(self) -> list[int]:
        """Residual values in JAX's order: read by the backward pass, then outputs."""
        order, _, _ = self._residuals(None)
        for k in range(len(self.out_refs)):
            if self.out_known[k]:
                for v in self._residuals(k)[0]:
                    if v not in order:
                        order.append(v)
        return order

    def residual_tags(self) -> list[tuple[tuple[str, int], object]]:
        counts: dict[str, int] = {}
        tags = []
        for v in self.residual_order():
            text = f"{self.graph.value_dtype[v]}{self.graph.value_shape[v]}"
            n = counts.get(text, 0)
            counts[text] = n + 1
            self._tag_of[v] = (text, n)
            tags.append(((text, n), self.avals[v]))
        return tags

    def needs_all(self, sinks: Sequence[int | None]) -> tuple[set[int], int]:
        """Operands and FLOPs of rebuilding every sink at once."""
        reads = sorted({v for sink in sinks if sink is None or self.out_known[sink]
                        for v in self._sink(sink)})
        g = self.graph.model_copy(update={"backward_reads": reads})
        ev = evaluate(g, [False] * g.num_nodes)
        return {self.operand_inputs[v] for v in ev.residuals if v in self.operand_inputs}, \
            ev.backward_flops

    def needs(self, sink: int | None) -> tuple[list[tuple[str, int]], list[int], int]:
        if sink is not None and not self.out_known[sink]:
            return [], [], 0
        produced, operands, flops = self._residuals(sink)
        return [self._tag_of[v] for v in produced], operands, flops


# ---- entry points ------------------------------------------------------------


@dataclass(frozen=True)
class Traced:
    """A function traced as ``jax.checkpoint`` traces it: flat, consts first."""

    closed: jx.ClosedJaxpr  # consts converted to leading inputs
    open_jaxpr: jx.Jaxpr  # the same with consts as constvars
    consts: list
    in_tree: object
    out_tree: object
    num_consts: int
    flat_args: list


def trace(fun: Callable, args: Sequence, kwargs: dict) -> Traced:
    flat_args, in_tree = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)))
    out_tree_box: list = []

    def flat_fun(*leaves):
        a, k = jax.tree_util.tree_unflatten(in_tree, leaves)
        out = fun(*a, **k)
        leaves_out, tree = jax.tree_util.tree_flatten(out)
        out_tree_box.append(tree)
        return leaves_out

    closed = jax.make_jaxpr(flat_fun)(*flat_args)
    return Traced(jx.close_with_consts_as_inputs(closed), closed.jaxpr, list(closed.consts),
                  in_tree,
                  out_tree_box[-1], len(closed.consts), flat_args)


def _differentiated(traced: Traced, arguments: Sequence[bool] | None) -> list[bool]:
    """Which inputs get tangents: the ``arguments`` flagged (every float argument
    when None, as ``jax.vjp`` does), never consts."""
    avals = traced.closed.in_avals[traced.num_consts:]
    if arguments is None:
        arguments = [bool(jax.numpy.issubdtype(a.dtype, jax.numpy.inexact)) for a in avals]
    return [False] * traced.num_consts + list(arguments)


@dataclass(frozen=True)
class Extraction:
    graph: CostGraph
    names_by_key: dict[str, str]  # policy key -> checkpoint name, for names graphs
    # A node key standing for several policy keys that must share a decision
    # (every key inside a cond's branches): representative -> the keys.
    key_aliases: dict[str, frozenset[str]] = field(default_factory=dict)


def graph_of_traced(traced: Traced, *, names: bool = False, name: str = "", step: bool = False,
                    differentiated: Sequence[bool] | None = None,
                    step_memory: StepMemory | None = None) -> Extraction:
    """The cost graph of ``traced``; with ``names``, as ``save_only_these_names`` sees it.

    By default the whole function is under one ``jax.checkpoint``. With ``step``
    it is differentiated as it stands (``traced`` is a placed function: its
    regions' checkpoints carry ``RegionMarker`` policies): the plan's policy is
    offered the equations of the regions only. ``differentiated`` flags the
    arguments that get tangents (default: every float argument). ``step_memory``
    travels with the graph, which then plans peak budgets.
    """
    nonzeros = _differentiated(traced, differentiated)
    jvp, jvp_consts = jx.jvp_jaxpr(traced.closed, nonzeros)
    b = GraphBuilder(name)
    b.step = step_memory
    decide = decide_by_names if names else decide_by_policy
    walker = _Walker(b, decide, decide_by_names_fixed if names else None,
                     widen_stacked_halves=step_memory is not None
                     and jax.default_backend() == "cpu")
    refs: list[Ref] = []
    for c in jvp_consts:
        aval = jax.core.get_aval(c)
        refs.append(Ref(b.input(aval_bytes(aval), tuple(aval.shape), str(aval.dtype)), True))
    for aval in traced.closed.in_avals:
        refs.append(Ref(b.input(aval_bytes(aval), tuple(aval.shape), str(aval.dtype)), True))
    refs.extend(Ref(t, False) for t in walker.tangents.node([], [], sum(nonzeros)))
    top = Context(under_checkpoint=False) if step else Context(decide=walker.decide)
    walker.finish(walker.walk(jvp, refs, top))
    # Equations inside cond branches are offered to the policy too; they appear
    # as fixed nodes whose outputs nothing reads, so the plan's policy knows
    # their keys, and every node sharing such a key takes the same decision.
    for n in walker.branch_nodes:
        b.node(n["primitive"], [], [b.value(0)], key=n["key"], flops=0, mode=n["mode"],
               repeat=n["repeat"], source=n["source"])
    for n in b.nodes:
        if n["key"] in walker.keys_forced_save:
            n["mode"] = NodeMode.SAVE
    aliases = _merge_tie_groups(walker.tie_groups)
    for n in b.nodes:
        for representative, keys in aliases.items():
            if n["key"] in keys:
                n["key"] = representative
    return Extraction(b.build(), dict(walker.names_by_key), aliases)


@dataclass(frozen=True)
class StepExtraction:
    """The graph of a training step whose regions the plan decides."""

    extraction: Extraction  # its graph carries the step's memory (CostGraph.step)
    regions: tuple[Region, ...]
    differentiated: tuple[bool, ...]  # per flattened argument: whether the step differentiates it

    @property
    def graph(self) -> CostGraph:
        return self.extraction.graph


def step_extraction(fun: Callable, args: Sequence, step: Step, *,
                    name: str = "") -> StepExtraction:
    """The cost graph of ``step`` (``jax.jit(jax.grad(fun, argnums))``) with a remat
    region in every differentiated ``lax.scan`` (``client.placement``), and what
    the step holds and each region's working set (one compile per distinct layer)."""
    from optiremat.client.calibration import working_bytes

    step.check(args)
    traced = trace(fun, args, {})
    flags = step.differentiated(args)
    closed = jx.ClosedJaxpr(traced.open_jaxpr, traced.consts)
    regions = tuple(find_regions(closed, flags))
    markers = [RegionMarker(r.index) for r in regions]

    def marked(*leaves):
        return place(closed, leaves, regions, markers, flags)

    arguments, outputs, aliases = step.held_memory(args)
    memory = StepMemory(argument_bytes=arguments, output_bytes=outputs, alias_bytes=aliases,
                        regions=[RegionMemory(source=r.source, length=r.length,
                                              working_bytes=working_bytes(r)) for r in regions])
    extraction = graph_of_traced(trace(marked, traced.flat_args, {}), name=name, step=True,
                                 differentiated=flags, step_memory=memory)
    return StepExtraction(extraction, regions, tuple(flags))


def _merge_tie_groups(groups: Sequence[set[str]]) -> dict[str, frozenset[str]]:
    """Union of overlapping groups; each named by its smallest key."""
    merged: list[set[str]] = []
    for group in groups:
        group = set(group)
        for other in [m for m in merged if m & group]:
            group |= other
            merged.remove(other)
        merged.append(group)
    return {min(g): frozenset(g) for g in merged}


def _fixed_save(eqn) -> NodeMode:
    return NodeMode.SAVE


def _fixed_recompute(eqn) -> NodeMode:
    return NodeMode.SAVE if jx.has_effects(eqn) else NodeMode.RECOMPUTE


def decide_by_names_fixed(eqn) -> NodeMode:
    """Inside cond branches a names policy saves exactly the named values."""
    return NodeMode.SAVE if eqn.primitive is jx.name_p else NodeMode.RECOMPUTE


def extract_step(fun: Callable, *args, argnums: int | Sequence[int] = 0,
                 donate_argnums: int | Sequence[int] = ()) -> CostGraph:
    """The cost graph of the training step ``jax.jit(jax.grad(fun, argnums))`` at
    ``args``: a remat region in every differentiated ``lax.scan``, and what the step
    holds (one compile per distinct layer measures its working set). Solving it
    plans peak budgets; ``optiremat.optimize`` is this and a solve."""
    name = getattr(fun, "__qualname__", getattr(fun, "__name__", ""))
    return step_extraction(fun, args, Step.of(argnums, donate_argnums), name=name).graph


def extract_graph(fun: Callable, *args, **kwargs) -> CostGraph:
    """The cost graph of ``jax.checkpoint(fun)`` differentiated at ``args``.

    Float arguments are differentiated, integer ones are not, as with
    ``jax.grad``. Example::

        >>> import jax.numpy as jnp
        >>> g = extract_graph(lambda x: jnp.sin(jnp.sin(x)).sum(), jnp.ones(4))
        >>> sorted(set(g.node_primitive))
        ['cos', 'reduce_sum', 'sin']
    """
    name = getattr(fun, "__qualname__", getattr(fun, "__name__", ""))
    return graph_of_traced(trace(fun, args, kwargs), name=name).graph
