"""Plans for layers outside lax.scan: the unrolled corpus against XLA.

    .venv/bin/python bench/unrolled.py            # every model, 16 points each
    .venv/bin/python bench/unrolled.py --quick    # 6 points on the QUICK models
    .venv/bin/python bench/unrolled.py --models unet_3level penzai_llama_L6

For every model of the unrolled corpus (``tests/unrolled_models.py``), as its
library writes it (a user's own per-block checkpoints included), it prints:

* the regions ``optimize`` finds and how (repeated blocks, the user's
  checkpoints), and the time to extract and calibrate;
* a frontier over peak budgets, as ``bench/peak.py`` prints for the scan corpus:
  each plan's predicted peak next to XLA's measured one (compiled with the
  checkpoint barriers kept, ``client.schedule``), whether it fits, whether the
  measured peak ever rises as the budget falls, and each per-block built-in
  (the plan's blocks under the built-in) with the plan at its measured peak;
* each built-in wrapped around each block by the library itself, under XLA's
  default CPU compile and with the barriers kept, and the smallest budget
  ``optimize`` answers against the smallest of them; gradients of the smallest
  plan against the function's own;
* for a model with a ``lax.scan`` twin: both smallest plans' peaks and both
  times to plan (a mid budget, from a cold start of the calibration caches).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import optiremat  # noqa: E402
from bench.frontiers import frontier  # noqa: E402
from optiremat.client.schedule import ScheduleWarning, barriers_kept  # noqa: E402
from optiremat.client.step import Step, lowered_peak  # noqa: E402
from optiremat.solver.solution import InfeasibleBudgetError  # noqa: E402
from optiremat.solver.units import format_bytes  # noqa: E402
from tests.unrolled_models import BUILTINS, CORPUS, MODELS, QUICK, Model  # noqa: E402

STEP = Step.of(0)


@dataclass(frozen=True)
class AsWritten:
    """A corpus model as its library writes it, in ``bench.peak.frontier``'s terms."""

    model: Model

    @property
    def name(self) -> str:
        return self.model.name

    def build(self) -> tuple[Any, tuple]:
        return self.model.build(self.model.user_policy)


def smallest(fun, args, schedule: str = "barriers_kept") -> int:
    """The smallest budget ``optimize`` answers for ``fun``, for a step compiled with the
    barriers kept or (``schedule="process"``) as this process compiles it."""
    try:
        optiremat.optimize(fun, *args, budget=1, schedule=schedule)
    except InfeasibleBudgetError as err:
        return err.min_budget_bytes
    raise AssertionError("a budget of one byte was met")


def builtins(model: Model) -> dict[str, tuple[int, int]]:
    """Per built-in wrapped around each block by the library: (default, barriers kept)."""
    found = {}
    for name, policy in {"no remat": None, **BUILTINS}.items():
        fun, args = model.build(policy)
        lowered = STEP.function(fun).lower(*args)
        found[name] = (lowered_peak(lowered), lowered_peak(lowered, keep_barriers=True))
    return found


def report(model: Model, points: int) -> dict:
    fun, args = AsWritten(model).build()
    print(f"\n# {model.name}: {model.written}")
    result = frontier(AsWritten(model), points)
    peaks = builtins(model)
    print(f"{'per block, as the library writes it':>36} {'default':>11} {'barriers kept':>14}")
    for name, (default, kept) in peaks.items():
        print(f"{name:>36} {format_bytes(default):>11} {format_bytes(kept):>14}")
    least = min(kept for name, (_, kept) in peaks.items() if name != "no remat")
    floor = smallest(fun, args)
    plan = optiremat.optimize(fun, *args, budget=floor, schedule="barriers_kept")
    got = jax.grad(plan.apply(fun))(*args)
    want = jax.grad(fun)(*args)
    equal = all(np.allclose(a, b, rtol=1e-4, atol=1e-6)
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
    print(f"smallest budget answered {format_bytes(floor)} against the smallest per-block "
          f"built-in {format_bytes(least)} ({'<=' if floor <= least else 'ABOVE'}); "
          f"gradients of its plan {'equal' if equal else 'DIFFER'}")
    # Planned for this process as it compiles (the default): the plan at its smallest
    # budget, compiled as a user's jax.jit(jax.grad(...)) is, within that budget.
    own_floor = smallest(fun, args, "process")
    own = optiremat.optimize(fun, *args, budget=own_floor)
    own_peak = optiremat.measured_peak(jax.jit(jax.grad(own.apply(fun))).lower(*args).compile())
    least_default = min(d for name, (d, _) in peaks.items() if name != "no remat")
    print(f"for this process's own compile: smallest budget {format_bytes(own_floor)} "
          f"(smallest per-block built-in there {format_bytes(least_default)}); its plan "
          f"measures {format_bytes(own_peak)} compiled as a user does "
          f"({'within' if own_peak <= own_floor else 'OVER'} its budget)")
    result.update(floor=floor, least=least, equal=equal, own_fits=own_peak <= own_floor)
    if model.scan is not None:
        result["twin"] = twin(model, MODELS[model.scan])
    return result


def twin(unrolled: Model, scanned: Model) -> tuple[float, float]:
    """The smallest plan peaks and the times to plan, unrolled over scanned."""
    figures = []
    for model in (unrolled, scanned):
        fun, args = model.build(model.user_policy)
        started = time.perf_counter()
        floor = smallest(fun, args)
        planned = time.perf_counter() - started
        figures.append((floor, planned))
    (u_floor, u_time), (s_floor, s_time) = figures
    print(f"against its lax.scan twin {scanned.name}: smallest plan {format_bytes(u_floor)} "
          f"vs {format_bytes(s_floor)} ({u_floor / s_floor - 1:+.1%}); time to plan the "
          f"smallest {u_time:.1f} s vs {s_time:.1f} s ({u_time / s_time:.2f}x)")
    return u_floor / s_floor, u_time / s_time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 points on the QUICK models")
    parser.add_argument("--models", nargs="+", choices=[m.name for m in CORPUS],
                        help="these models of the corpus only")
    opts = parser.parse_args(argv)
    warnings.simplefilter("ignore", ScheduleWarning)  # this bench measures both schedules
    print(f"jax {jax.__version__}; this process's default compile keeps checkpoint barriers: "
          f"{barriers_kept()}")
    chosen = opts.models or (QUICK if opts.quick else [m.name for m in CORPUS])
    models = [m for m in CORPUS if m.name in chosen]
    results = [report(m, 6 if opts.quick else 16) for m in models]
    errors = [e for r in results for e in r["errors"]]
    twins = [r["twin"] for r in results if "twin" in r]
    print(f"\n## unrolled: prediction error {min(errors):+.1%} .. {max(errors):+.1%}; within "
          f"budget {sum(r['fits'] for r in results)}/{sum(r['points'] for r in results)}; "
          f"rises {sum(r['rises'] for r in results)}; smallest budget <= the smallest "
          f"per-block built-in {sum(r['floor'] <= r['least'] for r in results)}/{len(results)};"
          f" gradients equal {sum(r['equal'] for r in results)}/{len(results)}; plans for "
          f"this process within budget as it compiles {sum(r['own_fits'] for r in results)}/"
          f"{len(results)}"
          + "".join(f"; scan twin: smallest peak {p - 1:+.1%}, time to plan {t:.2f}x"
                    for p, t in twins))


if __name__ == "__main__":
    main()
