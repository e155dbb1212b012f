"""Peak budgets against XLA: prediction, budgets honoured, the built-ins, and scale.

    .venv/bin/python bench/peak.py            # the whole corpus, 16 points each (~10 min)
    .venv/bin/python bench/peak.py --quick    # 6 points on three models
    .venv/bin/python bench/peak.py --offload-only   # offload and levers (on a GPU:
                                                    # the measured device peak too)

Layers outside lax.scan (the unrolled corpus, both CPU schedules) are
``bench/unrolled.py``'s, which this runs last (``--quick`` as here).

For every model of the scan corpus (``tests/peak_models.py``) it prints:

* a frontier over peak budgets: each plan's predicted peak next to the peak
  XLA's ``memory_analysis()`` gives its compiled step (argument + output +
  temp - alias), the error, whether the measured peak fits the budget, and
  whether the measured peak ever rises as the budget falls;
* JAX's built-in policies applied per layer (``plan.apply`` with the built-in
  in every region): their measured peak and recompute FLOPs, and the plan
  solved at exactly that measured peak, which must not recompute more;
* the one-checkpoint-around-everything form the README used to teach, for the
  record (its peak does not move);

the nested groups against the best hand-written nesting, the smallest device peak
with offload, one frontier over the three levers (per layer, nested, offload) in
estimated seconds, and then the time to plan an 8B-shaped Llama stack from ``ShapeDtypeStruct``
arguments (32 layers, D=4096, F=14336, T=8192, 32/8 heads, bf16), with the
calibration compile timed apart.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.compiles import CompileTimer  # noqa: E402
from bench.frontiers import frontier, plan_at  # noqa: E402
from bench.unrolled import main as unrolled_main  # noqa: E402
from optiremat.client.peak.placement import Placement  # noqa: E402
from optiremat.client.peak.step_graph import step_extraction  # noqa: E402
from optiremat.client.policy import KeyPolicy  # noqa: E402
from optiremat.client.step import (  # noqa: E402
    Step,
    StepMemoryAnalysis,
    compiled_for_memory,
    lowered_memory,
    lowered_peak,
    measured_peak,
)
from optiremat.solver.solution import InfeasibleBudgetError  # noqa: E402
from optiremat.solver.solve import min_feasible_budget  # noqa: E402
from optiremat.solver.units import format_bytes  # noqa: E402
from tests.lm_models import CORPUS as LM_CORPUS  # noqa: E402
from tests.lm_models import LM, PRESETS, dot_flops, lm  # noqa: E402
from tests.peak_models import CORPUS, llama, residual_stack  # noqa: E402


def nested() -> None:
    """64 Llama-style layers: the plan's smallest peak against hand-written nesting."""
    fun, args = llama(layers=64, d=128, ffn=344, heads=4, kv_heads=2, batch=8, seq=256)
    step = Step.of(0)
    extracted = step_extraction(fun, args, step)
    placement = Placement(extracted.regions, extracted.differentiated, step)

    def temp(applied) -> int:
        return lowered_memory(step.function(applied).lower(*args)).temp_bytes

    nothing = KeyPolicy(frozenset())
    per_layer = temp(placement.apply(fun, nothing, [1]))
    hand = {k: temp(placement.apply(fun, nothing, [k])) for k in (4, 8, 16)}
    floor = min_feasible_budget(extracted.graph)
    try:
        plan = plan_at(fun, args, extracted, floor)
    except InfeasibleBudgetError as err:  # measured, the smallest plan holds a little more
        floor = err.min_budget_bytes      # (18 KiB on an H200, jax 0.11.2)
        plan = plan_at(fun, args, extracted, floor)
    keys = frozenset(plan.saved_keys)
    planned = temp(placement.apply(fun, KeyPolicy(keys), plan.groups or [1]))
    best = min(hand.values())
    print(f"\n## nested groups, 64 Llama-style layers (temp bytes of the compiled step)\n"
          f"per layer, nothing_saveable {format_bytes(per_layer)}; by hand in groups of "
          + ", ".join(f"{64 // k}: {format_bytes(t)}" for k, t in hand.items())
          + f"\nthe plan at its smallest peak ({format_bytes(floor)}, groups {plan.groups}): "
          f"{format_bytes(planned)} = {planned / best:.3f}x the best by hand, "
          f"{planned / per_layer:.3f}x per layer")


