"""Source locations name the user's code: a peak plan's scan carries, rebuilt by the
placement, are reported at the user's ``lax.scan``, not at the library's line."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from jax import lax

import optiremat


def stack(ws, x):
    def layer(h, w):
        return h + jnp.tanh(h @ w), None
    h, _ = lax.scan(layer, x, ws)  # SCAN_LINE
    return jnp.mean(h ** 2)


SCAN_LINE = next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                 if line.endswith("# SCAN_LINE"))


def test_a_peak_plans_residuals_name_the_users_scan() -> None:
    ws, x = jnp.ones((8, 32, 32)) * 0.1, jnp.ones((64, 32))
    graph = optiremat.extract_step(stack, ws, x)
    budget = (optiremat.min_feasible_budget(graph) + optiremat.max_useful_budget(graph)) // 2
    plan = optiremat.optimize(stack, ws, x, budget=budget)
    carries = [source for primitive, source in zip(plan.graph.node_primitive,
                                                   plan.graph.node_source, strict=True)
               if primitive == "scan_carry"]
    assert carries and all(s.startswith(f"{__file__}:{SCAN_LINE}:") for s in carries)
    library = str(Path(optiremat.__file__).parent)
    assert not [s for s in plan.graph.node_source if s.startswith(library)]
    table = plan.explain().split("source\n", 1)[1]
    assert f"test_sources.py:{SCAN_LINE}:" in table and "placement.py" not in table
