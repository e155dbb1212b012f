"""One driver over a jaxpr, and the primitives that run jaxprs of their own.

JAX's ``partial_eval`` walks a jaxpr once with a small environment (``read``,
``write``) and looks each equation's rule up in tables keyed by ``Primitive``.
Here an *analysis* is a value per variable and a rule for a plain equation:
which values partial evaluation finds known (``client.extract.known``), each
value's sharding spec (``client.sharding_rules``), the cost graph's walk
(``client.extract.walker``), which values carry a tangent
(``client.peak.finding``). ``interpret`` is the walk they share. A primitive that
runs jaxprs of its own (a call, a nested checkpoint, a scan, a cond, a while
loop) is one ``ControlFlow`` object, keyed by the primitive in ``CONTROL_FLOW``,
with a hook per analysis, and the facts the other walks ask of it (region
finding and placement in ``client.peak``, the cond rule) declared as class
attributes: whether its body is entered as a call, whether it is a checkpoint,
a scan's layers, a barrier to blocks of straight-line code. Adding a
control-flow primitive is one object, adding an analysis is one hook on each;
no walk tests a primitive's role.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import optiremat.client._jax_internals as jx
from optiremat.client.primitives import REGISTRY, Role, body

if TYPE_CHECKING:  # the walk runs on this driver: walker.py imports this module
    from optiremat.client.extract.state import Context, Ref
    from optiremat.client.extract.walker import Walker

T = TypeVar("T")


class Analysis(ABC, Generic[T]):
    """A value per variable of a jaxpr, computed equation by equation."""

    @abstractmethod
    def read(self, env: dict, x: Any) -> T:
        """The value of ``x`` (a variable or a literal) in ``env``."""

    def bind(self, jaxpr: jx.Jaxpr, env: dict, inputs: Sequence[T]) -> None:
        """Set ``jaxpr``'s inputs (and its constants, where the analysis gives them one)."""
        env.update(zip(jaxpr.invars, inputs, strict=True))

    def scope(self, jaxpr: jx.Jaxpr) -> Any:
        """What the plain rule of one jaxpr's equations shares (None: nothing)."""
        return None

    @abstractmethod
    def equation(self, eqn: Any, ins: list[T], env: dict, scope: Any) -> list[T]:
        """The outputs of a plain equation (no jaxpr of its own)."""

    @abstractmethod
    def control(self, flow: ControlFlow, eqn: Any, ins: list[T]) -> list[T]:
        """The outputs of a control-flow equation: ``flow``'s hook for this analysis."""

    def inner(self, jaxpr: jx.Jaxpr, ins: Sequence[T]) -> list[T]:
        """The outputs of an inner jaxpr (a call's body, a branch) given its inputs'."""
        return interpret(self, jaxpr, ins)[0]


class FixedConstants(Analysis[T]):
    """An analysis that gives every literal and every constant one value, ``constant``
    (known-ness: known; the walk: the constant ref)."""

    constant: T

    def read(self, env: dict, x: Any) -> T:
        return self.constant if isinstance(x, jx.Literal) else env[x]

    def bind(self, jaxpr: jx.Jaxpr, env: dict, inputs: Sequence[T]) -> None:
        super().bind(jaxpr, env, inputs)
        env.update((v, self.constant) for v in jaxpr.constvars)


def interpret(analysis: Analysis[T], jaxpr: jx.Jaxpr, inputs: Sequence[T],
              env: dict | None = None) -> tuple[list[T], dict]:
    """``analysis`` over ``jaxpr`` from its inputs' values: its outputs', and the
    environment (every variable's value; ``env``, when given, is written in place)."""
    env = {} if env is None else env
    analysis.bind(jaxpr, env, inputs)
    scope = analysis.scope(jaxpr)
    for eqn in jaxpr.eqns:
        ins = [analysis.read(env, x) for x in eqn.invars]
        flow = CONTROL_FLOW.get(eqn.primitive)
        outs = (analysis.equation(eqn, ins, env, scope) if flow is None
                else analysis.control(flow, eqn, ins))
        env.update(zip(eqn.outvars, outs, strict=True))
    return [analysis.read(env, x) for x in jaxpr.outvars], env