def offload() -> None:
    """The smallest device peak with offload (CPU: predicted; XLA's CPU memory analysis
    counts host buffers as device ones) against the smallest without (nesting allowed)."""
    from optiremat import optimize
    from optiremat.solver.offload import OffloadOptions

    options = OffloadOptions()  # the smallest device peak depends on the host budget only
    print("\n## offload in scan layouts: smallest feasible device peak (predicted)")
    cases = {"residual stack, 64 layers (d 128, batch 2048)": residual_stack(64, 128, 2048),
             "Llama, 64 layers (d 128, batch 8, seq 256)":
                 llama(layers=64, d=128, ffn=344, heads=4, kv_heads=2, batch=8, seq=256)}
    for name, (fun, args) in cases.items():
        graph = step_extraction(fun, args, Step.of(0)).graph
        without = min_feasible_budget(graph)
        try:
            optimize(fun, *args, budget=0, offload=options)
        except InfeasibleBudgetError as err:
            smallest = err.min_budget_bytes
        plan = optimize(fun, *args, budget=smallest, offload=options)
        sol = plan.solution
        assert sol.offload is not None and graph.step is not None
        summed = options.seconds(options.cost_flops(sol.recompute_flops, sol.offload.host_bytes))
        print(f"{name}: without offload {format_bytes(without)} (held "
              f"{format_bytes(graph.step.held_bytes)}, working set "
              f"{format_bytes(graph.step.working_bytes)}), with offload "
              f"{format_bytes(smallest)} ({smallest / without:.3f}x) and "
              f"{format_bytes(plan.host_bytes)} in host memory "
              f"({len(plan.offloaded_keys)} keys offloaded, the layer input among them); "
              f"estimated {sol.offload.estimated_seconds * 1e3:.3f} ms added with transfers "
              f"overlapping the layers' compute, {summed * 1e3:.3f} ms if nothing overlapped")
        print("  measured: " + measured_offload(fun, args, plan))


def measured_offload(fun, args, plan) -> str:
    """The offload plan's compiled step as XLA counts it: device peak and host temp bytes.
    Only a backend that places pinned_host buffers apart (GPU, TPU) can say; XLA's CPU
    memory analysis counts them as device bytes."""
    if jax.default_backend() == "cpu":
        return ("not here: XLA's CPU memory analysis counts pinned_host buffers as device "
                "ones (run this bench on a GPU or TPU)")
    compiled = Step.of(0).function(plan.apply(fun)).lower(*args).compile()
    device = measured_peak(compiled)
    host = compiled.memory_analysis().host_temp_size_in_bytes
    return (f"device peak {format_bytes(device)} against {format_bytes(plan.peak_bytes)} "
            f"predicted ({(plan.peak_bytes - device) / device:+.1%}); host temp "
            f"{format_bytes(host)} against {format_bytes(plan.host_bytes)} offloaded")


