"""A scan's layers (or repeated blocks) planned apart, against one policy per stack
(issue 39).

For each model, the one-policy frontier (``optimize(..., layer_groups=False)`` at
budgets from the smallest to the no-remat peak, each plan's measured peak), then
at each budget midway between two consecutive frontier points: the one-policy
plan and the plan with layer groups, their measured peaks (XLA's
``memory_analysis()`` of ``plan.apply(loss)``'s step), the share of the budget
used, recompute FLOPs by the project's rule and by XLA's ``cost_analysis()`` (the
step's beyond the unplanned step's, per loop trip: XLA counts a loop body once), and
the time to plan (each plan from cold caches).
``--time`` adds step times: the two plans and the best built-in per layer that fits
the budget, interleaved runs in one process, medians and spread.
``--builtins`` plans at each built-in's measured peak (the built-in in every layer or
block, placed as plans are) in place of the midpoints: the plan there recomputes no more
than the built-in by the project's rule, and by XLA's count (issue 40, item 5).

    .venv/bin/python bench/layer_groups.py [--quick] [--time] [--builtins] [--accelerator]

``--accelerator`` plans a stack sized for one accelerator chip instead (bf16, D 1024,
B 8, T 512; about 2 TFLOP a step), where a step takes long enough to time.
``--sweep N`` plans the small stack of tests/test_layer_groups.py instead, at N budgets
from its smallest plan to its no-remat peak, and counts the rises: a budget answered
with more recompute than a smaller one. ``--unrolled`` plans the unrolled corpus
(tests/unrolled_models.py: blocks in Python loops, each block planned apart by
``client.peak.block_mixing``) under the schedule that keeps checkpoints in straight-line
code apart (``client.schedule``'s flag, set for this process).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import optiremat  # noqa: E402
from optiremat.client.peak.placement import Placement  # noqa: E402
from optiremat.client.policy import KeyPolicy  # noqa: E402
from optiremat.client.schedule import MEMORY_SCHEDULE_FLAG  # noqa: E402
from optiremat.client.step import forget_compiled_memory  # noqa: E402
from optiremat.solver.baselines import policy_saves  # noqa: E402
from optiremat.solver.semantics import recompute_flops  # noqa: E402
from tests.lm_models import CORPUS as LM_CORPUS  # noqa: E402
from tests.peak_models import CORPUS as PEAK_CORPUS  # noqa: E402
from tests.peak_models import llama, small_llama  # noqa: E402

MiB = 2**20
BUILTINS = ("nothing_saveable", "dots_with_no_batch_dims_saveable", "dots_saveable")


def models(quick: bool, accelerator: bool, unrolled: bool = False):
    """The issue's stack; then the scan corpus's Llama and ViT and the LM corpus's V8k.
    Or the unrolled corpus (its first two models with ``quick``)."""
    if unrolled:
        from tests.unrolled_models import CORPUS as UNROLLED

        for model in UNROLLED[:2] if quick else UNROLLED:
            yield model.name, model.build(model.user_policy)
        return
    if accelerator:
        yield "llama bf16 L8 (D 1024, FFN 2816, 16/4 heads, B 8, T 512)", llama(
            layers=8, d=1024, ffn=2816, heads=16, kv_heads=4, batch=8, seq=512,
            dtype=jnp.bfloat16)
        return
    yield "llama f32 L8 (issue 39: D 256, B 4, T 256)", llama(layers=8, batch=4, seq=256)
    if not quick:
        for model in PEAK_CORPUS:
            if model.name in ("llama_f32_L8", "vit_L12"):
                yield model.name, model.build()
        for lm in LM_CORPUS:
            if lm.name == "lm_V8k":
                yield lm.name, lm.build()


def stack_options(parser: argparse.ArgumentParser) -> None:
    """The options of the benches that time one stack's steps (``one_stack``)."""
    parser.add_argument("--accelerator", action="store_true",
                        help="a stack sized for one accelerator chip (bf16, D 1024)")
    parser.add_argument("--rounds", type=int, default=15, help="timed runs of each step")


def one_stack(accelerator: bool):
    """The issue's stack (or the accelerator's), after a line naming the device: its name,
    loss, arguments, unplanned step and XLA's FLOPs of that step."""
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    name, (loss, args) = next(models(quick=True, accelerator=accelerator))
    unplanned = step_of(loss, args)
    return name, loss, args, unplanned, xla_flops(unplanned)


