"""A deep residual stack written with ``lax.scan``, planned with optiremat.

Run it: ``python examples/scan_jax.py``. From the command line::

    optiremat extract examples/scan_jax.py:loss --out loss.graph.json
    optiremat solve loss.graph.json --budget 64KiB --out plan.json
    optiremat explain plan.json
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import optiremat
from optiremat.solver.solve import max_useful_budget, min_feasible_budget

LAYERS, WIDTH, BATCH = 16, 64, 32


def loss(params, x):
    """Sixteen tanh layers with residual connections, one ``lax.scan`` step each."""
    def layer(h, wb):
        w, b = wb
        return h + jnp.tanh(h @ w + b), None

    h, _ = lax.scan(layer, x, (params["w"], params["b"]))
    return jnp.mean(h ** 2)


def example_args():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((LAYERS, WIDTH, WIDTH)) * 0.1, jnp.float32),
              "b": jnp.zeros((LAYERS, WIDTH), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((BATCH, WIDTH)), jnp.float32)
    return params, x


def main() -> None:
    params, x = example_args()
    graph = optiremat.extract_graph(loss, params, x)
    low, high = min_feasible_budget(graph), max_useful_budget(graph)
    budget = (low + high) // 2
    plan = optiremat.optimize(loss, params, x, budget=budget)
    check = plan.verify(loss, params, x)
    print(f"budget {budget} B: plan keeps {plan.residual_bytes} B (JAX measures "
          f"{check.measured_bytes} B), recomputes {plan.recompute_flops} FLOPs; "
          f"saving everything keeps {high} B")

    grads = jax.grad(jax.checkpoint(loss, policy=plan.policy))(params, x)
    reference = jax.grad(loss)(params, x)
    assert all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in
               zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(reference),
                   strict=True))
    print("gradients match the unchecked function")


if __name__ == "__main__":
    main()
