"""Peak budgets on a device mesh: what one device holds, predicted and measured.

    .venv/bin/python bench/sharded.py            # 8 layers, T 128 (~10 min on 2 cores)
    .venv/bin/python bench/sharded.py --quick    # 4 layers, T 64, three budgets
    .venv/bin/python bench/sharded.py --points 3 dp fsdp tp_constrained   # some layouts
    .venv/bin/python bench/sharded.py --quick lm_dp lm_fsdp lm_tp_constrained   # the LM

On 8 simulated CPU devices, the Llama-style ``lax.scan`` stack of
``tests/mesh_models.py`` (D 256, F 688, 8 heads, B 8, f32) under data
parallel, FSDP and 2 x 4 tensor parallel layouts, each with and without a
``with_sharding_constraint`` inside the layer, and the corpus LM on the same
layouts (``lm_`` before the layout: ``sharded_lm``, 2 layers with its
``checkpoint_name``s, D 64, F 176, V 512, B 8; T 128, T 64 with ``--quick``). Per
layout it prints the
per-device peak of the step without remat (XLA's ``memory_analysis()``:
argument + output + temp - alias, ``client.step.measured_peak``) and, for
budgets from that peak down, the plan ``optimize`` answers: predicted and
measured per-device peak, whether it fits, its recompute FLOPs, the bytes
per device its recomputation moves between devices by the graph and by XLA's
collectives (beyond the step without remat), or the refusal and the smallest
feasible budget it names. ``mlp_fsdp_gathered`` is an FSDP MLP stack that
gathers its own weights (``tests/mesh_models.gathered_fsdp``), where the plan
chooses between holding them gathered and gathering them again.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import optiremat  # noqa: E402
from optiremat.client.peak.step_graph import step_extraction  # noqa: E402
from optiremat.client.step import Step, lowered_memory  # noqa: E402
from optiremat.solver.solution import InfeasibleBudgetError  # noqa: E402
from optiremat.solver.solve import min_feasible_budget  # noqa: E402
from optiremat.solver.units import format_bytes  # noqa: E402
from tests.mesh_models import LAYOUTS, gathered_fsdp, sharded_llama, sharded_lm  # noqa: E402

FULL_POINTS = 6
GATHERED = "mlp_fsdp_gathered"
QUICK_POINTS = 3


def layout_rows(name: str, points: int, layers: int, seq: int) -> dict:
    layout, constrained = name.removeprefix("lm_").split("_")[0], name.endswith("_constrained")
    if name == GATHERED:
        model = gathered_fsdp(layers=layers)
    elif name.startswith("lm_"):
        model = sharded_lm(layout, constrained, seq=seq)
    else:
        model = sharded_llama(layout, constrained, layers=layers, seq=seq)
    fun, args = model.loss, model.args
    started = time.perf_counter()
    step = Step.of(0)
    plain = lowered_memory(step.function(fun).lower(*args))
    no_remat = plain.peak_bytes
    print(f"\n## {model.name}: mesh {dict(model.mesh.shape)}, no-remat peak per device "
          f"{format_bytes(no_remat)}")
    low = min_feasible_budget(step_extraction(fun, args, Step.of(0)).graph)
    print(f"smallest feasible per-device budget the graph prices: {format_bytes(low)}")
    print(f"collectives of the step without remat: {format_bytes(plain.collective_bytes)} "
          "per device")
    print(f"{'budget':>11} {'status':>8} {'predicted':>11} {'measured':>11} {'error':>7} "
          f"{'fits':>5} {'recompute FLOPs':>16} {'moves (graph)':>14} {'moves (XLA)':>12}")
    errors, refused, fits, plans, flops_at_peak = [], 0, 0, 0, None
    link_errors: list[int] = []
    # From the no-remat peak down to the smallest feasible budget, and one below it,
    # which must be refused with the smallest feasible budget named.
    budgets = [no_remat - (no_remat - low) * k // (points - 1) for k in range(points)]
    for budget in [*budgets, int(low * 0.95)]:
        try:
            plan = optiremat.optimize(fun, *args, budget=budget)
        except InfeasibleBudgetError as err:
            refused += budget >= low
            print(f"{format_bytes(budget):>11}  refused (smallest feasible "
                  f"{format_bytes(err.min_budget_bytes)})")
            continue
        measured = plan.verify(fun, *args, peak=True).measured_peak_bytes
        assert measured is not None and plan.peak_bytes is not None
        error = (plan.peak_bytes - measured) / measured
        errors.append(error)
        plans += 1
        fits += measured <= budget
        if budget == no_remat:
            flops_at_peak = plan.recompute_flops
        # What the plan's recomputation moves between devices beyond the step without
        # remat: the graph's price, and XLA's collectives (the compile verify made).
        xla = (lowered_memory(step.function(plan.apply(fun)).lower(*args)).collective_bytes
               - plain.collective_bytes)
        link_errors.append(plan.collective_bytes - xla)
        print(f"{format_bytes(budget):>11} {plan.status:>8} {format_bytes(plan.peak_bytes):>11} "
              f"{format_bytes(measured):>11} {error:>+7.2%} "
              f"{'yes' if measured <= budget else 'NO':>5} {plan.recompute_flops:>16.4g} "
              f"{format_bytes(plan.collective_bytes):>14} {format_bytes(xla):>12}")
    span = f"{min(errors):+.2%} .. {max(errors):+.2%}" if errors else "-"
    worst = max(link_errors, key=abs, default=0)
    link = f"{worst / plain.collective_bytes:+.2%}" if plain.collective_bytes else "-"
    print(f"predicted - measured {span}; within budget {fits}/{plans}; refused between the "
          f"smallest and the no-remat peak {refused}; "
          f"at the no-remat peak it recomputes {flops_at_peak} FLOPs "
          f"({time.perf_counter() - started:.0f} s)")
    print(f"collectives the plans move, graph - XLA, at worst {format_bytes(worst)} "
          f"({link} of the step's)")
    return {"name": model.name, "no_remat": no_remat, "span": span, "fits": f"{fits}/{plans}",
            "refused": refused, "flops_at_peak": flops_at_peak, "link": link}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, T 64, three budgets")
    parser.add_argument("--points", type=int, help="budgets per layout, the ends included")
    parser.add_argument("layouts", nargs="*", help="dp, fsdp, tp, each optionally with "
                        "_constrained, and lm_ before one for the LM; mlp_fsdp_gathered "
                        "(default: all thirteen)")
    opts = parser.parse_args()
    layers, seq = (4, 64) if opts.quick else (8, 128)
    points = opts.points or (QUICK_POINTS if opts.quick else FULL_POINTS)
    names = opts.layouts or [f"{model}{layout}{suffix}" for model in ("", "lm_")
                             for layout in LAYOUTS for suffix in ("", "_constrained")
                             ] + [GATHERED]
    if any(name.removeprefix("lm_").split("_")[0] not in LAYOUTS and name != GATHERED
           for name in names):
        parser.error(f"layouts are {', '.join(LAYOUTS)}, each optionally with _constrained "
                     f"and lm_ before one for the LM, or {GATHERED}")
    rows = [layout_rows(name, points, layers, seq) for name in names]
    print("\n| layout | no-remat peak per device | predicted - measured | fits | refused "
          "| FLOPs recomputed at the no-remat peak | collectives, graph - XLA, at worst "
          "|\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {format_bytes(r['no_remat'])} | {r['span']} | {r['fits']} | "
              f"{r['refused']} | {r['flops_at_peak']} | {r['link']} |")


if __name__ == "__main__":
    main()
