"""Offload on the device it runs on: plans that keep residuals in host memory, their
device peak measured, their step time against recomputing (issue 39, offload).

Offload plans are priced, not refined, because XLA's CPU memory analysis counts host
buffers as device ones (``docs/design.md``, Offload in scan layouts). On an
accelerator the analysis keeps them apart, and this bench measures what CPU cannot:
for one scanned stack, the device's rates (a bf16 matrix product; a round trip to
``pinned_host``), then at budgets from the smallest offload plan to midway between the
smallest plan without offload and the no-remat peak, the offload plan priced at those
rates: its predicted and measured device peak (XLA's ``memory_analysis()``), host
bytes, recompute FLOPs and estimated seconds; beside it the plan without offload where
one fits. Their steps are timed in one process, interleaved, medians and spread.

    .venv/bin/python bench/offload_step.py [--accelerator] [--rounds N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from layer_groups import MiB, one_stack, stack_options, step_of, timed  # noqa: E402

import optiremat  # noqa: E402
from optiremat.solver.offload import OffloadOptions  # noqa: E402


def measured_rates(size: int) -> OffloadOptions:
    """The device's bf16 matrix rate and its link to ``pinned_host`` (bytes each way per
    second, from a round trip of 256 MiB), as the offload options plans are priced at."""
    device = jax.devices()[0]
    a = jnp.ones((size, size), jnp.bfloat16)
    product = jax.jit(lambda a: a @ a)
    x = jnp.ones((64 * 2**20,), jnp.float32)
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    back = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    medians = timed({"product": lambda: product(a),
                     "trip": lambda: jax.device_put(jax.device_put(x, host), back)}, (), rounds=7)
    flop_rate = 2 * size**3 / (medians["product"][0] / 1e3)
    bandwidth = 2 * x.nbytes / (medians["trip"][0] / 1e3)
    print(f"measured: {flop_rate / 1e12:.1f} TFLOP/s (bf16 {size}^3 product), "
          f"{bandwidth / 1e9:.1f} GB/s to pinned_host and back")
    # Two significant figures each: the objective's integers need a large common divisor.
    return OffloadOptions(host_bandwidth=_two_figures(bandwidth),
                          device_flop_rate=_two_figures(flop_rate))


def _two_figures(rate: float) -> int:
    return int(float(f"{rate:.1e}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    stack_options(parser)
    ns = parser.parse_args()
    name, loss, args, unplanned, _ = one_stack(ns.accelerator)
    offload = measured_rates(8192 if ns.accelerator else 1024)
    on_cpu = jax.devices()[0].platform == "cpu"
    top = optiremat.measured_peak(unplanned)
    low = optiremat.min_feasible_budget(loss, *args)
    low_offload = optiremat.min_feasible_budget(loss, *args, offload=offload)
    print(f"\n{name}: no remat {top / MiB:.2f} MiB, smallest plan {low / MiB:.2f} MiB, "
          f"smallest offload plan {low_offload / MiB:.2f} MiB")
    print(f"{'budget':>9} | {'plan':>10} | {'predicted':>9} | {'measured':>9} | "
          f"{'host MiB':>8} | {'recompute':>9} | {'est. ms':>7} | step ms median (min-max)")
    budgets = [low_offload, (low_offload + low) // 2, low, (low + top) // 2]
    exact = count = 0
    for budget in budgets:
        plans = {"offload": optiremat.optimize(loss, *args, budget=budget, offload=offload)}
        if budget >= low:
            plans["no offload"] = optiremat.optimize(loss, *args, budget=budget)
        steps = {label: step_of(plan.apply(loss), args) for label, plan in plans.items()}
        times = timed(steps, args, rounds=ns.rounds)
        for label, plan in plans.items():
            # CPU's analysis counts host buffers as device ones: no device peak to measure.
            measured = None if on_cpu else optiremat.measured_peak(steps[label])
            if measured is not None and label == "offload":
                count, exact = count + 1, exact + (measured == plan.peak_bytes)
            host = plan.solution.offload.host_bytes if plan.solution.offload else 0
            seconds = (plan.solution.offload.estimated_seconds if plan.solution.offload
                       else plan.recompute_flops / offload.device_flop_rate)
            median, lo, hi = times[label]
            measured_text = "-" if measured is None else f"{measured / MiB:9.2f}"
            print(f"{budget / MiB:9.2f} | {label:>10} | {plan.peak_bytes / MiB:9.2f} | "
                  f"{measured_text:>9} | {host / MiB:8.2f} | {plan.recompute_flops:9.3g} | "
                  f"{seconds * 1e3:7.2f} | {median:.2f} ({lo:.2f}-{hi:.2f})")
    if on_cpu:
        print("\n## CPU: device peaks of offload plans not measurable (host buffers counted "
              "as device ones)")
    else:
        print(f"\n## offload plans: predicted = measured {exact}/{count}")


if __name__ == "__main__":
    main()