def levers(plot: Path | None) -> None:
    """One frontier over recomputation per layer, nested groups and offload: each
    point the lever that adds the fewest estimated seconds at its budget."""
    from optiremat.client.frontier import graph_builtin_points, lever_floors, sweep
    from optiremat.client.plot import plot_frontier
    from optiremat.solver.offload import OffloadOptions

    cases = {"residual_stack": ("residual stack, 64 layers", residual_stack(64), 10**12),
             "llama": ("Llama, 64 layers", llama(layers=64, d=128, ffn=344, heads=4,
                                                 kv_heads=2, batch=8, seq=256), 25 * 10**9)}
    for slug, (name, (fun, args), bandwidth) in cases.items():
        graph = step_extraction(fun, args, Step.of(0), name_inputs=True).graph
        options = OffloadOptions(host_bandwidth=bandwidth)
        builtins = graph_builtin_points(graph)
        started = time.perf_counter()
        # Solved at each built-in's peak too (the plan there is the fair comparison), and
        # where nested groups and recomputation per layer start to fit.
        also = [p.memory_bytes for p in builtins.values()] + lever_floors(graph, offload=options)
        front = sweep(graph, count=10, also=also, offload=options)
        took = time.perf_counter() - started
        assert front.step_seconds is not None
        print(f"\n## one frontier over the three levers: {name}, link {bandwidth / 1e9:g} GB/s "
              f"({len(front.points)} points in {took:.1f} s: 10 spaced, one at each built-in's "
              f"peak and each lever's smallest; the step itself "
              f"{front.step_seconds * 1e6:.1f} us)")
        print(f"{'budget':>12} {'peak':>12} {'added us':>9} {'host':>10}  lever")
        for p in front.plans:
            lever = p.lever + (f" {p.groups}" if p.lever == "nested groups" else "")
            print(f"{format_bytes(p.budget_bytes):>12} {format_bytes(p.memory_bytes):>12} "
                  f"{(p.estimated_seconds or 0) * 1e6:9.3f} {format_bytes(p.host_bytes or 0):>10}"
                  f"  {lever}{'' if p.pareto else ' (not Pareto)'}")
        for policy, point in builtins.items():
            print(f"{format_bytes(point.memory_bytes):>25} "
                  f"{point.recompute_flops / options.device_flop_rate * 1e6:9.3f}"
                  f"{'':>12}jax: {policy} per layer")
        if plot is not None:
            path = plot.with_name(f"{plot.stem}_{slug}{plot.suffix}")
            plot_frontier(front, path, builtins=builtins, title=name)
            print(f"plot: {path}")


def presets(model: LM) -> list[bool]:
    """The LM libraries' named presets applied per layer: each one's measured peak and
    dot FLOPs, and the plan solved at exactly that peak, its dot FLOPs counted by the
    same rule (``tests.lm_models.dot_flops``). True per preset where the plan does no
    more."""
    fun, args = model.build()
    extracted = step_extraction(fun, args, Step.of(0), name=model.name)
    placement = Placement(extracted.regions, extracted.differentiated, Step.of(0))
    print(f"{'named preset, per layer':>34} {'measured':>11} {'dot FLOPs':>12} "
          f"{'plan dot FLOPs':>15}   (the plan at exactly the preset's measured peak)")
    better = []
    for name, saved in PRESETS.items():
        applied = placement.apply(fun, jax.checkpoint_policies.save_only_these_names(*saved))
        peak = lowered_peak(Step.of(0).function(applied).lower(*args))
        flops = dot_flops(applied, *args)
        try:
            sol = plan_at(fun, args, extracted, peak)
        except InfeasibleBudgetError as err:
            print(f"{name:>34} {format_bytes(peak):>11} {flops:>12.4g} "
                  f"infeasible (min {format_bytes(err.min_budget_bytes)})")
            better.append(False)
            continue
        planned = dot_flops(placement.apply(fun, KeyPolicy(frozenset(sol.saved_keys)),
                                            sol.groups), *args)
        better.append(planned <= flops)
        print(f"{name:>34} {format_bytes(peak):>11} {flops:>12.4g} {planned:>15.4g} "
              f"{'<=' if planned <= flops else 'MORE'}")
    return better


