"""A block of straight-line code: a region checkpointed once.

A checkpoint the user wrote (its policy becomes the plan's), one of a run of
repeated blocks (layers a Python loop unrolled), or the equations under a name
scope the user named. ``place`` wraps its equations in ``jax.checkpoint`` with
``prevent_cse`` on: in straight-line code that barrier is all that keeps XLA from
merging the recomputation back into the forward pass (``client.schedule``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import jax.numpy as jnp

import optiremat.client._jax_internals as jx
from optiremat.client.cost_model import aval_bytes
from optiremat.client.peak.regions import (
    Policy,
    Region,
    interleave,
    run_inlined,
    scalar_of,
)
from optiremat.solver.step import RegionFound, RegionKind


@dataclass(frozen=True, kw_only=True)
class BlockRegion(Region):
    """A block of straight-line code, checkpointed once by the plan's policy."""

    kind: ClassVar[RegionKind] = RegionKind.BLOCK

    how: RegionFound
    eqns: tuple  # its equations, in the traced jaxpr
    inputs: tuple[jx.Var, ...]
    outputs: tuple[jx.Var, ...]

    @property
    def found(self) -> RegionFound:
        return self.how

    @property
    def length(self) -> int:
        return 1

    @property
    def operand_vars(self) -> Sequence[jx.Var]:
        return self.inputs

    @property
    def signature(self) -> tuple:
        return _block_signature(self.eqns, self.inputs, len(self.outputs),
                                self.differentiated)

    @property
    def program(self) -> tuple:
        return self.signature[:-1]

    def boundary(self, eqns: Sequence) -> tuple[Sequence, Sequence]:
        return self.inputs, self.outputs

    def place(self, eqns: Sequence, invals: Sequence, policy: Policy, groups: int,
              name_inputs: bool) -> list:
        inputs, outputs = self.inputs, self.outputs

        def block(*values):
            env = dict(zip(inputs, values, strict=True))
            run_inlined(eqns, env)
            return [env[v] for v in outputs]

        # prevent_cse stays on: in straight-line code the barrier is what keeps XLA from
        # merging the recomputation back into the forward pass.
        with jx.user_context_of(eqns[0]):
            return jx.checkpoint(block, policy=policy, prevent_cse=True)(*invals)

    def calibration_program(self, saved_keys: frozenset[str] | None,
                            policy_of: Callable[[frozenset[str] | None], Policy]
                            ) -> tuple[Callable, tuple, list[bool]]:
        """The block alone under the policy; a scalar of its outputs."""
        specs = list(self.operand_specs or [None] * len(self.inputs))
        structs = self.structs(self.operand_avals, specs)
        diff = [i for i, d in enumerate(self.differentiated) if d]
        rest = [i for i, d in enumerate(self.differentiated) if not d]
        eqns, inputs, outputs = self.eqns, self.inputs, self.outputs

        def block(*values):
            env = dict(zip(inputs, values, strict=True))
            run_inlined(eqns, env)
            return [env[v] for v in outputs]

        checkpointed = jx.checkpoint(block, policy=policy_of(saved_keys), prevent_cse=True)

        def program(differentiated: Sequence, others: Sequence):
            return scalar_of(checkpointed(*interleave(diff, differentiated, rest, others)))

        args = ([structs[i] for i in diff], [structs[i] for i in rest])
        return program, args, [True] * len(diff) + [False] * len(rest)

    def calibration_correction(self, widened: Callable[[Any], bool]) -> int:
        # The cotangents of its outputs, which the step's backward hands the block and
        # holds through it; the program's are broadcasts of ones XLA never makes.
        avals: list[Any] = [v.aval for v in self.outputs]
        return sum(aval_bytes(a) for a in avals if jnp.issubdtype(a.dtype, jnp.inexact))


def _block_signature(eqns: Sequence, inputs: Sequence, outputs: int,
                     differentiated: Sequence[bool]) -> tuple:
    # The outputs' types follow from the equations'; their count is what placement uses.
    return (tuple(e.primitive.name for e in eqns), tuple(str(v.aval) for v in inputs),
            outputs, tuple(differentiated))
