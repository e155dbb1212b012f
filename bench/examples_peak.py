"""Each example's plan against XLA: the predicted peak, the measured one, the error.

    .venv/bin/python bench/examples_peak.py

For every ``examples/*.py`` (a ``loss`` and its ``example_args``), a peak plan at
the middle of its feasible budgets, as the example's own ``main`` makes it, and
``plan.verify(peak=True)``: XLA's ``memory_analysis()`` of the compiled step.
docs/api.md quotes these figures per corpus.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import optiremat

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def main() -> None:
    print(f"{'example':<16} {'budget':>10} {'predicted':>10} {'measured':>10} {'error':>8}")
    for path in sorted(EXAMPLES.glob("*.py")):
        module = runpy.run_path(str(path), run_name="bench")
        loss, args = module["loss"], module["example_args"]()
        graph = optiremat.extract_step(loss, *args)
        budget = (optiremat.min_feasible_budget(graph) + optiremat.max_useful_budget(graph)) // 2
        plan = optiremat.optimize(loss, *args, budget=budget)
        check = plan.verify(loss, *args, peak=True)
        measured = check.measured_peak_bytes or 0
        print(f"{path.stem:<16} {budget:>10} {plan.peak_bytes:>10} {measured:>10} "
              f"{(plan.peak_bytes - measured) / measured:>+8.3%}")


if __name__ == "__main__":
    main()
