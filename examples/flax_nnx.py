"""A Flax NNX layer stack (``nnx.vmap`` to build, ``nnx.scan`` to run) planned with optiremat.

NNX modules are stateful objects; ``nnx.split`` turns one into a static graph
definition and a ``State`` pytree, and a pure loss over that state is what
``jax.grad`` (and so optiremat) takes. ``nnx.scan`` lowers to ``lax.scan``, whose
body becomes the plan's remat region: ``plan.apply(loss)`` replaces an
``nnx.remat`` the model might carry. Run: ``.venv/bin/python examples/flax_nnx.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import optiremat

WIDTH, DEPTH = 64, 8


class Block(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.linear = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
        return x + nnx.gelu(self.linear(self.norm(x)))


class Stack(nnx.Module):
    def __init__(self, width: int, depth: int, rngs: nnx.Rngs) -> None:
        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs: nnx.Rngs) -> Block:
            return Block(width, rngs)

        self.blocks = create(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block: Block):
            return block(x)

        return forward(x, self.blocks)


GRAPHDEF, _ = nnx.split(Stack(WIDTH, DEPTH, nnx.Rngs(0)))


def loss(state, x, y):
    model = nnx.merge(GRAPHDEF, state)
    return jnp.mean((model(x) - y) ** 2)


def example_args():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, WIDTH)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((256, WIDTH)), jnp.float32)
    return nnx.state(Stack(WIDTH, DEPTH, nnx.Rngs(0))), x, y


def main() -> None:
    state, x, y = example_args()
    graph = optiremat.extract_step(loss, state, x, y)
    budget = (optiremat.min_feasible_budget(graph) + optiremat.max_useful_budget(graph)) // 2
    plan = optiremat.optimize(loss, state, x, y, budget=budget)
    check = plan.verify(loss, state, x, y, peak=True)
    assert check.exact and check.within_budget
    print(f"flax nnx: peak planned {plan.peak_bytes} B within {budget} B (XLA measures "
          f"{check.measured_peak_bytes} B), {plan.recompute_flops} recompute FLOPs")
    grads = jax.jit(jax.grad(plan.apply(loss)))(state, x, y)  # in training
    reference = jax.grad(loss)(state, x, y)
    assert all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in
               zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True))


if __name__ == "__main__":
    main()
