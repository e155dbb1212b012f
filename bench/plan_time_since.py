"""Time to plan with layer groups against an earlier revision's one policy (issue 39:
"time to plan stays within 1.5x of today's", today being the day it was filed).

At budgets between frontier steps of the issue's stack and three models of the scan and
LM corpora (``bench/layer_groups.py``'s), each plan from a fresh process, the three
taking turns to go first: the earlier revision's ``optimize`` (one policy per stack;
``--rev``, checked out in a temporary git worktree), this tree's with layer groups, and
this tree's with one policy; each ``--repeat`` times, the median taken (one fresh
process's time moves by up to a third between runs here). The models are this tree's
(``tests/peak_models.py``, ``tests/lm_models.py``) for all three. Each plan's XLA compiles
are counted (``bench/compiles.py``), and for layer groups those of mixes.

    .venv/bin/python bench/plan_time_since.py [--rev 205185d] [--at MODEL:MIB ...] [--repeat 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
# The commit the issue was filed against: the last before layer groups (81949f3).
ISSUE_DAY = "205185d"
# Midpoints of bench/layer_groups.py's one-policy frontiers (jax 0.10.2), and budgets
# between llama_f32_L8's, vit_L12's and lm_V8k's built-ins (bench/priced_saves.py's).
BUDGETS = ["stack:140.81", "stack:205.09", "stack:272.40", "stack:338.72", "stack:400.14",
           "llama_f32_L8:63.67", "llama_f32_L8:116.75", "vit_L12:99.69", "vit_L12:259.89",
           "lm_V8k:125.81"]
PACKAGES = ("solver", "client", "service")  # mapped into optiremat, as pyproject maps them


def _models() -> dict:
    """This tree's models, loaded by path (a child's ``tests`` may be the revision's)."""
    package = types.ModuleType("tests")
    package.__path__ = [str(HERE / "tests")]
    sys.modules["tests"] = package
    loaded = {}
    for name in ("peak_models", "lm_models"):
        path = HERE / "tests" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"tests.{name}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"tests.{name}"] = module
        spec.loader.exec_module(module)
        loaded[name] = module
    peak, lm = loaded["peak_models"], loaded["lm_models"]
    found = {"stack": lambda: peak.llama(layers=8, batch=4, seq=256)}
    found.update({m.name: m.build for m in peak.CORPUS})
    found.update({m.name: m.build for m in lm.CORPUS})
    return found


def _plan(root: str, name: str, mib: float, groups: str) -> dict:
    """A child process: one cold ``optimize`` with ``root``'s optiremat, and the XLA
    compiles it made (``bench/compiles.py``, which imports JAX alone)."""
    sys.path.insert(0, root)
    sys.path.append(str(HERE / "bench"))
    from compiles import CompileTimer

    import optiremat

    loss, args = _models()[name]()
    options = {} if groups == "-" else {"layer_groups": groups == "1"}
    with CompileTimer() as compiles:
        started = time.perf_counter()
        plan = optiremat.optimize(loss, *args, budget=int(mib * 2**20), **options)
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "flops": plan.recompute_flops,
            "compiles": len(compiles.seconds),
            "mixing": compiles.by_phase().get("mixing", [0])[0]}


def _timed(plan: dict) -> str:
    """A plan's seconds, and its compiles in brackets."""
    return f"{plan['seconds']:7.2f} ({plan['compiles']:2d})"


def _median(runs: list[dict]) -> dict:
    """The run of median seconds (of an even count, the upper), its compiles with it."""
    return sorted(runs, key=lambda run: run["seconds"])[len(runs) // 2]


def _in_fresh_process(root: Path, groups: str, name: str, mib: float) -> dict:
    done = subprocess.run([sys.executable, __file__, "--one", str(root), name, str(mib), groups],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name} at {mib} MiB ({root}) failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _worktree(rev: str, folder: Path) -> Path:
    """``rev`` checked out under ``folder``, its packages mapped into optiremat."""
    tree = folder / "tree"
    subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", str(tree), rev],
                   check=True, capture_output=True)
    for package in PACKAGES:
        (tree / "optiremat" / package).symlink_to(f"../{package}")
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default=ISSUE_DAY, help="the earlier revision (one policy)")
    parser.add_argument("--at", nargs="+", default=BUDGETS, metavar="MODEL:MIB",
                        help="the budgets planned (default: the issue's ten)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="fresh processes per plan, the median taken (default 3)")
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.one:
        root, name, mib, groups = ns.one
        print(json.dumps(_plan(root, name, float(mib), groups)))
        return
    known = _models()
    for spec in ns.at:
        name, _, mib = spec.partition(":")
        if name not in known or not mib.replace(".", "", 1).isdigit():
            parser.error(f"--at takes MODEL:MIB with MODEL one of {', '.join(known)}, "
                         f"not {spec!r}")
    if ns.repeat < 1:
        parser.error(f"--repeat takes a count of 1 or more, not {ns.repeat}")
    print(f"each plan from a fresh process, the median of {ns.repeat} (the three taking turns "
          f"to go first); {ns.rev}'s one policy against this tree's")
    print("(in brackets, the XLA compiles each made; for layer groups, of which mixes)")
    print(f"{'model':>14} {'MiB':>8} | {ns.rev + ' s':>12} | {'groups s':>21} {'ratio':>6} | "
          f"{'one policy s':>12} {'ratio':>6}")
    ratios: list[float] = []
    spreads: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        tree = _worktree(ns.rev, Path(folder))
        try:
            for spec in ns.at:
                name, _, mib = spec.partition(":")
                kinds = [(tree, "-"), (HERE, "1"), (HERE, "0")]
                runs: list[list[dict]] = [[] for _ in kinds]
                for turn in range(ns.repeat):
                    for k in range(len(kinds)):
                        at = (k + turn) % len(kinds)
                        runs[at].append(_in_fresh_process(*kinds[at], name, float(mib)))
                then, groups, one = (_median(r) for r in runs)
                spreads += [(max(s) - min(s)) / statistics.median(s)
                            for s in ([r["seconds"] for r in rs] for rs in runs)]
                ratios.append(groups["seconds"] / then["seconds"])
                mixes = f"{groups['mixing']} mix{'es' * (groups['mixing'] != 1)}"
                print(f"{name:>14} {float(mib):8.2f} | {_timed(then)} | "
                      f"{_timed(groups)[:-1]}, {mixes}) {ratios[-1]:5.2f}x | "
                      f"{_timed(one)} {one['seconds'] / then['seconds']:5.2f}x", flush=True)
        finally:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(tree)],
                           check=False, capture_output=True)
    print(f"\n## layer groups over {ns.rev}'s one policy: {min(ratios):.2f}x .. "
          f"{max(ratios):.2f}x (median {statistics.median(ratios):.2f}x); within 1.5x on "
          f"{sum(r <= 1.5 for r in ratios)}/{len(ratios)}")
    if ns.repeat > 1:
        print(f"one plan's fresh processes spread over up to {max(spreads):.0%} of their "
              f"median (median spread {statistics.median(spreads):.0%})")


if __name__ == "__main__":
    main()
