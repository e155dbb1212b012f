"""CP-SAT against SCIP on synthetic transformer-like graphs.

For graphs of about 1k, 5k and 10k nodes and budgets at 25/50/75% of the
save-everything bytes, each backend solves the full request (both phases, as
``optiremat.solver.solve`` runs it) under the same time limit; the table shows status,
recompute FLOPs, gap to the proven bound and wall time. The backend that is
faster here is ``SolveOptions``' default.

Run: ``.venv/bin/python bench/solver_backends.py [--time-limit S] [--tie both]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ortools  # noqa: E402

from optiremat.solver.solution import Backend, InfeasibleBudgetError  # noqa: E402
from optiremat.solver.solve import max_useful_budget, solve  # noqa: E402
from optiremat.solver.synthetic import transformer_like  # noqa: E402

LAYERS = {"1k": 23, "5k": 114, "10k": 228}  # about 44 nodes per layer
FRACTIONS = (0.25, 0.5, 0.75)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per solve")
    parser.add_argument("--tie", choices=["tied", "untied", "both"], default="tied")
    parser.add_argument("--sizes", nargs="*", default=list(LAYERS), choices=list(LAYERS))
    args = parser.parse_args(argv)
    ties = {"tied": [True], "untied": [False], "both": [True, False]}[args.tie]

    print(f"ortools {ortools.__version__}, {os.cpu_count()} CPUs, "
          f"time limit {args.time_limit:g} s per solve")
    header = (f"{'graph':>12} {'tie':>6} {'budget':>6} {'backend':>7} {'status':>9} "
              f"{'recompute FLOPs':>16} {'gap':>7} {'seconds':>8}")
    print(header)
    print("-" * len(header))
    totals = {(tie, b): 0.0 for tie in ties for b in Backend}
    wins = {(tie, b): 0 for tie in ties for b in Backend}
    for size in args.sizes:
        graph = transformer_like(LAYERS[size])
        full = max_useful_budget(graph)
        for tie in ties:
            for fraction in FRACTIONS:
                budget = int(full * fraction)
                times = {}
                for backend in (Backend.CPSAT, Backend.SCIP):
                    started = time.monotonic()
                    try:
                        s = solve(graph, budget, backend=backend, tie=tie,
                                  time_limit_s=args.time_limit)
                        row = (f"{s.status.value:>9} {s.recompute_flops:>16.4e} "
                               f"{s.gap:>7.2%}")
                    except InfeasibleBudgetError:
                        row = f"{'infeasible':>9} {'':>16} {'':>7}"
                    times[backend] = time.monotonic() - started
                    totals[tie, backend] += times[backend]
                    print(f"{graph.num_nodes:>6} nodes {'tied' if tie else 'untied':>6} "
                          f"{fraction:>6.0%} {backend.value:>7} {row} "
                          f"{times[backend]:>8.2f}", flush=True)
                wins[tie, min(times, key=lambda b: times[b])] += 1
    print("-" * len(header))
    for tie in ties:
        runs = sum(wins[tie, b] for b in Backend)
        for backend in Backend:
            print(f"{'tied' if tie else 'untied':>6} {backend.value:>7}: "
                  f"{totals[tie, backend]:8.1f} s in all, "
                  f"fastest on {wins[tie, backend]} of {runs}")


if __name__ == "__main__":
    main()
