"""The kinds of remat region a plan places, and what each kind knows of itself.

A *region* is code the plan checkpoints with its policy, so that the backward
pass recomputes it one region at a time. Two kinds, one protocol (``Region``):

* ``ScanRegion``: the body of a differentiated ``lax.scan``, checkpointed per
  iteration (the layers of a model, as MaxText and the ``nnx.scan``/``eqx``
  idioms write them), optionally in rematerialised groups of layers;
* ``BlockRegion``: a block of straight-line code, checkpointed once: a
  checkpoint the user wrote (``jax.checkpoint``, ``nn.remat``, ``nnx.remat``,
  ``eqx.filter_checkpoint``: its policy becomes the plan's), one of a run of
  repeated blocks (layers in a Python loop), or the equations of a name scope
  the user named.

Each kind says where it is (the call-like equations entered from the traced
function's jaxpr, ``path``, and its equations there, ``start:end``), what must
match when a plan is applied (``signature``), how ``plan.apply`` evaluates it
(``place``), the program its calibration compiles (``calibration_program``), and
its summary on the wire (``memory``). ``client.peak.finding`` finds them;
``client.peak.placement`` places them. A third kind (a ``while_loop`` body, say)
is a subclass here and a claim in the finder.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

import optiremat.client._jax_internals as jx
from optiremat.client.interpreter import CONTROL_FLOW
from optiremat.client.primitives import info
from optiremat.client.sharding import ONE_DEVICE, Layout, Spec
from optiremat.solver.errors import OptirematError
from optiremat.solver.step import REGION_NAMES, RegionFound, RegionKind, RegionMemory

Policy = Callable[..., Any]


class PlacementError(OptirematError, ValueError):
    """The function's structure cannot take the plan's regions; names the equation."""


@dataclass(frozen=True, kw_only=True)
class Region(ABC):
    """Code a plan checkpoints with its policy."""

    kind: ClassVar[RegionKind]

    index: int  # program order: the order in which placement meets regions
    path: tuple[int, ...]  # the call-like equations entered to reach its jaxpr
    start: int  # its first equation in that jaxpr
    end: int  # one past its last
    source: str  # its place in the user's code
    differentiated: tuple[bool, ...]  # per operand: whether it has a tangent
    # Its layout and, per operand (one layer's), its spec (None before the step's are read).
    layout: Layout = ONE_DEVICE
    operand_specs: tuple[Spec | None, ...] | None = None

    @property
    @abstractmethod
    def found(self) -> RegionFound:
        """How the finder came to it."""

    @property
    @abstractmethod
    def length(self) -> int:
        """How many times its code runs in one step (a scan's layers; 1 for a block)."""

    @property
    @abstractmethod
    def operand_vars(self) -> Sequence[jx.Var]:
        """The variables one run of its code reads, in the traced jaxpr."""

    @property
    @abstractmethod
    def signature(self) -> tuple:
        """What must match when a plan is applied to a function traced again."""

    @abstractmethod
    def boundary(self, eqns: Sequence) -> tuple[Sequence, Sequence]:
        """The variables its equations ``eqns`` read from before them, and those they
        make that the rest of the function reads."""

    @abstractmethod
    def place(self, eqns: Sequence, invals: Sequence, policy: Policy, groups: int,
              name_inputs: bool) -> list:
        """Evaluate its equations ``eqns`` at ``invals`` (the values of
        ``boundary(eqns)[0]``) under ``policy``: the values of ``boundary(eqns)[1]``."""

    @abstractmethod
    def calibration_program(self, saved_keys: frozenset[str] | None,
                            policy_of: Callable[[frozenset[str] | None], Policy]
                            ) -> tuple[Callable, tuple, list[bool]]:
        """A program whose backward pass is one run of this region's under the policy
        saving ``saved_keys`` (``policy_of``), differentiated operands first: (program,
        its abstract arguments, which of them are differentiated)."""

    @abstractmethod
    def calibration_correction(self, widened: Callable[[Any], bool]) -> int:
        """Bytes the step holds in this region's backward that its calibration program
        does not (positive) or holds there and prices elsewhere (negative); ``widened``
        says which values XLA keeps an f32 copy of where stacked."""

    @property
    def operand_avals(self) -> list:
        return [v.aval for v in self.operand_vars]

    def operand_bytes(self, i: int) -> int:
        """What one device holds of the ``i``-th operand (one layer's)."""
        spec = None if self.operand_specs is None else self.operand_specs[i]
        return self.layout.value_bytes(self.operand_avals[i], spec)

    @property
    def input_bytes(self) -> int:
        """One run's input: what nesting would keep per group (a scan's carry)."""
        return sum(self.operand_bytes(i) for i in range(len(self.operand_vars)))

    @property
    def slice_bytes(self) -> int:
        """One layer's slice of stacked operands and their gradients (scans only)."""
        return 0

    @property
    def nestable(self) -> bool:
        return False

    @property
    def program(self) -> tuple:
        """What identical regions share: the same code on operands of the same types
        (the first of a Python loop's layers may differ in which operands have tangents)."""
        return self.signature

    @property
    def calibration_key(self) -> tuple:
        """Identical regions share one calibration compile."""
        return (self.kind, self.signature, self.layout, self.operand_specs)

    def describe(self) -> str:
        """Where the region is and how it was found, for explain and errors."""
        return f"{REGION_NAMES[self.found]} at {self.source}"

    def memory(self, working_bytes: int) -> RegionMemory:
        """Its summary on the wire (``solver.step.RegionMemory``)."""
        return RegionMemory(source=self.source, length=self.length,
                            working_bytes=working_bytes, carry_bytes=self.input_bytes,
                            slice_bytes=self.slice_bytes, nestable=self.nestable,
                            kind=self.kind, found=self.found)

    def structs(self, avals: Sequence, specs: Sequence[Spec | None]) -> list:
        """Abstract arguments of these types, split as the step splits them on a mesh."""
        return [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.layout.sharding(s))
                for a, s in zip(avals, specs, strict=True)]


