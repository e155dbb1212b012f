"""The names form of a plan: ``checkpoint_name`` on values plus ``save_only_these_names``.

It serves plans a stateless key policy cannot express (per-equation
decisions) and JAX's newer remat path, which honours only names-based
policies. The user's function is re-emitted with a uniquely named
``checkpoint_name`` after every equation the policy would be offered, so any
subset of values can be saved by naming it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

import optiremat.client._jax_internals as jx
from optiremat.client.extract import NAME_PREFIX, Traced
from optiremat.client.primitives import info


class _Tagger:
    def __init__(self) -> None:
        self.count = 0

    def name(self) -> str:
        n = f"{NAME_PREFIX}{self.count}"
        self.count += 1
        return n

    def sub(self, param):
        if isinstance(param, tuple):
            return tuple(self.sub(p) for p in param)
        if isinstance(param, jx.ClosedJaxpr):
            return jx.ClosedJaxpr(self.jaxpr(param.jaxpr), param.consts)
        return self.jaxpr(param)

    def jaxpr(self, jaxpr: jx.Jaxpr) -> jx.Jaxpr:
        subst: dict = {}

        def read(x):
            return subst.get(x, x) if isinstance(x, jx.Var) else x

        eqns = []
        for eqn in jaxpr.eqns:
            params = dict(eqn.params)
            # Where JAX offers the policy inside (never a while loop, nor a custom rule).
            for key in info(eqn.primitive).policy_jaxprs:
                params[key] = self.sub(params[key])
            eqns.append(eqn.replace(invars=[read(x) for x in eqn.invars], params=params))
            if eqn.primitive is jx.name_p:
                continue
            for out in eqn.outvars:
                if isinstance(out, jx.core.DropVar) or not hasattr(out.aval, "shape"):
                    continue
                named, name_eqn = jx.new_name_eqn(out, self.name(), eqn)
                eqns.append(name_eqn)
                subst[out] = named
        return jaxpr.replace(eqns=eqns, outvars=[read(x) for x in jaxpr.outvars])


def tag_every_value(traced: Traced) -> Callable:
    """``traced``'s function with a distinct ``checkpoint_name`` on every value."""
    jaxpr = _Tagger().jaxpr(traced.open_jaxpr)

    def tagged(*args, **kwargs):
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        if tree != traced.in_tree:
            raise TypeError(f"the names form was built for arguments {traced.in_tree}, got {tree}")
        out = jx.eval_jaxpr(jaxpr, traced.consts, *leaves)
        return jax.tree_util.tree_unflatten(traced.out_tree, out)

    return tagged
