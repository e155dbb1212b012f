"""Time to plan with layer groups against an earlier revision's one policy (issue 39:
"time to plan stays within 1.5x of today's", today being the day it was filed).

At budgets between frontier steps of the issue's stack and three models of the scan and
LM corpora (``bench/layer_groups.py``'s), each plan from a fresh process, the three
alternating: the earlier revision's ``optimize`` (one policy per stack; ``--rev``,
checked out in a temporary git worktree), this tree's with layer groups, and this
tree's with one policy. The models are this tree's (``tests/peak_models.py``,
``tests/lm_models.py``) for all three.

    .venv/bin/python bench/plan_time_since.py [--rev 205185d] [--at MODEL:MIB ...]
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
    """A child process: one cold ``optimize`` with ``root``'s optiremat."""
    sys.path.insert(0, root)
    import optiremat

    loss, args = _models()[name]()
    options = {} if groups == "-" else {"layer_groups": groups == "1"}
    started = time.perf_counter()
    plan = optiremat.optimize(loss, *args, budget=int(mib * 2**20), **options)
    return {"seconds": time.perf_counter() - started, "flops": plan.recompute_flops}


def _in_fresh_process(root: Path, name: str, mib: float, groups: str) -> dict:
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
    print(f"each plan from a fresh process; {ns.rev}'s one policy against this tree's")
    print(f"{'model':>14} {'MiB':>8} | {ns.rev + ' s':>12} | {'groups s':>9} {'ratio':>6} | "
          f"{'one policy s':>12} {'ratio':>6}")
    ratios: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        tree = _worktree(ns.rev, Path(folder))
        try:
            for spec in ns.at:
                name, _, mib = spec.partition(":")
                then = _in_fresh_process(tree, name, float(mib), "-")
                groups = _in_fresh_process(HERE, name, float(mib), "1")
                one = _in_fresh_process(HERE, name, float(mib), "0")
                ratios.append(groups["seconds"] / then["seconds"])
                print(f"{name:>14} {float(mib):8.2f} | {then['seconds']:12.2f} | "
                      f"{groups['seconds']:9.2f} {ratios[-1]:5.2f}x | {one['seconds']:12.2f} "
                      f"{one['seconds'] / then['seconds']:5.2f}x", flush=True)
        finally:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(tree)],
                           check=False, capture_output=True)
    print(f"\n## layer groups over {ns.rev}'s one policy: {min(ratios):.2f}x .. "
          f"{max(ratios):.2f}x (median {statistics.median(ratios):.2f}x); within 1.5x on "
          f"{sum(r <= 1.5 for r in ratios)}/{len(ratios)}")


if __name__ == "__main__":
    main()
