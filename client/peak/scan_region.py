"""The body of a differentiated ``lax.scan``: a region checkpointed per iteration.

The layers of a model as MaxText and the ``nnx.scan``/``eqx`` idioms write them:
``place`` rebuilds the scan over ``jax.checkpoint(body, policy=...)`` (in
rematerialised groups of layers where the plan nests them), and its calibration
compiles the scan alone at its real length (XLA compiles a loop's body once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import optiremat.client._jax_internals as jx
from optiremat.client.peak.layer_groups import grouped_scan
from optiremat.client.peak.regions import (
    PlacementError,
    Policy,
    Region,
    inline_checkpoints,
    interleave,
    scalar_of,
)
from optiremat.solver.step import RegionFound, RegionKind

# The name a layer's input takes inside its checkpoint when a plan may offload it:
# JAX offers a checkpoint's inputs to no policy, so the stacked layer inputs a scan
# keeps for its backward pass could never leave the device (jax#23869); named, the
# layers read the named value, and offloading it leaves the input itself unread.
LAYER_INPUT = "optiremat/layer_input"


@dataclass(frozen=True, kw_only=True)
class ScanRegion(Region):
    """The body of one differentiated ``lax.scan``, checkpointed per iteration."""

    kind: ClassVar[RegionKind] = RegionKind.SCAN

    scan_length: int
    num_consts: int
    num_carry: int
    body: jx.ClosedJaxpr  # the scan's body: (consts, carry, x) -> (carry, y)
    reverse: bool = False

    @classmethod
    def of(cls, index: int, path: tuple[int, ...], position: int, eqn,
           differentiated: Sequence[bool]) -> ScanRegion:
        p = eqn.params
        n_consts, n_carry = jx.scan_counts(p)
        return cls(index=index, path=path, start=position, end=position + 1,
                   source=jx.source_of(eqn), differentiated=tuple(differentiated),
                   scan_length=int(p["length"]), num_consts=n_consts, num_carry=n_carry,
                   body=p["jaxpr"], reverse=bool(p["reverse"]))

    @property
    def found(self) -> RegionFound:
        return RegionFound.SCAN

    @property
    def length(self) -> int:
        return self.scan_length

    @property
    def operand_vars(self) -> Sequence[jx.Var]:
        return self.body.jaxpr.invars

    @property
    def carry_avals(self) -> list:
        """One layer's input: the types of the scan's carry."""
        return list(self.body.in_avals[self.num_consts:self.num_consts + self.num_carry])

    @property
    def input_bytes(self) -> int:
        """One layer's input: the bytes of the scan's carry (one device's)."""
        return sum(self.operand_bytes(i)
                   for i in range(self.num_consts, self.num_consts + self.num_carry))

    carry_bytes = input_bytes

    @property
    def xs_bytes(self) -> int:
        """One layer's slice of the scan's stacked operands (its parameters)."""
        return sum(self.operand_bytes(i)
                   for i in range(self.num_consts + self.num_carry, len(self.body.in_avals)))

    @property
    def slice_bytes(self) -> int:
        first = self.num_consts + self.num_carry
        gradients = sum(self.operand_bytes(i) for i in range(first, len(self.body.in_avals))
                        if self.differentiated[i])
        return self.xs_bytes + gradients

    @property
    def nestable(self) -> bool:
        return not self.reverse

    @property
    def signature(self) -> tuple:
        return (self.scan_length, self.num_consts, self.num_carry, self.differentiated,
                tuple(str(a) for a in self.body.in_avals),
                tuple(str(a) for a in self.body.out_avals))

    def boundary(self, eqns: Sequence) -> tuple[Sequence, Sequence]:
        (eqn,) = eqns
        return eqn.invars, eqn.outvars

    def place(self, eqns: Sequence, invals: Sequence, policy: Policy, groups: int,
              name_inputs: bool) -> list:
        (eqn,) = eqns
        p, nc, nk = eqn.params, self.num_consts, self.num_carry
        consts = list(invals[:nc])
        init, xs = list(invals[nc:nc + nk]), list(invals[nc + nk:])
        checkpointed = self._checkpointed_layer(eqn, policy, name_inputs)

        def step(carry, x):
            out = checkpointed(*consts, *carry, *x)
            return list(out[:nk]), list(out[nk:])

        unroll = looped_unroll(p["unroll"], self.length)
        # The rebuilt scan keeps the user's scan's place in their code (what explain and
        # error messages name), not this line's.
        with jx.user_context_of(eqn):
            if groups == 1:
                carry, ys = lax.scan(step, init, xs, length=self.length, reverse=p["reverse"],
                                     unroll=unroll)
                return [*carry, *ys]
            return _grouped_scan(step, init, xs, self.length, groups, unroll)

    def place_layer_groups(self, eqns: Sequence, invals: Sequence,
                           layer_policies: Sequence[tuple[int, Policy]],
                           name_inputs: bool) -> list:
        """Evaluate the scan with its layers in consecutive groups, ``(layers, policy)``
        in program order, each layer checkpointed by its group's policy
        (``client.peak.layer_groups``)."""
        (eqn,) = eqns
        nc, nk = self.num_consts, self.num_carry
        layers = []
        for size, policy in layer_policies:
            checkpointed = self._checkpointed_layer(eqn, policy, name_inputs)

            def layer(k, c, x, checkpointed=checkpointed):
                out = checkpointed(*k, *c, *x)
                return list(out[:nk]), list(out[nk:])
            layers.append((size, layer))
        with jx.user_context_of(eqn):
            carry, ys = grouped_scan(layers, invals[:nc], invals[nc:nc + nk], invals[nc + nk:],
                                     unroll=looped_unroll(eqn.params["unroll"], self.length))
        return [*carry, *ys]

    def _checkpointed_layer(self, eqn, policy: Policy, name_inputs: bool) -> Callable:
        """One layer, ``(*consts, *carry, *x) -> (*carry, *y)``, checkpointed by ``policy``."""
        body, nc, nk = eqn.params["jaxpr"], self.num_consts, self.num_carry

        def layer(*inputs):
            if name_inputs:
                inputs = (*inputs[:nc],
                          *(checkpoint_name(c, LAYER_INPUT) for c in inputs[nc:nc + nk]),
                          *inputs[nc + nk:])
            return inline_checkpoints(body.jaxpr, body.consts, inputs)

        # prevent_cse is off: the loop already keeps XLA from merging the recomputation
        # with the forward pass, and the barrier would stop fusion across it (JAX's advice
        # for checkpoints in scans).
        return jx.checkpoint(layer, policy=policy, prevent_cse=False)

    def calibration_program(self, saved_keys: frozenset[str] | None,
                            policy_of: Callable[[frozenset[str] | None], Policy]
                            ) -> tuple[Callable, tuple, list[bool]]:
        """The region's scan with its body under the policy; a scalar of its outputs."""
        body, nc, nk, length = self.body, self.num_consts, self.num_carry, self.length
        avals = list(body.in_avals)
        specs = list(self.operand_specs or [None] * len(avals))
        # Stacked operands: the layers' axis is whole.
        stacked = [jax.core.ShapedArray((length, *a.shape), a.dtype) for a in avals[nc + nk:]]
        stacked_specs = [None if s is None else ((), *s) for s in specs[nc + nk:]]
        structs = (self.structs(avals[:nc + nk], specs[:nc + nk])
                   + self.structs(stacked, stacked_specs))
        diff = [i for i, d in enumerate(self.differentiated) if d]
        rest = [i for i, d in enumerate(self.differentiated) if not d]
        checkpointed = jx.checkpoint(lambda *xs: jx.eval_jaxpr(body.jaxpr, body.consts, *xs),
                                      policy=policy_of(saved_keys), prevent_cse=False)

        def program(differentiated: Sequence, others: Sequence):
            operands = interleave(diff, differentiated, rest, others)
            consts, init, xs = operands[:nc], operands[nc:nc + nk], operands[nc + nk:]

            def step(carry, x):
                out = checkpointed(*consts, *carry, *x)
                return list(out[:nk]), list(out[nk:])

            carry, ys = lax.scan(step, list(init), list(xs), length=length)
            return scalar_of([*carry, *ys])

        args = ([structs[i] for i in diff], [structs[i] for i in rest])
        return program, args, [True] * len(diff) + [False] * len(rest)

    def calibration_correction(self, widened: Callable[[Any], bool]) -> int:
        carries = range(self.num_consts, self.num_consts + self.num_carry)
        # Less one layer's input: the scan stacks every layer's input, the first one's
        # too, which is an argument there (priced at nothing) and in the step a value its
        # graph prices where it is made. Measured: without this the prediction ran one
        # carry high on every model of the scan corpus (two on CPU for bf16: its f32 copy).
        first_input = sum(self.operand_bytes(i) * (2 if widened(a) else 1)
                          for i, a in zip(carries, self.carry_avals, strict=True))
        # Plus the cotangent of the last layer's output, which the step's backward hands
        # the region and holds through it; the program's is a broadcast of ones XLA never
        # makes. Measured: without it the layers' phase ran one carry low on the scan corpus.
        cotangent = sum(self.operand_bytes(i)
                        for i, a in zip(carries, self.carry_avals, strict=True)
                        if jnp.issubdtype(a.dtype, jnp.inexact))
        return cotangent - first_input


def looped_unroll(unroll: int | bool, length: int) -> int | bool:
    """The unroll a placed scan takes: the user's, unless it unrolls every layer.

    A fully unrolled scan is straight-line code, where a checkpoint without
    ``prevent_cse`` is merged by XLA with the forward pass it recomputes: the
    layers then keep what they would without remat, and the stack is priced as
    the loop it no longer is. Measured (tests/peak_models.py's ``named_axes_L4``,
    ``lax.scan(unroll=True)`` as penzai's layer stack writes it): nothing_saveable
    per layer held the no-remat peak, everything_saveable was priced 80% over
    XLA's. Placed as a loop, the plan's layers hold what the scan model prices.
    """
    if unroll is True or (not isinstance(unroll, bool) and unroll >= length):
        return 1
    return unroll


def divisors(length: int) -> list[int]:
    """The group counts a scan of ``length`` layers can take."""
    return [k for k in range(1, length + 1) if length % k == 0]


def check_groups(region: Region, groups: int) -> None:
    """Refuse a group count the region cannot take, naming the ones it can."""
    if groups == 1:
        return
    region = _scan_running_forward(region, "it cannot be nested in groups (groups=1)",
                                   "can only be checkpointed one by one (groups=1)")
    if groups not in divisors(region.length):
        # A remainder group slices the stacked parameters, and XLA copies the slice:
        # +45 to +58 MiB on a 64-layer stack whose nesting saves 39 MiB (bench/peak.py).
        raise PlacementError(
            f"{groups} groups of the {region.length} layers of the lax.scan at {region.source} "
            f"leave a remainder, whose slice XLA copies; it takes {divisors(region.length)}")


def _scan_running_forward(region: Region, once: str, reversed_layers: str) -> ScanRegion:
    """``region``, a scan running forward, or PlacementError saying why not."""
    if not isinstance(region, ScanRegion):
        raise PlacementError(f"the {region.describe()} runs once: {once}")
    if region.reverse:
        raise PlacementError(f"the lax.scan at {region.source} runs in reverse: its layers "
                             f"{reversed_layers}")
    return region


def check_layer_groups(region: Region, layer_policies: Sequence[tuple[int, Any]]) -> None:
    """Refuse layer groups the region cannot take: a scan's, running forward, whose
    sizes add up to its length; or a block's one group of its one run (a policy of its
    own, ``client.peak.block_mixing``)."""
    sizes = [size for size, _ in layer_policies]
    if not isinstance(region, ScanRegion) and region.length == 1:
        if sizes != [1]:
            raise PlacementError(f"the {region.describe()} runs once: it takes one policy "
                                 f"of its own, not layer groups of {sizes}")
        return
    region = _scan_running_forward(region, "its layers cannot be planned apart",
                                   "take one policy")
    if any(size < 1 for size in sizes) or sum(sizes) != region.length:
        raise PlacementError(f"layer groups of {sizes} layers do not make the "
                             f"{region.length} layers of the lax.scan at {region.source}")


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