def called(eqn) -> jx.ClosedJaxpr:
    """The body of a call-like equation, with its consts."""
    inner = eqn.params[info(eqn.primitive).body]
    return inner if isinstance(inner, jx.ClosedJaxpr) else jx.ClosedJaxpr(inner, ())


def differentiated_outputs(eqn, ins: Sequence[bool]) -> list[bool]:
    """An output carries a tangent when some input does and it is a float."""
    any_in = any(ins)
    return [any_in and bool(jnp.issubdtype(v.aval.dtype, jnp.inexact)) for v in eqn.outvars]


def scalar_of(outputs: Sequence) -> Any:
    """The sum of a program's float outputs: what a calibration differentiates."""
    return sum((jnp.sum(o.astype(jnp.float32)) for o in outputs
                if jnp.issubdtype(o.dtype, jnp.inexact)), jnp.float32(0))


def run_inlined(eqns: Sequence, env: dict) -> None:
    """Evaluate ``eqns`` into ``env`` with the user's own checkpoints among them inlined:
    inside a region, the plan's policy governs every equation."""
    def read(x):
        return x.val if isinstance(x, jx.Literal) else env[x]

    for eqn in eqns:
        invals = [read(x) for x in eqn.invars]
        flow = CONTROL_FLOW.get(eqn.primitive)
        if flow is not None and flow.checkpoint:
            inner = called(eqn)
            sub = dict(zip(inner.jaxpr.constvars, inner.consts, strict=True))
            sub.update(zip(inner.jaxpr.invars, invals, strict=True))
            run_inlined(inner.jaxpr.eqns, sub)
            outs = [x.val if isinstance(x, jx.Literal) else sub[x] for x in inner.jaxpr.outvars]
        else:
            outs = jx.bind_equation(eqn, invals)
        env.update(zip(eqn.outvars, outs, strict=True))


def inline_checkpoints(jaxpr: jx.Jaxpr, consts: Sequence, args: Sequence) -> list:
    """Evaluate ``jaxpr`` with the user's own checkpoints inlined."""
    env: dict = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    run_inlined(jaxpr.eqns, env)
    return [x.val if isinstance(x, jx.Literal) else env[x] for x in jaxpr.outvars]


def interleave(first: Sequence[int], first_values: Sequence, rest: Sequence[int],
                rest_values: Sequence) -> list:
    operands: list = [None] * (len(first) + len(rest))
    for i, x in zip(first, first_values, strict=True):
        operands[i] = x
    for i, x in zip(rest, rest_values, strict=True):
        operands[i] = x
    return operands


def eqn_signature(eqn) -> str:
    """What two equations share when they do the same thing to values of the same types
    (the policy key: primitive, operand types, parameters)."""
    from optiremat.client.keys import policy_key
    return policy_key(eqn.primitive, [x.aval for x in eqn.invars], eqn.params)


def interface(eqns: Sequence, later: set) -> tuple[list, list]:
    """The variables a block of equations reads from before it (in order of first read)
    and those it makes that ``later`` (what runs after it, and the jaxpr's outputs)
    reads."""
    made: set = set()
    inputs: list = []
    seen: set = set()
    for eqn in eqns:
        for x in eqn.invars:
            if not isinstance(x, jx.Literal) and x not in made and x not in seen:
                seen.add(x)
                inputs.append(x)
        made.update(eqn.outvars)
    outputs = [v for eqn in eqns for v in eqn.outvars if v in later]
    return inputs, outputs
