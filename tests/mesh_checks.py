"""Peak plans on 8 simulated devices, run as its own process: ``python -m tests.mesh_checks``.

XLA reads ``--xla_force_host_platform_device_count`` once, when JAX starts, so the
flag is set here before JAX is imported, in a process of its own
(``tests/test_sharded.py`` runs it; under pytest-xdist any flag set in the
suite's process would change every module's devices). It plans the small
sharded Llama stack and LM of ``tests/mesh_models.py`` (an LM layout's name
starts ``lm_``) on every layout and prints, as one
JSON object, per layout: XLA's no-remat per-device peak, the smallest budget
the graph prices, and per budget from that peak down to the smallest the plan's
predicted and measured per-device peak, its recompute FLOPs, the bytes per
device its recomputation moves between devices by the graph and by XLA's
collectives (``client.hlo_collectives``: beyond the step without remat), and
whether its gradients and their shardings are those of the step without a plan.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import json  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import optiremat  # noqa: E402
from optiremat.client.peak.step_graph import step_extraction  # noqa: E402
from optiremat.client.step import Step, lowered_memory  # noqa: E402
from optiremat.solver.solution import InfeasibleBudgetError  # noqa: E402
from optiremat.solver.solve import min_feasible_budget  # noqa: E402
from tests.mesh_models import (  # noqa: E402
    LAYOUTS,
    Sharded,
    gathered_fsdp,
    sharded_llama,
    sharded_lm,
)

# Small enough to compile quickly on 8 simulated devices, split evenly on every layout.
SIZES = dict(layers=4, seq=32, batch=8, d=64, ffn=176)
# The LM's layers without their checkpoint names: at the smallest budget refinement
# measures each named value saved as a candidate, 6-10 more compiles of the step per
# layout (about 13 s on two cores); bench/sharded.py plans the LM with them.
LM_SIZES = dict(layers=2, seq=32, batch=8, d=64, ffn=176, vocab=512, named=False)


def model_of(name: str) -> Sharded:
    """``[lm_]layout[_constrained]``: the LM or the Llama stack on that layout; or the
    stack that gathers its own weights."""
    if name == "mlp_fsdp_gathered":
        return gathered_fsdp()
    lm = name.startswith("lm_")
    layout = name.removeprefix("lm_").split("_")[0]
    assert layout in LAYOUTS, name
    constrained = name.endswith("_constrained")
    if lm:
        return sharded_lm(layout, constrained, **LM_SIZES)
    return sharded_llama(layout, constrained, **SIZES)


def same_gradients(fun: Any, plan: optiremat.Plan, args: tuple) -> bool:
    plain = jax.jit(jax.grad(fun))(*args)
    placed = jax.jit(jax.grad(plan.apply(fun)))(*args)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(placed), strict=True):
        if not a.sharding.is_equivalent_to(b.sharding, a.ndim):
            return False
        if not np.allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6):
            return False
    return True


def check(model: Sharded, budgets: int = 2, middle: bool = False) -> dict:
    """``budgets`` per-device budgets from the no-remat peak down to the smallest (and,
    with ``middle``, one 20% of the way up, where a scan's layers may be planned apart)."""
    fun, args = model.loss, model.args
    step = Step.of(0)
    no_remat = lowered_memory(step.function(fun).lower(*args))
    graph = step_extraction(fun, args, step).graph
    low = min_feasible_budget(graph)
    plans = []
    # Each compile of a step on 8 simulated devices takes seconds: the two ends of the
    # per-device budgets here, the budgets between are bench/sharded.py's.
    top = no_remat.peak_bytes
    chosen = [top - (top - low) * k // (budgets - 1) for k in range(budgets)]
    if middle:  # where a mix beats one policy per stack on both layouts (jax 0.10.2, 0.12.1)
        chosen.insert(1, low + (top - low) * 2 // 10)
    for budget in chosen:
        try:
            plan = optiremat.optimize(fun, *args, budget=budget)
        except InfeasibleBudgetError as err:
            plans.append({"budget": budget, "refused": err.min_budget_bytes})
            continue
        measured = plan.verify(fun, *args, peak=True).measured_peak_bytes
        # The step under the plan, as verify compiled it (remembered by program text).
        placed = lowered_memory(step.function(plan.apply(fun)).lower(*args))
        plans.append({"budget": budget, "predicted": plan.peak_bytes, "measured": measured,
                      "flops": plan.recompute_flops,
                      "collectives": plan.collective_bytes,
                      "xla_collectives": placed.collective_bytes - no_remat.collective_bytes,
                      "layer_groups": [layers for _, layers, _ in plan.layer_groups],
                      # Run at the smallest budget, where the plan recomputes the most, and
                      # where the layers are planned apart.
                      "same_gradients": same_gradients(fun, plan, args)
                      if budget == low or plan.layer_groups else None})
    return {"no_remat": top, "low": low, "plans": plans, "graph": graph.canonical_json(),
            "mesh": [graph.mesh.axis_names, graph.mesh.axis_sizes] if graph.mesh else None,
            "schema_version": graph.schema_version,
            "step_collectives": no_remat.collective_bytes}


# Every mesh with and without the constraint inside the layer, across the Llama stack and
# the LM (bench/sharded.py runs all twelve), and the stack that gathers its own weights.
CHECKED = ("dp", "fsdp_constrained", "tp_constrained", "lm_dp_constrained", "lm_fsdp", "lm_tp",
           "mlp_fsdp_gathered")


# Layouts also planned between their ends, where one policy per stack leaves room.
PLANNED_APART = ("dp", "tp_constrained")


def main() -> None:
    names = sys.argv[1:] or list(CHECKED)
    # The gathered weights' stack compiles in a fraction of a second: three budgets.
    out = {name: check(model_of(name), 3 if name == "mlp_fsdp_gathered" else 2,
                       middle=name in PLANNED_APART) for name in names}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
