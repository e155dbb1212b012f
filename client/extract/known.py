"""Which outputs partial evaluation will find known, without building anything.

The same rules as the walk (``client.extract.walker``) at the level of one
flag per value, on the one driver (``client.interpreter``): a plain equation's
outputs are known when all its inputs are; the control-flow objects' ``known``
hooks say the rest (a call's outputs follow its body, a scan's carries reach the
fixpoint of ``_scan_partial_eval_custom``, a cond's outputs are known when every
branch knows them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optiremat.client._jax_internals as jx
from optiremat.client.extract.state import Ref
from optiremat.client.interpreter import ControlFlow, FixedConstants, carry_fixpoint, interpret


class _Known(FixedConstants[bool]):
    """A flag per value: known (primal) or not; constants and literals are known."""

    constant = True

    def equation(self, eqn: Any, ins: list[bool], env: dict, scope: Any) -> list[bool]:
        return [all(ins)] * len(eqn.outvars)

    def control(self, flow: ControlFlow, eqn: Any, ins: list[bool]) -> list[bool]:
        return flow.known(self, eqn, ins)


KNOWN = _Known()


def known_outputs(jaxpr: jx.Jaxpr, known_in: Sequence[bool]) -> list[bool]:
    """Which outputs partial_eval will find known, without building anything."""
    return interpret(KNOWN, jaxpr, known_in)[0]


def scan_carry_known(body: jx.Jaxpr, consts: Sequence[Ref], init: Sequence[Ref],
                     xs: Sequence[Ref]) -> list[bool]:
    """Which of a scan's carries partial evaluation keeps known (its carry fixpoint)."""
    return carry_fixpoint(KNOWN, body, [r.known for r in consts], [r.known for r in init],
                          [r.known for r in xs])
