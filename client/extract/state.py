"""What a walk over a JVP'd jaxpr carries: references, the tangent graph, the context.

A known (primal) jaxpr variable refers to a graph value; an unknown one (a
tangent) to a value of the tangent graph, which exists only to find the
tangent equations JAX's dead-code elimination keeps. The context says which
scans enclose an equation and who decides it: the plan's policy, a user's
checkpoint, or nobody (``jax.vjp`` outside every checkpoint keeps what the
backward pass reads).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import optiremat.client._jax_internals as jx
from optiremat.solver.errors import OptirematError
from optiremat.solver.graph import NodeMode

NAME_PREFIX = "optiremat/"
HALF_FLOATS = frozenset({"bfloat16", "float16"})


def widens_stacked_halves() -> bool:
    """Whether XLA on the default platform keeps an f32 copy of a half-float value a scan
    stacks for the backward pass. Asked of XLA itself, once per platform: jax 0.10's CPU
    platform does (it computes half floats in f32), 0.12's does not, and the peak of a
    bf16 step priced the wrong way runs 30-40% off (tests/test_peak.py, bf16 Llama)."""
    import jax

    return _widens_stacked_halves(jax.default_backend())


@functools.cache
def _widens_stacked_halves(platform: str) -> bool:
    """On ``platform`` (the default one, when asked): one small program's temp bytes, a
    bf16 carry stacked over 16 iterations (2 MiB) for the backward pass, with or without
    an f32 copy beside it (4 MiB more)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    length, size = 16, 1 << 16

    def program(x):
        y, _ = lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=length)
        return jnp.sum(y.astype(jnp.float32))

    from optiremat.client.step import StepError, lowered_memory

    stacked = length * size * 2
    try:
        analysis = lowered_memory(jax.jit(jax.grad(program)).lower(
            jax.ShapeDtypeStruct((size,), jnp.bfloat16)))
    except StepError:  # a platform without a memory analysis
        return False
    return analysis.temp_bytes >= 2 * stacked


class ExtractionError(OptirematError, ValueError):
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
class TangentGraph:
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
    region_loop: int | None = None  # the scan (loop id) of that region

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


@dataclass(frozen=True)
class NamesOnly:
    """What a names policy (``save_and_offload_only_these_names``) is offered: the
    ``name`` equations of ``checkpoint_name``, those of ``names`` only where given (the
    names a framework's config can set); it recomputes every other equation."""

    names: frozenset[str] | None = None  # None: every name

    def offers(self, eqn: jx.core.JaxprEqn) -> bool:
        return eqn.primitive is jx.name_p and (self.names is None
                                               or eqn.params["name"] in self.names)

    def decide(self, eqn: jx.core.JaxprEqn) -> NodeMode:
        """The plan decides the names offered; the rest is recomputed."""
        return NodeMode.FREE if self.offers(eqn) else NodeMode.RECOMPUTE

    def fixed(self, eqn: jx.core.JaxprEqn) -> NodeMode:
        """Inside cond branches a names policy saves exactly the names offered."""
        return NodeMode.SAVE if self.offers(eqn) else NodeMode.RECOMPUTE


def primal_mode(ctx: Context) -> NodeMode:
    """Primal values a control-flow rule produces: rebuilt in the backward pass
    under a checkpoint, kept by the forward pass under jax.vjp."""
    return NodeMode.RECOMPUTE if ctx.under_checkpoint else NodeMode.SAVE


def decide_by(policy) -> Decide:
    """A user's own checkpoint outside the plan's regions: its policy fixes each equation."""
    def decide(eqn) -> NodeMode:
        if jx.has_effects(eqn):
            return NodeMode.SAVE
        answer = policy(eqn.primitive, *[x.aval for x in eqn.invars], **eqn.params)
        # Offloaded values are kept too, in host memory.
        saved = answer is True or answer is jx.Saveable or isinstance(answer, jx.Offloadable)
        return NodeMode.SAVE if saved else NodeMode.RECOMPUTE
    return decide


def fixed_save(eqn) -> NodeMode:
    return NodeMode.SAVE


def fixed_recompute(eqn) -> NodeMode:
    return NodeMode.SAVE if jx.has_effects(eqn) else NodeMode.RECOMPUTE