def step_of(fun, args):
    return jax.jit(jax.grad(fun)).lower(*args).compile()


def xla_flops(compiled, kind: str = "flops") -> float:
    """XLA's ``cost_analysis()`` of a step: its FLOPs, or another count it keeps
    ("bytes accessed", "transcendentals"); a loop's body counted once."""
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return float(analysis.get(kind, 0.0))


def xla_flops_per_trip(loss, args, plan, compiled) -> float:
    """XLA's count of the plan's step. XLA counts a loop's body once whatever its trip
    count, so a step whose scan runs as several loops is counted as the mean, weighted by
    layers, of its groups' saves each in one scan: comparable to a one-policy plan's."""
    step = plan.graph.step
    if not plan.layer_groups or all(step.regions[region].kind == "block"
                                    for region, _, _ in plan.layer_groups):
        return xla_flops(compiled)  # no loop: counted whole
    length = sum(layers for _, layers, _ in plan.layer_groups)
    return sum(layers * xla_flops(step_of(plan.placement.apply(loss, KeyPolicy(keys)), args))
               for _, layers, keys in plan.layer_groups) / length


def layer_runs(plan) -> str:
    """The plan's layers by the saves they take, consecutive groups (or blocks) of equal
    saves together: "4+3+1", or "1 group"."""
    runs: list[list] = []
    for _, layers, keys in plan.layer_groups:
        if runs and runs[-1][1] == keys:
            runs[-1][0] += layers
        else:
            runs.append([layers, keys])
    return "+".join(str(n) for n, _ in runs) or "1 group"


def plan_at(loss, args, budget, layer_groups, **options):
    # Timed from cold caches (JAX's and the planner's), as a fresh process would plan.
    jax.clear_caches()
    forget_compiled_memory()
    start = time.perf_counter()
    plan = optiremat.optimize(loss, *args, budget=budget, layer_groups=layer_groups,
                              **options)
    seconds = time.perf_counter() - start
    compiled = step_of(plan.apply(loss), args)
    return plan, optiremat.measured_peak(compiled), seconds, compiled


def builtin_step(loss, args, plan, name):
    """The step with JAX's built-in ``name`` in every layer, placed as plans are."""
    placement: Placement = plan.placement
    policy = getattr(jax.checkpoint_policies, name)
    return step_of(placement.apply(loss, policy), args)


def best_builtin(loss, args, plan, budget: int) -> dict:
    """The built-in per layer saving most (the last of ``BUILTINS``) whose step, placed
    as ``plan`` is, fits ``budget`` as measured: {its name: its compiled step}, or {}."""
    for name in reversed(BUILTINS):
        compiled = builtin_step(loss, args, plan, name)
        if optiremat.measured_peak(compiled) <= budget:
            return {name: compiled}
    return {}


def at_builtins(loss, args, placed, unplanned_flops: float) -> list[tuple[bool, float, bool]]:
    """At each built-in's measured peak, with the built-in placed per layer or block as
    ``placed`` (a plan) places it: the plan ``optimize`` answers there, its recompute by
    the project's rule and by XLA's count against the built-in's, printed. Per built-in:
    whether the plan recomputes no more by the project's rule, XLA's ratio, whether the
    plan fits."""
    graph = placed.graph
    saves = policy_saves(graph)
    rows = []
    print(f"{'built-in, per layer':>34} | {'its peak':>10} {'FLOPs':>9} {'XLA':>9} | "
          f"{'plan':>10} {'FLOPs':>9} {'XLA':>9} {'runs':>5} | ours, XLA")
    for name in (name for name in BUILTINS if name in saves):  # those the graph expresses
        compiled = builtin_step(loss, args, placed, name)
        peak = optiremat.measured_peak(compiled)
        flops = recompute_flops(graph, saves[name])
        its_x = xla_flops(compiled) - unplanned_flops
        plan, plan_peak, _, plan_c = plan_at(loss, args, peak, True)
        plan_x = xla_flops_per_trip(loss, args, plan, plan_c) - unplanned_flops
        # XLA's count of a step recomputing nothing differs from the unplanned step's by
        # a few FLOPs either way (the graph's 0 is exact): below 1e-6 of the step, even.
        tiny = 1e-6 * unplanned_flops
        xla = plan_x / its_x if its_x > tiny else (1.0 if plan_x <= tiny else float("inf"))
        ours = plan.recompute_flops <= flops
        rows.append((ours, xla, plan_peak <= peak))
        print(f"{name:>34} | {peak / MiB:6.2f} MiB {flops:9.3g} {its_x:9.3g} | "
              f"{plan_peak / MiB:6.2f} MiB {plan.recompute_flops:9.3g} {plan_x:9.3g} "
              f"{layer_runs(plan):>5} | {'<=' if ours else 'MORE'} {xla:6.3f}"
              f"{'' if plan_peak <= peak else ' OVER its budget'}")
    return rows


