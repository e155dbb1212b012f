"""Time to plan against one compile of the step (issue 40): per model of the unrolled
corpus and the scan corpus.

Each figure comes from a fresh process (cold caches: JAX's, XLA's and the planner's):
one process compiles the unplanned step ``jax.jit(jax.grad(loss))`` once as a user
does, another runs ``optimize`` at 0.6x that step's measured peak (where no plan fits
there, a third at the smallest budget the second names), counting the XLA compiles
planning makes, the seconds they take and what each was for (extraction, calibration,
refinement, mixing, ...). Plans are for this process's own compile
(``schedule="process"``, the default). The ratio is the wall time of ``optimize`` over the
one compile.

Then, with what that process compiled kept in a cache folder (``OPTIREMAT_CACHE_DIR``,
``client.memory_cache``), two more fresh processes: one plans at the same budget again
(a training script launched again), one halfway from that budget to the no-remat peak
(the next budget of a sweep). Their ratios are over the same one compile.

    .venv/bin/python bench/plan_time.py [--models NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optiremat.client.memory_cache import CACHE_DIR_ENV  # noqa: E402

# The share of the no-remat peak each model is planned at (the figure).
SHARE = 0.6


def _models(names: list[str] | None = None) -> dict:
    """The models by name: the scan corpus's, and the unrolled corpus's where ``names``
    asks for one that is not a scan model (all by default). That corpus needs its
    libraries (Flax, Equinox, Haiku, penzai), which an accelerator's machine may lack."""
    from tests.peak_models import CORPUS as SCAN_CORPUS

    found = {m.name: m.build for m in SCAN_CORPUS}
    if names is None or set(names) - set(found):
        from tests.unrolled_models import CORPUS as UNROLLED

        found = {**{m.name: (lambda m=m: m.build(m.user_policy)) for m in UNROLLED}, **found}
    return found


def _compile_once(name: str) -> dict:
    import jax

    import optiremat

    loss, args = _models([name])[name]()
    started = time.perf_counter()
    compiled = jax.jit(jax.grad(loss)).lower(*args).compile()
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "peak": optiremat.measured_peak(compiled),
            "device": jax.devices()[0].device_kind}


def _plan(name: str, budget: int) -> dict:
    from compiles import CompileTimer

    import optiremat
    from optiremat.solver.solution import InfeasibleBudgetError

    loss, args = _models([name])[name]()
    with CompileTimer() as compiles:
        started = time.perf_counter()
        try:
            optiremat.optimize(loss, *args, budget=budget)
        except InfeasibleBudgetError as err:  # the parent plans the smallest, afresh
            return {"smallest": err.min_budget_bytes}
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "budget": budget, "compiles": len(compiles.seconds),
            "compile_seconds": sum(compiles.seconds),
            "phases": compiles.by_phase()}


def _in_fresh_process(*argv: str, cache: str | None = None) -> dict:
    """One figure from a fresh process; ``cache``: the folder it keeps compiles in."""
    env = {k: v for k, v in os.environ.items() if k != CACHE_DIR_ENV}
    if cache is not None:
        env[CACHE_DIR_ENV] = cache
    done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True,
                          check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _plan_in_fresh_process(name: str, budget: int, cache: str) -> dict:
    return _in_fresh_process("--one", "plan", name, "--budget", str(budget), cache=cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", help="these models only (default: all)")
    parser.add_argument("--one", nargs=2, metavar=("WHAT", "NAME"), help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.one:  # a child process: one figure, as JSON on the last line
        what, name = ns.one
        print(json.dumps(_compile_once(name) if what == "compile" else _plan(name, ns.budget)))
        return
    import jax

    known = _models(ns.models)
    names = ns.models or list(known)
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown models {', '.join(unknown)}; known: {', '.join(known)}")
    ratios: dict[str, list[float]] = {"cold": [], "again": [], "next budget": []}
    for name in names:
        # This process never opens the backend: an accelerator such as a TPU is held by
        # one process at a time, and every figure is a child's.
        step = _in_fresh_process("--one", "compile", name)
        if name == names[0]:
            print(f"jax {jax.__version__}, {step['device']}; each figure from a fresh "
                  f"process; plans at {SHARE}x the no-remat peak")
            print(f"{'model':>24} | {'one compile':>11} | {'budget MiB':>10} | "
                  f"{'optimize':>8} | {'compiles (s)':>13} | ratio | cached: again, next budget")
        budget = int(step["peak"] * SHARE)
        with tempfile.TemporaryDirectory() as cache:
            planned = _plan_in_fresh_process(name, budget, cache)
            smallest = " (smallest)" if "smallest" in planned else ""
            if smallest:  # planned cold at the smallest budget, none of the refusal's kept
                budget = planned["smallest"]
                shutil.rmtree(cache)
                os.mkdir(cache)
                planned = _plan_in_fresh_process(name, budget, cache)
            again = _plan_in_fresh_process(name, budget, cache)
            following = _plan_in_fresh_process(name, (budget + step["peak"]) // 2, cache)
        cached = []
        for label, figure in (("cold", planned), ("again", again), ("next budget", following)):
            ratios[label].append(figure["seconds"] / step["seconds"])
            cached.append(f"{ratios[label][-1]:.2f}x ({figure['compiles']})")
        compiles = f"{planned['compiles']:3d} ({planned['compile_seconds']:5.1f} s)"
        print(f"{name:>24} | {step['seconds']:9.2f} s | {budget / 2**20:10.2f} | "
              f"{planned['seconds']:6.2f} s | {compiles} | {cached[0]}{smallest} | "
              f"{cached[1]}, {cached[2]}")
        print(f"{'':>24}   compiles for " + ", ".join(
            f"{phase} {n} ({took:.1f} s)" for phase, (n, took) in planned["phases"].items()))
    for label, found in ratios.items():
        print(f"\n## time to plan over one compile, {label}: {min(found):.2f}x .. "
              f"{max(found):.2f}x; within 2x on {sum(r <= 2 for r in found)}/{len(found)}")


if __name__ == "__main__":
    main()
