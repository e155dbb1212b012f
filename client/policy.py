"""Policies a plan hands to ``jax.checkpoint``.

``jax.checkpoint`` caches its partial evaluation on the policy object, so a
policy is a frozen dataclass: immutable, hashable, picklable and stateless.
"""

from __future__ import annotations

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