def timed(steps: dict, args, rounds: int = 15) -> dict:
    """Interleaved runs of each compiled step: median and spread in ms. The order turns
    each round, so that no step always runs first (on a busy 2-core CPU, a plan run first
    in every round took a median 281 ms, the same plan run second 256 ms)."""
    times: dict = {name: [] for name in steps}
    for compiled in steps.values():
        jax.block_until_ready(compiled(*args))  # warm
    order = list(steps.items())
    for turn in range(rounds):
        for name, compiled in order[turn % len(order):] + order[:turn % len(order)]:
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: (statistics.median(t), min(t), max(t)) for name, t in times.items()}


def sweep(points: int) -> None:
    """The small stack of tests/test_layer_groups.py at ``points`` budgets, one policy and
    layer groups: measured peak, FLOPs, and the steps up where a larger budget recomputes
    more."""
    loss, args = small_llama()
    top = optiremat.measured_peak(step_of(loss, args))
    low = optiremat.min_feasible_budget(loss, *args)
    print(f"\ntest stack (L 8, D 128, B 2, T 128): no remat {top / MiB:.2f} MiB, smallest "
          f"plan {low / MiB:.2f} MiB")
    print(f"{'budget':>9} | {'one policy':>22} | {'layer groups':>30}")
    flops: dict[bool, list[int]] = {False: [], True: []}
    for i in range(points):
        budget = low + (top - low) * i // (points - 1)
        one, one_peak, _, _ = plan_at(loss, args, budget, False)
        mixed, mixed_peak, _, _ = plan_at(loss, args, budget, True)
        flops[False].append(one.recompute_flops)
        flops[True].append(mixed.recompute_flops)
        groups = layer_runs(mixed)
        print(f"{budget / MiB:9.2f} | {one_peak / MiB:7.2f} MiB {one.recompute_flops:9.3g} | "
              f"{mixed_peak / MiB:7.2f} MiB {100 * mixed_peak / budget:5.1f}% "
              f"{mixed.recompute_flops:9.3g} {groups:>5}")
    for apart, label in ((False, "one policy"), (True, "layer groups")):
        rises = sum(b > a for a, b in zip(flops[apart], flops[apart][1:], strict=False))
        print(f"## {label}: recompute rose on {rises} of {points - 1} steps up the budget")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the issue's stack only")
    parser.add_argument("--time", action="store_true", help="time the compiled steps")
    parser.add_argument("--points", type=int, default=6, help="frontier budgets per model")
    parser.add_argument("--accelerator", action="store_true",
                        help="a stack sized for one accelerator chip, in place of the corpus")
    parser.add_argument("--sweep", type=int, metavar="N",
                        help="the test stack at N budgets, counting rises, in place of the rest")
    parser.add_argument("--unrolled", action="store_true",
                        help="the unrolled corpus, its blocks planned apart, in place of the rest")
    parser.add_argument("--builtins", action="store_true",
                        help="plan at each built-in's measured peak in place of the midpoints")
    ns = parser.parse_args()
    if ns.unrolled:  # before JAX starts its backend, which reads the flags once
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {MEMORY_SCHEDULE_FLAG}"
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    if ns.sweep:
        if ns.sweep < 2:
            parser.error("--sweep takes 2 budgets or more")
        sweep(ns.sweep)
        return
    tally: dict[str, list[float]] = {"fill": [], "ratio": [], "xla": [], "time": []}
    exact = within = 0
    at_peaks: list[tuple[bool, float, bool]] = []
    for name, (loss, args) in models(ns.quick, ns.accelerator, ns.unrolled):
        unplanned = step_of(loss, args)
        top, unplanned_flops = optiremat.measured_peak(unplanned), xla_flops(unplanned)
        low = optiremat.min_feasible_budget(loss, *args, layer_groups=False)
        print(f"\n{name}: no remat {top / MiB:.2f} MiB, smallest plan {low / MiB:.2f} MiB")
        if ns.builtins:
            placed, *_ = plan_at(loss, args, low, False)
            at_peaks += at_builtins(loss, args, placed, unplanned_flops)
            continue
        frontier = {}
        for i in range(ns.points):
            budget = low + (top - low) * i // (ns.points - 1)
            plan, peak, _, _ = plan_at(loss, args, budget, False)
            frontier[peak] = plan.recompute_flops
        points = sorted(frontier.items())
        print("one-policy frontier: " + ", ".join(f"{p / MiB:.2f} MiB {f:.3g}" for p, f in points))
        print(f"{'budget':>9} | {'one policy':>22} | {'layer groups':>30} | flops "
              "ratio (ours, XLA) | plan time ratio")
        for (p0, _), (p1, _) in zip(points, points[1:], strict=False):
            budget = (p0 + p1) // 2
            one, one_peak, one_s, one_c = plan_at(loss, args, budget, False)
            mixed, mixed_peak, mixed_s, mixed_c = plan_at(loss, args, budget, True)
            groups = layer_runs(mixed)
            ratio = mixed.recompute_flops / one.recompute_flops if one.recompute_flops else 1.0
            # XLA's recompute: the step's FLOPs beyond the unplanned step's.
            one_x = xla_flops(one_c) - unplanned_flops
            mixed_x = xla_flops_per_trip(loss, args, mixed, mixed_c) - unplanned_flops
            xla = mixed_x / one_x if one_x > 0 else 1.0
            same = "=" if mixed.peak_bytes == mixed_peak else "!="
            exact, within = exact + (same == "="), within + (mixed_peak <= budget)
            for key, value in (("fill", mixed_peak / budget), ("ratio", ratio), ("xla", xla),
                               ("time", mixed_s / one_s)):
                tally[key].append(value)
            print(f"{budget / MiB:9.2f} | {one_peak / MiB:7.2f} MiB {one.recompute_flops:9.3g} | "
                  f"{mixed_peak / MiB:7.2f} MiB {100 * mixed_peak / budget:5.1f}% "
                  f"{mixed.recompute_flops:9.3g} {groups:>5} | {ratio:6.3f} {xla:6.3f} "
                  f"| {mixed_s / one_s:5.2f} (predicted {same} measured)")
            if ns.time:
                steps = {"layer groups": mixed_c, "one policy": one_c,
                         **best_builtin(loss, args, mixed, budget)}
                for label, (median, lo, hi) in timed(steps, args).items():
                    print(f"{'':9}   step time {label}: {median:.1f} ms ({lo:.1f}-{hi:.1f})")
    if ns.builtins:
        count = len(at_peaks)
        print(f"\n## at {count} built-ins' measured peaks: within budget "
              f"{sum(fits for _, _, fits in at_peaks)}/{count}, recompute <= the built-in "
              f"{sum(ours for ours, _, _ in at_peaks)}/{count} (XLA's count "
              f"{sum(x <= 1 for _, x, _ in at_peaks)}/{count}, at most "
              f"{max(x for _, x, _ in at_peaks):.3f}x)")
        return
    count = len(tally["fill"])
    print(f"\n## {count} midpoints: within budget {within}/{count}, predicted = measured "
          f"{exact}/{count}, budget used >= 96% {sum(f >= 0.96 for f in tally['fill'])}/{count} "
          f"(least {100 * min(tally['fill']):.1f}%), recompute <= one policy "
          f"{sum(r <= 1 for r in tally['ratio'])}/{count} (XLA's count "
          f"{sum(r <= 1 for r in tally['xla'])}/{count}, at most {max(tally['xla']):.3f}x), "
          f"plan time {min(tally['time']):.2f}-{max(tally['time']):.2f}x one policy's")


if __name__ == "__main__":
    main()
