"""Which outputs partial evaluation will find known, without building anything.

The same rules as the walk (``client.extract.walker``) at the level of one
flag per value: a call's outputs follow its body, a scan's carries reach the
fixpoint of ``_scan_partial_eval_custom``, a cond's outputs are known when
every branch knows them.
"""

from __future__ import annotations

from collections.abc import Sequence

import optiremat.client._jax_internals as jx
from optiremat.client.extract.state import Ref
from optiremat.client.primitives import Role, body, info


def known_outputs(jaxpr: jx.Jaxpr, known_in: Sequence[bool]) -> list[bool]:
    """Which outputs partial_eval will find known, without building anything."""
    env = dict(zip(jaxpr.invars, known_in, strict=True))
    env.update((v, True) for v in jaxpr.constvars)

    def read(x) -> bool:
        return True if isinstance(x, jx.Literal) else env[x]

    for eqn in jaxpr.eqns:
        ins = [read(x) for x in eqn.invars]
        role = info(eqn.primitive).role
        if role in (Role.CALL, Role.CHECKPOINT):
            outs = known_outputs(body(eqn), ins)
        elif role == Role.SCAN:
            p = eqn.params
            nc, nk = jx.scan_counts(p)
            inner = p["jaxpr"].jaxpr
            carry = scan_carry_known_flags(inner, ins[:nc], ins[nc:nc + nk], ins[nc + nk:])
            outs = known_outputs(inner, [*ins[:nc], *carry, *ins[nc + nk:]])
            outs = [*carry, *outs[nk:]]
        elif role == Role.COND:
            if not ins[0]:
                outs = [False] * len(eqn.outvars)
            else:
                per = [known_outputs(b.jaxpr, ins[1:]) for b in eqn.params["branches"]]
                outs = [all(col) for col in zip(*per, strict=True)]
        else:
            outs = [all(ins)] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(x) for x in jaxpr.outvars]


def scan_carry_known_flags(body, consts: Sequence[bool], init: Sequence[bool],
                            xs: Sequence[bool]) -> list[bool]:
    """The carry fixpoint of ``_scan_partial_eval_custom``."""
    carry = list(init)
    for _ in range(len(carry) + 1):
        outs = known_outputs(body, [*consts, *carry, *xs])
        new = [c and o for c, o in zip(carry, outs[:len(carry)], strict=True)]
        if new == carry:
            return carry
        carry = new
    return carry


def scan_carry_known(body, consts: Sequence[Ref], init: Sequence[Ref],
                      xs: Sequence[Ref]) -> list[bool]:
    return scan_carry_known_flags(body, [r.known for r in consts], [r.known for r in init],
                                   [r.known for r in xs])
