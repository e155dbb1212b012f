"""Plans with their saves priced (``optimize(..., save_price=)``) against plans by FLOPs
alone, timed (issue 39: where FLOPs and time disagree).

For each model, at budgets spread between its smallest plan and its no-remat peak (or
those ``--at`` names): the plan by FLOPs alone, the plans with saves priced at this
device's measured price (``optiremat.measured_save_price()``) and at a quarter of it
(``--prices``), and the best built-in per layer that fits the budget. Per plan its
measured peak (XLA's ``memory_analysis()``), recompute FLOPs by the project's rule,
XLA's bytes accessed (a loop body once) and the time to plan; then every step timed in
one process, interleaved runs, medians and spread in ms. The summary line counts the
budgets where each priced plan ran faster than the plan by FLOPs, with the least,
greatest and median ratio of their medians.

    .venv/bin/python bench/priced_saves.py [--quick] [--accelerator] [--rounds N]
                                           [--budgets K | --at MiB ...] [--prices M ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
from layer_groups import (  # noqa: E402
    MiB,
    best_builtin,
    models,
    plan_at,
    stack_options,
    step_of,
    timed,
    xla_flops,
)

import optiremat  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    stack_options(parser)
    parser.add_argument("--budgets", type=int, default=3, help="budgets per model")
    parser.add_argument("--quick", action="store_true", help="the issue's stack only")
    parser.add_argument("--at", type=float, nargs="+", help="these budgets (MiB) instead")
    parser.add_argument("--prices", type=float, nargs="+", default=[1.0, 0.25],
                        help="the prices planned at, as multiples of the measured one")
    ns = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    price = optiremat.measured_save_price()
    prices = {f"priced x{m:g}": price * m for m in ns.prices}
    print(f"measured save price: {price:.1f} FLOPs a saved byte")
    ratios: dict[str, list[float]] = {label: [] for label in prices}
    # The models of bench/layer_groups.py: those whose CPU step times disagreed with FLOPs.
    for name, (loss, args) in models(ns.quick, ns.accelerator):
        if ns.at:
            budgets = [int(b * MiB) for b in ns.at]
        else:
            top = optiremat.measured_peak(step_of(loss, args))
            low = optiremat.min_feasible_budget(loss, *args)
            print(f"\n{name}: no remat {top / MiB:.2f} MiB, smallest plan {low / MiB:.2f} MiB")
            budgets = [low + (top - low) * i // (ns.budgets + 1) for i in range(1, ns.budgets + 1)]
        for budget in budgets:
            print(f"budget {budget / MiB:.2f} MiB")
            steps = {}
            for label, p in {"flops": None, **prices}.items():
                plan, peak, seconds, compiled = plan_at(loss, args, budget, True, save_price=p)
                steps[label] = compiled
                print(f"  {label:>11}: {peak / MiB:8.2f} MiB, {plan.recompute_flops:9.3g} FLOPs, "
                      f"{xla_flops(compiled, 'bytes accessed') / MiB:9.1f} MiB accessed, "
                      f"planned in {seconds:.1f} s")
            steps.update(best_builtin(loss, args, plan, budget))
            times = timed(steps, args, ns.rounds)
            for label, (median, lo, hi) in times.items():
                print(f"  step {label}: {median:.1f} ms ({lo:.1f}-{hi:.1f})")
            for label in prices:
                ratios[label].append(times[label][0] / times["flops"][0])
    for label, r in ratios.items():
        print(f"## {label}: faster than the plan by FLOPs at {sum(x < 1 for x in r)}/{len(r)} "
              f"budgets, step time {min(r):.3f}-{max(r):.3f}x (median "
              f"{statistics.median(r):.3f}x)")


if __name__ == "__main__":
    main()