def memory_only_compiles(models: Sequence[Any]) -> None:
    """Measurement compiles skip the code generator's optimisation (``client.step``): each
    model's step, plain and checkpointed whole, compiled both ways, figures compared."""
    same, fast, default = 0, 0.0, 0.0
    programs = 0
    for m in models:
        fun, args = m.build()
        for step_fun in (fun, jax.checkpoint(fun, policy=jax.checkpoint_policies.nothing_saveable)):
            lowered = Step.of(0).function(step_fun).lower(*args)
            started = time.perf_counter()
            quick = StepMemoryAnalysis.of(compiled_for_memory(lowered))
            middle = time.perf_counter()
            full = StepMemoryAnalysis.of(lowered.compile())
            fast, default = fast + middle - started, default + time.perf_counter() - middle
            same, programs = same + (quick == full), programs + 1
    print(f"\n## compiled for memory only: the same memory analysis on {same}/{programs} "
          f"programs; {fast:.1f} s against {default:.1f} s compiled as a user compiles "
          f"({default / fast:.2f}x)")


def eight_billion() -> None:
    """Time to plan 8B-shaped steps from shapes: the stack alone, and with an embedding
    and an LM head over 128k tokens, every compile counted."""
    from optiremat import optimize
    from optiremat.client.peak import calibration

    stack = llama(layers=32, d=4096, ffn=14336, heads=32, kv_heads=8, batch=1, seq=8192,
                  dtype=jnp.bfloat16, abstract=True)
    with_head = lm(layers=32, d=4096, ffn=14336, heads=32, kv_heads=8, vocab=131072, batch=1,
                   seq=8192, dtype=jnp.bfloat16, abstract=True)
    for name, (fun, shapes), budget in (("stack", stack, "120GiB"),
                                        ("stack, embedding and head at V 128k", with_head,
                                         "140GiB")):
        calibration._measured.clear()
        with CompileTimer() as timer:
            started = time.perf_counter()
            plan = optimize(fun, *shapes, budget=budget)
            total = time.perf_counter() - started
        compiles = sum(timer.seconds)
        print(f"\n## 8B-shaped Llama {name}, from ShapeDtypeStruct (32 layers, bf16, T 8192): "
              f"plan {plan.status}, peak {format_bytes(plan.peak_bytes)} within {budget}; "
              f"{total:.1f} s in all: {len(timer.seconds)} compiles {compiles:.1f} s, the rest "
              f"{total - compiles:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 points on three models")
    parser.add_argument("--no-8b", action="store_true", help="skip the 8B planning time")
    parser.add_argument("--plot", type=Path, help="write the lever frontiers' plots here "
                        "(one per model, the name suffixed)")
    parser.add_argument("--offload-only", action="store_true",
                        help="only the offload and lever sections (the device check)")
    opts = parser.parse_args()
    if opts.offload_only:
        offload()
        levers(opts.plot)
        return
    models = [m for m in CORPUS if m.name in ("llama_f32_L8", "vit_L12", "mlp_L32")] \
        if opts.quick else CORPUS
    lms = [m for m in LM_CORPUS if m.name == "lm_V8k"] if opts.quick else LM_CORPUS
    results = [frontier(m, 6 if opts.quick else 16) for m in models]
    lm_results = []
    for m in lms:
        lm_results.append(frontier(m, 6 if opts.quick else 16))
        lm_results[-1]["presets"] = presets(m)
    results += lm_results
    errors = [e for r in results for e in r["errors"]]
    misses = [e for r in results for e in r["misses"]]
    model = [e for r in results for e in r["model_errors"]]
    good = [b for r in lm_results for b in r["presets"]]
    print(f"\n## all: prediction error {min(errors):+.1%} .. {max(errors):+.1%} "
          f"({min(misses):+,} .. {max(misses):+,} bytes), the phase model alone "
          f"{min(model):+.1%} .. {max(model):+.1%}; named presets the plan matches or beats "
          f"at their measured peak {sum(good)}/{len(good)}; within budget "
          f"{sum(r['fits'] for r in results)}/{sum(r['points'] for r in results)}; "
          f"rises {sum(r['rises'] for r in results)}")
    nested()
    offload()
    levers(opts.plot)
    memory_only_compiles(models + lms)
    if not opts.no_8b:
        eight_billion()
    unrolled_main(["--quick"] if opts.quick else [])


if __name__ == "__main__":
    main()