# ---- control flow: one object per primitive, a hook per analysis ----------------------


class ControlFlow(ABC):
    """A primitive that runs jaxprs of its own: a hook per analysis, and the facts the
    finding and placement of remat regions (``client.peak``) and the cond rule
    (``client.extract.cond``) need, declared once here instead of tested by role."""

    # Region finding walks its body where it stands (regions inside are the caller's),
    # and placement evaluates it there.
    entered: ClassVar[bool] = False
    # A nested jax.checkpoint: the user's own is a region, inlined inside a plan's
    # region; a plan's own is recognised by its policy (a RegionMarker).
    checkpoint: ClassVar[bool] = False
    # Its body runs once per layer: a differentiated one is a ScanRegion.
    layers: ClassVar[bool] = False
    # No block of straight-line code spans it.
    barrier: ClassVar[bool] = False
    # What an error calls it when a differentiated scan sits inside (its bodies run a
    # data-dependent number of times, so a scan there has no static place).
    unplaceable_parent: ClassVar[str | None] = None
    # Extraction refuses it inside a cond branch, where its residuals could not be
    # predicted exactly (the default: a new primitive is refused until it is checked).
    refused_in_cond: ClassVar[bool] = True
    # Why a function holding it has no region to checkpoint (None: the general reason).
    no_regions_because: ClassVar[str | None] = None

    @abstractmethod
    def known(self, analysis: Analysis[bool], eqn: Any, ins: list[bool]) -> list[bool]:
        """Which outputs partial evaluation finds known (``client.extract.known``)."""

    @abstractmethod
    def specs(self, analysis: Analysis, eqn: Any, ins: list) -> list:
        """Each output's sharding spec (``client.sharding_rules``)."""

    @abstractmethod
    def walk(self, walker: Walker, eqn: Any, refs: list[Ref], ctx: Context) -> list[Ref]:
        """The cost graph's nodes, or the backward pass's (``client.extract.walker``)."""

    def differentiated(self, analysis: Analysis[bool], eqn: Any, ins: list[bool]
                       ) -> list[bool]:
        """Which outputs carry a tangent (``client.peak.finding``): as a plain equation's
        unless its body is walked where it stands."""
        return analysis.equation(eqn, ins, {}, None)


class Call(ControlFlow):
    """A call (``jit``, ``closed_call``) or a nested checkpoint: its body where it stands."""

    entered = True
    refused_in_cond = False

    def known(self, analysis: Analysis[bool], eqn: Any, ins: list[bool]) -> list[bool]:
        return analysis.inner(body(eqn), ins)

    def specs(self, analysis: Analysis, eqn: Any, ins: list) -> list:
        return analysis.inner(body(eqn), ins)

    def walk(self, walker: Walker, eqn: Any, refs: list[Ref], ctx: Context) -> list[Ref]:
        return walker.call_rule(eqn, refs, ctx)

    def differentiated(self, analysis: Analysis[bool], eqn: Any, ins: list[bool]
                       ) -> list[bool]:
        return analysis.inner(body(eqn), ins)


class Checkpoint(Call):
    """A nested ``jax.checkpoint``: a call, but for the walk (flattened under a checkpoint,
    a region of a plan's step or the user's own policy outside one)."""

    entered = False  # its body is not searched: a region itself, or a barrier
    checkpoint = True
    barrier = True

    def walk(self, walker: Walker, eqn: Any, refs: list[Ref], ctx: Context) -> list[Ref]:
        return walker.checkpoint_rule(eqn, refs, ctx)

    def differentiated(self, analysis: Analysis[bool], eqn: Any, ins: list[bool]
                       ) -> list[bool]:
        return analysis.equation(eqn, ins, {}, None)  # placement finds regions inside


