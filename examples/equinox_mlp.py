"""An Equinox model planned with optiremat.

``eqx.partition`` splits the model into its arrays (the differentiated
parameters) and everything else; the loss recombines them, so ``jax.checkpoint``
sees a pure function of arrays. Run: ``python examples/equinox_mlp.py``.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import optiremat
from optiremat.solver.solve import max_useful_budget, min_feasible_budget

MODEL = eqx.nn.MLP(in_size=32, out_size=8, width_size=64, depth=3, activation=jax.nn.gelu,
                   key=jax.random.key(0))
PARAMS, STATIC = eqx.partition(MODEL, eqx.is_array)


def loss(params, x, y):
    model = eqx.combine(params, STATIC)
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def example_args():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    return PARAMS, x, y


def main() -> None:
    params, x, y = example_args()
    graph = optiremat.extract_graph(loss, params, x, y)
    budget = (min_feasible_budget(graph) + max_useful_budget(graph)) // 2
    plan = optiremat.optimize(loss, params, x, y, budget=budget)
    check = plan.verify(loss, params, x, y)
    assert check.exact and check.within_budget
    print(f"equinox: {plan.residual_bytes} B of residuals within {budget} B "
          f"(JAX measures {check.measured_bytes} B), {plan.recompute_flops} recompute FLOPs")


if __name__ == "__main__":
    main()
