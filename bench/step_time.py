"""Step time of plans against JAX's built-in policies at the same budget (issue 39).

For one scanned stack: the step with no checkpoint and with each built-in policy in
every layer, each one's measured peak (XLA's ``memory_analysis()``); then, at each
built-in's measured peak as the budget, the plan for it. Every step is timed in one
process, interleaved runs, median and spread in ms, beside its recompute FLOPs by
XLA's count (the step's FLOPs beyond the unplanned step's, per loop trip) and by
the project's rule (for built-ins, on the plan's graph), and XLA's bytes accessed and
transcendentals (a loop's body once), where time follows memory traffic, not FLOPs.

    .venv/bin/python bench/step_time.py [--accelerator] [--rounds N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
from layer_groups import (  # noqa: E402
    MiB,
    one_stack,
    stack_options,
    step_of,
    timed,
    xla_flops,
    xla_flops_per_trip,
)

import optiremat  # noqa: E402
from optiremat.solver.baselines import compare  # noqa: E402

BUILTINS = ("nothing_saveable", "dots_with_no_batch_dims_saveable", "dots_saveable",
            "everything_saveable")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    stack_options(parser)
    ns = parser.parse_args()
    name, loss, args, unplanned, base = one_stack(ns.accelerator)
    smallest = optiremat.optimize(loss, *args, budget=optiremat.min_feasible_budget(loss, *args))
    # The built-ins' recompute by the rule plans are costed by, on the plan's graph.
    ours = {b.name: b.recompute_flops for b in compare(smallest.graph, 0, 0, names=BUILTINS)}
    steps = {"no checkpoint": unplanned}
    rows = {"no checkpoint": (optiremat.measured_peak(unplanned), 0, 0.0)}
    for builtin in BUILTINS:
        compiled = step_of(smallest.placement.apply(loss, getattr(jax.checkpoint_policies,
                                                                   builtin)), args)
        steps[builtin] = compiled
        rows[builtin] = (optiremat.measured_peak(compiled), ours.get(builtin),
                         xla_flops(compiled) - base)
    for builtin in BUILTINS[:-1]:
        budget = rows[builtin][0]
        plan = optiremat.optimize(loss, *args, budget=budget)
        compiled = step_of(plan.apply(loss), args)
        label = f"plan at {builtin}'s peak"
        steps[label] = compiled
        rows[label] = (optiremat.measured_peak(compiled), plan.recompute_flops,
                       xla_flops_per_trip(loss, args, plan, compiled) - base)
    times = timed(steps, args, rounds=ns.rounds)
    print(f"\n{name}\n{'step':>42} | {'peak MiB':>9} | {'recompute (ours, XLA/trip)':>26} | "
          "GB accessed | transcendentals | step ms median (min-max)")
    for label, (peak, ours, xla) in rows.items():
        median, lo, hi = times[label]
        ours_text = f"{ours:.3g}" if ours is not None else "-"
        accessed = xla_flops(steps[label], "bytes accessed") / 1e9
        exps = xla_flops(steps[label], "transcendentals")
        print(f"{label:>42} | {peak / MiB:9.2f} | {ours_text:>12} {xla:13.3g} | "
              f"{accessed:11.2f} | {exps:15.3g} | {median:.2f} ({lo:.2f}-{hi:.2f})")


if __name__ == "__main__":
    main()