class Scan(ControlFlow):
    """``lax.scan``: consts, carry and xs; the body once per iteration."""

    layers = True
    barrier = True

    def known(self, analysis: Analysis[bool], eqn: Any, ins: list[bool]) -> list[bool]:
        nc, nk = jx.scan_counts(eqn.params)
        inner = eqn.params["jaxpr"].jaxpr
        carry = carry_fixpoint(analysis, inner, ins[:nc], ins[nc:nc + nk], ins[nc + nk:])
        outs = analysis.inner(inner, [*ins[:nc], *carry, *ins[nc + nk:]])
        return [*carry, *outs[nk:]]

    def specs(self, analysis: Analysis, eqn: Any, ins: list) -> list:
        n_consts, n_carry = jx.scan_counts(eqn.params)
        xs = [s[1:] if s else s for s in ins[n_consts + n_carry:]]  # one iteration's slice
        inner = analysis.inner(eqn.params["jaxpr"].jaxpr, [*ins[:n_consts + n_carry], *xs])
        # A carry keeps its initial split (XLA fixes a loop's state across iterations).
        return [*ins[n_consts:n_consts + n_carry],
                *[((),) + s if s else s for s in inner[n_carry:]]]

    def walk(self, walker: Walker, eqn: Any, refs: list[Ref], ctx: Context) -> list[Ref]:
        return walker.scan_rule(eqn, refs, ctx)


def carry_fixpoint(analysis: Analysis[bool], body: jx.Jaxpr, consts: Sequence[bool],
                   init: Sequence[bool], xs: Sequence[bool]) -> list[bool]:
    """The carry fixpoint of ``_scan_partial_eval_custom``: a carry is known while every
    iteration's output for it is."""
    carry = list(init)
    for _ in range(len(carry) + 1):
        outs = analysis.inner(body, [*consts, *carry, *xs])
        new = [c and o for c, o in zip(carry, outs[:len(carry)], strict=True)]
        if new == carry:
            return carry
        carry = new
    return carry


class Cond(ControlFlow):
    """``lax.cond``: an index, then one operand list every branch reads."""

    unplaceable_parent = "cond"

    def known(self, analysis: Analysis[bool], eqn: Any, ins: list[bool]) -> list[bool]:
        if not ins[0]:
            return [False] * len(eqn.outvars)
        per = [analysis.inner(b.jaxpr, ins[1:]) for b in eqn.params["branches"]]
        return [all(col) for col in zip(*per, strict=True)]

    def specs(self, analysis: Analysis, eqn: Any, ins: list) -> list:
        outs: list = []
        for branch in eqn.params["branches"]:  # every branch's variables; the last's outputs
            outs = analysis.inner(branch.jaxpr, ins[1:])
        return outs

    def walk(self, walker: Walker, eqn: Any, refs: list[Ref], ctx: Context) -> list[Ref]:
        return walker.cond_rule(eqn, refs, ctx)


class While(ControlFlow):
    """``lax.while_loop``: partial evaluation keeps it whole, known when all it reads is."""

    barrier = True
    unplaceable_parent = "while_loop"
    no_regions_because = (
        "its only loops are while_loops (a checkpointed scan such as "
        "eqx.internal.scan(kind='checkpointed') is one), which JAX cannot place "
        "remat in; write the layers as lax.scan or a Python loop")

    def known(self, analysis: Analysis[bool], eqn: Any, ins: list[bool]) -> list[bool]:
        return [all(ins)] * len(eqn.outvars)

    def specs(self, analysis: Analysis, eqn: Any, ins: list) -> list:
        nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        carry = ins[nc + nb:]
        analysis.inner(eqn.params["body_jaxpr"].jaxpr, [*ins[nc:nc + nb], *carry])
        return carry

    def walk(self, walker: Walker, eqn: Any, refs: list[Ref], ctx: Context) -> list[Ref]:
        return walker.while_rule(eqn, refs, ctx)


_BY_ROLE: dict[Role, ControlFlow] = {Role.CALL: Call(), Role.CHECKPOINT: Checkpoint(),
                                     Role.SCAN: Scan(), Role.COND: Cond(), Role.WHILE: While()}
# Every primitive the registry gives a control-flow role (``client.primitives``).
CONTROL_FLOW: dict[jx.core.Primitive, ControlFlow] = {
    p: _BY_ROLE[entry.role] for p, entry in REGISTRY.items() if entry.role in _BY_ROLE}
