"""A Flax NNX model planned with optiremat.

NNX modules are stateful objects; ``nnx.split`` turns one into a static graph
definition and a ``State`` pytree, and a pure loss over that state is what
``jax.checkpoint`` (and so optiremat) takes. Run: ``python examples/flax_nnx.py``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

import optiremat
from optiremat.solver.solve import max_useful_budget, min_feasible_budget


class MLP(nnx.Module):
    def __init__(self, width: int, depth: int, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = x + nnx.gelu(layer(self.norm(x)))
        return x


MODEL = MLP(width=32, depth=4, rngs=nnx.Rngs(0))
GRAPHDEF, _ = nnx.split(MODEL)


def loss(state, x, y):
    model = nnx.merge(GRAPHDEF, state)
    return jnp.mean((model(x) - y) ** 2)


def example_args():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    return nnx.state(MODEL, nnx.Param), x, y


def main() -> None:
    state, x, y = example_args()
    graph = optiremat.extract_graph(loss, state, x, y)
    budget = (min_feasible_budget(graph) + max_useful_budget(graph)) // 2
    plan = optiremat.optimize(loss, state, x, y, budget=budget)
    check = plan.verify(loss, state, x, y)
    assert check.exact and check.within_budget
    print(f"flax nnx: {plan.residual_bytes} B of residuals within {budget} B "
          f"(JAX measures {check.measured_bytes} B), {plan.recompute_flops} recompute FLOPs")
    # In training: jax.grad(jax.checkpoint(loss, policy=plan.policy))(state, x, y)


if __name__ == "__main__":
    main()
