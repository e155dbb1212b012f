"""A function traced as ``jax.checkpoint`` traces it: flat, consts first."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp

import optiremat.client._jax_internals as jx
from optiremat.client.sharding import Layout, argument_names, mesh_layout
from optiremat.client.step import StepError


@dataclass(frozen=True)
class Traced:
    """A function traced as ``jax.checkpoint`` traces it: flat, consts first."""

    closed: jx.ClosedJaxpr  # consts converted to leading inputs
    open_jaxpr: jx.Jaxpr  # the same with consts as constvars
    consts: list
    in_tree: object
    out_tree: object
    num_consts: int
    flat_args: list
    layout: Layout  # the mesh the arguments are placed on, or one device

    def check_differentiable(self) -> None:
        """Refuse a function with no floating-point output: ``jax.grad`` rejects it (and
        the step sums only float outputs), so there is no backward pass to plan."""
        outs = self.closed.out_avals
        if not any(jnp.issubdtype(a.dtype, jnp.inexact) for a in outs):
            found = ", ".join(str(a.str_short()) for a in outs) or "nothing"
            raise StepError(f"the function returns {found}: no floating-point output to "
                            "differentiate, so there is no backward pass to plan (return the "
                            "loss, not an index such as jnp.argmax)")


def trace(fun: Callable, args: Sequence, kwargs: dict) -> Traced:
    flat_args, in_tree = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)))
    out_tree_box: list = []

    def flat_fun(*leaves):
        a, k = jax.tree_util.tree_unflatten(in_tree, leaves)
        out = fun(*a, **k)
        leaves_out, tree = jax.tree_util.tree_flatten(out)
        out_tree_box.append(tree)
        return leaves_out

    layout = mesh_layout(flat_args, argument_names(in_tree, len(flat_args)))
    with jx.remat2():  # the user's own checkpoints as remat_p, which extraction reads
        closed = jax.make_jaxpr(flat_fun)(*flat_args)
    return Traced(jx.close_with_consts_as_inputs(closed), closed.jaxpr, list(closed.consts),
                  in_tree,
                  out_tree_box[-1], len(closed.consts), flat_args, layout)
