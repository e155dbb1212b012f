"""An Equinox layer stack (``eqx.filter_vmap`` to build, ``lax.scan`` to run) planned
with optiremat.

``eqx.partition`` splits the stacked layers into their arrays (the
differentiated parameters, one leading axis per layer) and everything else; the
scan body recombines one layer's slice with the rest, so ``jax.grad`` sees a
pure function of arrays. Run: ``.venv/bin/python examples/equinox_mlp.py``.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import optiremat

WIDTH, DEPTH = 64, 8
LAYERS = eqx.filter_vmap(lambda key: eqx.nn.Linear(WIDTH, WIDTH, key=key))(
    jax.random.split(jax.random.key(0), DEPTH))
PARAMS, STATIC = eqx.partition(LAYERS, eqx.is_array)


def loss(params, x, y):
    def step(h, layer_params):
        layer = eqx.combine(layer_params, STATIC)
        return h + jax.nn.gelu(jax.vmap(layer)(h)), None

    h, _ = lax.scan(step, x, params)
    return jnp.mean((h - y) ** 2)


def example_args():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, WIDTH)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((256, WIDTH)), jnp.float32)
    return PARAMS, x, y


def main() -> None:
    params, x, y = example_args()
    graph = optiremat.extract_step(loss, params, x, y)
    budget = (optiremat.min_feasible_budget(graph) + optiremat.max_useful_budget(graph)) // 2
    plan = optiremat.optimize(loss, params, x, y, budget=budget)
    check = plan.verify(loss, params, x, y, peak=True)
    assert check.exact and check.within_budget
    print(f"equinox: peak planned {plan.peak_bytes} B within {budget} B (XLA measures "
          f"{check.measured_peak_bytes} B), {plan.recompute_flops} recompute FLOPs")


if __name__ == "__main__":
    main()
