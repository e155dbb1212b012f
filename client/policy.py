"""Policies a plan hands to ``jax.checkpoint``.

``jax.checkpoint`` caches its partial evaluation on the policy object, so a
policy is a frozen dataclass: immutable, hashable, picklable and stateless.

JAX's ``jax_remat3`` path asks a policy only about dots, convolutions and
named values (on 0.10 and 0.11 about dots only where it is a
``DotsSaveable``): no policy object can carry a plan there, since a plan saves
other values too (a tanh, or ``one_minus_square``, which only tanh's derivative
computes). The plan's own ``apply``/``checkpoint`` build on JAX's partial-eval
path under either flag (``_jax_internals.checkpoint``); handing ``plan.policy``
to ``jax.checkpoint`` while the flag is on warns.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import optiremat.client._jax_internals as jx
from optiremat.client.keys import policy_key


@dataclass(frozen=True)
class KeyPolicy:
    """Save exactly the equations whose policy key is in ``saved_keys``.

    Keys not in the plan (a different shape, a different function) are
    recomputed: that never costs memory the plan did not account for.
    """

    saved_keys: frozenset[str]
    offloaded_keys: frozenset[str] = frozenset()
    offload_src: str = "device"
    offload_dst: str = "pinned_host"

    def __call__(self, prim, *avals, **params):
        key = policy_key(prim, avals, params)
        if key in self.saved_keys:
            return jx.Saveable
        if key in self.offloaded_keys:
            return jx.Offloadable(src=self.offload_src, dst=self.offload_dst)
        return jx.Recompute


REMAT3_WARNING = (
    "jax_remat3 is on: JAX's remat3 path asks a policy only about dots, convolutions and "
    "named values, so jax.checkpoint(fun, policy=plan.policy) recomputes the rest of what "
    "the plan saves. plan.apply(fun), or a residual plan's plan.checkpoint(fun), places the "
    "plan on JAX's partial-eval path under either flag.")


def warn_under_remat3() -> None:
    """Warn where a plan's policy is taken out for ``jax.checkpoint`` with remat3 on."""
    if jx.remat3_on():
        warnings.warn(REMAT3_WARNING, RuntimeWarning, stacklevel=3)
