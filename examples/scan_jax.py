"""A deep residual stack written with ``lax.scan``, planned for its peak with optiremat.

Run it: ``.venv/bin/python examples/scan_jax.py``. From the command line::

    .venv/bin/optiremat extract examples/scan_jax.py:loss --out loss.graph.json
    .venv/bin/optiremat solve loss.graph.json --budget 2MiB --out plan.json
    .venv/bin/optiremat explain plan.json
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import optiremat

LAYERS, WIDTH, BATCH = 16, 64, 256


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
    graph = optiremat.extract_step(loss, params, x)
    low, high = optiremat.min_feasible_budget(graph), optiremat.max_useful_budget(graph)
    plan = optiremat.optimize(loss, params, x, budget=(low + high) // 2)
    check = plan.verify(loss, params, x, peak=True)
    assert check.exact and check.within_budget
    print(f"peak budget {plan.budget_bytes} B: planned {plan.peak_bytes} B, XLA measures "
          f"{check.measured_peak_bytes} B; {plan.recompute_flops} recompute FLOPs; "
          f"without remat {high} B")

    grads = jax.jit(jax.grad(plan.apply(loss)))(params, x)
    reference = jax.grad(loss)(params, x)
    assert all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in
               zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(reference),
                   strict=True))
    print("gradients match the function without remat")


if __name__ == "__main__":
    main()
