"""Offload vs recompute on a transformer-like graph, at a few link speeds.

For ``optiremat.solver.synthetic.transformer_like(layers)`` at a device budget (by
default the smallest one a plan without offload fits; ``--fraction`` takes a
share of the save-everything bytes instead), one solve without offload and one per
host bandwidth (the device FLOP rate at its default): bytes kept in host
memory, recompute FLOPs, the estimated seconds the plan adds (recompute plus
transfers, not overlapped) and the solve's wall time. Cheap links should buy
offloads, dear ones recomputes.

Run: ``.venv/bin/python bench/offload.py [--layers N] [--fraction F] [--time-limit S]``.
``offload_table()`` is the same table for ``bench/solver.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optiremat.solver.offload import DEFAULT_DEVICE_FLOP_RATE, OffloadOptions  # noqa: E402
from optiremat.solver.solution import InfeasibleBudgetError  # noqa: E402
from optiremat.solver.solve import max_useful_budget, min_feasible_budget, solve  # noqa: E402
from optiremat.solver.synthetic import transformer_like  # noqa: E402

# bytes/s: two links faster than any today (to show where offload wins), NVLink-C2C
# class, PCIe 4 x16 (the default), a congested 1 GB/s.
BANDWIDTHS = (10**13, 2 * 10**12, 450 * 10**9, 25 * 10**9, 10**9)


def offload_table(layers: int = 8, fraction: float | None = None, time_limit: float = 60.0,
                  bandwidths: tuple[int, ...] = BANDWIDTHS) -> list[dict]:
    """Print the table and return its rows (one per bandwidth, ``None`` for no offload)."""
    graph = transformer_like(layers)
    full = max_useful_budget(graph)
    budget = min_feasible_budget(graph) if fraction is None else int(fraction * full)
    print(f"\n## offload on transformer_like({layers}): {graph.num_nodes} nodes, device budget "
          f"{budget / 2**20:.1f} MiB ({budget / full:.1%} of save-everything), "
          f"{DEFAULT_DEVICE_FLOP_RATE / 1e12:g} TFLOP/s, {time_limit:g} s limit")
    print(f"{'link GB/s':>10} {'status':>9} {'device MiB':>11} {'host MiB':>9} "
          f"{'recompute GFLOP':>16} {'est. ms':>9} {'solve s':>8}")
    rows = []
    for bandwidth in (None, *bandwidths):
        options = None if bandwidth is None else OffloadOptions(host_bandwidth=bandwidth)
        started = time.monotonic()
        try:
            sol = solve(graph, budget, time_limit_s=time_limit, offload=options)
        except InfeasibleBudgetError as err:
            print(f"{'none' if bandwidth is None else f'{bandwidth / 1e9:g}':>10} infeasible: "
                  f"the smallest budget is {err.min_budget_bytes / 2**20:.1f} MiB")
            rows.append(dict(bandwidth=bandwidth, status="infeasible"))
            continue
        took = time.monotonic() - started
        host = sol.host_bytes
        seconds = (sol.offload.estimated_seconds if sol.offload
                   else sol.recompute_flops / DEFAULT_DEVICE_FLOP_RATE)
        row = dict(bandwidth=bandwidth, status=sol.status.value, device_bytes=sol.residual_bytes,
                   host_bytes=host, recompute_flops=sol.recompute_flops,
                   estimated_seconds=seconds, solve_seconds=took)
        rows.append(row)
        link = "none" if bandwidth is None else f"{bandwidth / 1e9:g}"
        print(f"{link:>10} {row['status']:>9} {sol.residual_bytes / 2**20:>11.1f} "
              f"{host / 2**20:>9.1f} {sol.recompute_flops / 1e9:>16.1f} "
              f"{seconds * 1e3:>9.3f} {took:>8.2f}")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--fraction", type=float, default=None)
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args(argv)
    offload_table(args.layers, args.fraction, args.time_limit)


if __name__ == "__main__":
    main()
