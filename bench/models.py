"""Plans against JAX's built-in policies on the test corpus.

For each model: at five budgets from the smallest feasible to "save
everything", the plan's residual bytes and recompute FLOPs next to the bytes
and FLOPs each built-in policy actually costs (measured from JAX), and the
solve time. Run: ``.venv/bin/python bench/models.py [MODEL ...]``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from optiremat.client import extract_graph, optimize  # noqa: E402
from optiremat.client.measure import backward_flops, residual_bytes  # noqa: E402
from optiremat.solver.solve import max_useful_budget, min_feasible_budget  # noqa: E402
from tests.models import CORPUS  # noqa: E402

BUILTINS = {
    "everything": jax.checkpoint_policies.everything_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_nobatch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nothing": jax.checkpoint_policies.nothing_saveable,
}
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)


def builtin_points(fun, args) -> dict[str, tuple[int, int]]:
    """(residual bytes, recompute FLOPs over everything_saveable) per built-in policy."""
    base = backward_flops(jax.checkpoint(fun, policy=BUILTINS["everything"]), *args)
    points = {}
    for name, policy in BUILTINS.items():
        checkpointed = jax.checkpoint(fun, policy=policy)
        points[name] = (residual_bytes(checkpointed, *args),
                        backward_flops(checkpointed, *args) - base)
    return points


def report(name: str) -> None:
    fun, args = CORPUS[name]
    graph = extract_graph(fun, *args)
    lo, hi = min_feasible_budget(graph), max_useful_budget(graph)
    print(f"\n## {name}: {graph.num_nodes} nodes, {graph.num_values} values, "
          f"budgets {lo}..{hi} bytes")
    print(f"{'budget':>9} {'plan bytes':>10} {'plan flops':>10} {'solve s':>8}  status")
    for f in FRACTIONS:
        budget = lo + int(f * (hi - lo))
        start = time.perf_counter()
        plan = optimize(fun, *args, budget=budget)
        took = time.perf_counter() - start
        print(f"{budget:>9} {plan.residual_bytes:>10} {plan.recompute_flops:>10} "
              f"{plan.solution.solve_seconds:>8.3f}  {plan.status} (optimize {took:.2f}s)")
    print(f"{'built-in':>13} {'bytes':>9} {'flops':>10} {'plan flops at those bytes':>26}")
    for policy, (bytes_, flops) in builtin_points(fun, args).items():
        if bytes_ < lo:
            ours = "below the plan's floor"
        else:
            ours = str(optimize(fun, *args, budget=bytes_).recompute_flops)
        print(f"{policy:>13} {bytes_:>9} {flops:>10} {ours:>26}")


def main(argv: list[str]) -> None:
    for name in argv or sorted(CORPUS):
        report(name)


if __name__ == "__main__":
    main(sys.argv[1:])
