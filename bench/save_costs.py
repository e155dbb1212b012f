"""What each value a plan saves costs in step time (issue 39).

The plan at a budget (one policy per stack), then the same step with each of its
largest saved values recomputed instead, one at a time: the change in measured peak,
in recompute FLOPs (XLA's count of the step, per loop trip) and in step time, every
step timed interleaved in one process. Where recomputing a value makes the step
faster, saving it costs more time than its FLOPs say: on that device, FLOPs misprice
it.

    .venv/bin/python bench/save_costs.py [--accelerator] [--budget MIB] [--top N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layer_groups import MiB, one_stack, stack_options, step_of, timed, xla_flops  # noqa: E402

import optiremat  # noqa: E402
from optiremat.client.policy import KeyPolicy  # noqa: E402
from optiremat.solver.graph import CostGraph  # noqa: E402


def described(graph: CostGraph, key: str) -> tuple[int, str]:
    """A policy key's bytes (every value it saves; a scan's are stacked over its layers)
    and its first value's primitive and per-layer type."""
    total, first = 0, ""
    for n, node_key in enumerate(graph.node_key):
        if node_key != key:
            continue
        for v in graph.output_ids[graph.output_ptr[n]:graph.output_ptr[n + 1]]:
            total += graph.value_bytes[v]
            first = first or (f"{graph.node_primitive[n]} {graph.value_dtype[v]}"
                              f"{graph.value_shape[v]}")
    return total, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    stack_options(parser)
    parser.add_argument("--budget", type=float, help="MiB (default: midway between the "
                        "smallest plan and the step without checkpoints)")
    parser.add_argument("--top", type=int, default=8, help="largest saved values tried")
    ns = parser.parse_args()
    name, loss, args, unplanned, base = one_stack(ns.accelerator)
    if ns.budget is None:
        low = optiremat.min_feasible_budget(loss, *args, layer_groups=False)
        budget = (low + optiremat.measured_peak(unplanned)) // 2
    else:
        budget = int(ns.budget * MiB)
    plan = optiremat.optimize(loss, *args, budget=budget, layer_groups=False)
    saved = frozenset(plan.saved_keys)
    sizes = {key: described(plan.graph, key) for key in saved}
    largest = sorted(saved, key=lambda k: -sizes[k][0])[:ns.top]
    steps = {"plan": step_of(plan.apply(loss), args)}
    for i, key in enumerate(largest):
        policy = KeyPolicy(saved - {key})
        steps[f"#{i}"] = step_of(plan.placement.apply(loss, policy), args)
    times = timed(steps, args, rounds=ns.rounds)
    print(f"\n{name} at {budget / MiB:.2f} MiB: the plan saves {len(saved)} keys")
    print(f"{'step':>4} | {'peak MiB':>9} | {'XLA recompute':>13} | {'ms median':>9} | "
          f"{'bytes saved':>11} | value recomputed instead")
    for label, compiled in steps.items():
        median, _, _ = times[label]
        what = "-"
        if label != "plan":
            key = largest[int(label[1:])]
            what = f"{sizes[key][0] / MiB:9.2f} M | {sizes[key][1]}"
        print(f"{label:>4} | {optiremat.measured_peak(compiled) / MiB:9.2f} | "
              f"{xla_flops(compiled) - base:13.3g} | {median:9.2f} | {what}")


if __name__ == "__main__":
    main()
