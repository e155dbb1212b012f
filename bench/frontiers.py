"""A frontier over peak budgets against XLA: the table ``bench/peak.py`` prints for the
scan corpus and ``bench/unrolled.py`` for the unrolled one.

Each plan ``optimize`` answers (solved, then refined against its measured step) next to
the peak XLA's ``memory_analysis()`` gives its compiled step, and each of JAX's built-in
policies applied per region with the plan solved at its measured peak.
"""

from __future__ import annotations

import time
from typing import Any

import jax

from optiremat.client.peak.measures import step_measure
from optiremat.client.peak.placement import Placement, keeps_barriers
from optiremat.client.peak.refine import refined_solve
from optiremat.client.peak.step_graph import step_extraction
from optiremat.client.policy import KeyPolicy
from optiremat.client.step import Step, lowered_peak
from optiremat.solver.baselines import policy_saves
from optiremat.solver.frontier import spaced_budgets
from optiremat.solver.peak import BudgetView
from optiremat.solver.semantics import recompute_flops
from optiremat.solver.solution import InfeasibleBudgetError
from optiremat.solver.solve import max_useful_budget, min_feasible_budget, solve
from optiremat.solver.units import format_bytes

# The built-ins are compared at their measured peak plus this share of it: refined
# predictions are exact to within 0.5% and never under (the frontiers print the
# errors in bytes; XLA's small buffers vary with the policy by up to 30 KB), so at
# a measured peak to the byte a built-in may be predicted a little over.
MARGIN = 0.001


def measure(fun, args, extracted, saved_keys: frozenset[str], groups=None) -> int:
    """The compiled step's peak with ``saved_keys`` saved in every region (and its layers
    in ``groups`` rematerialised groups, where a plan nests them)."""
    step = Step.of(0)
    placement = Placement(extracted.regions, extracted.differentiated, step)
    applied = placement.apply(fun, KeyPolicy(saved_keys), groups)
    return lowered_peak(step.function(applied).lower(*args), keeps_barriers(extracted.regions))


def plan_at(fun, args, extracted, budget: int):
    """The plan ``optimize`` answers: solved, then refined against its measured step."""
    g = extracted.graph
    placement = Placement(extracted.regions, extracted.differentiated, Step.of(0))
    return refined_solve(g, extracted.regions, budget, lambda b: solve(g, b, time_limit_s=30),
                         step_measure(fun, args, extracted, placement))


def frontier(model: Any, points: int) -> dict:
    """The frontier of ``model`` (``name`` and ``build()``) over ``points`` budgets, printed;
    its figures for the summary line."""
    fun, args = model.build()
    started = time.perf_counter()
    extracted = step_extraction(fun, args, Step.of(0), name=model.name)
    extract_s = time.perf_counter() - started
    g = extracted.graph
    low, high = min_feasible_budget(g), max_useful_budget(g)
    print(f"\n## {model.name}: {g.num_nodes} nodes, held {format_bytes(g.step.held_bytes)}, "
          f"working set {format_bytes(g.step.working_bytes)} (extraction and calibration "
          f"{extract_s:.1f} s); peak budgets {format_bytes(low)} .. {format_bytes(high)}")
    print(f"{'budget':>11} {'status':>8} {'predicted':>11} {'measured':>11} {'error':>7} "
          f"{'fits':>5} {'recompute FLOPs':>16} {'model':>11} {'error':>7}")
    errors, misses, fits, rises, last = [], [], 0, 0, None
    model_errors = []
    for budget in sorted(spaced_budgets(low, high, points), reverse=True):
        sol = plan_at(fun, args, extracted, budget)
        peak = measure(fun, args, extracted, frozenset(sol.saved_keys), sol.groups)
        error = (sol.peak_bytes - peak) / peak
        errors.append(error)
        misses.append(sol.peak_bytes - peak)
        # The phase model's own price of the plan, before refinement measured it.
        priced = BudgetView.of(g, None, sol.groups).predicted(
            sol.kept())
        model_errors.append((priced - peak) / peak)
        fit = peak <= budget
        fits += fit
        if last is not None and peak > last:
            rises += 1
        last = peak
        print(f"{format_bytes(budget):>11} {sol.status:>8} {format_bytes(sol.peak_bytes):>11} "
              f"{format_bytes(peak):>11} {error:>+7.2%} {'yes' if fit else 'NO':>5} "
              f"{sol.recompute_flops:>16.4g} {format_bytes(priced):>11} "
              f"{model_errors[-1]:>+7.2%}")
    print(f"prediction error {min(errors):+.1%} .. {max(errors):+.1%} ({min(misses):+,} .. "
          f"{max(misses):+,} bytes); the phase model alone {min(model_errors):+.1%} .. "
          f"{max(model_errors):+.1%}; measured within budget "
          f"{fits}/{len(errors)}; measured peak rose as the budget fell {rises} time(s)")

    print(f"{'built-in, per layer':>34} {'measured':>11} {'FLOPs':>12} {'plan there':>12} "
          f"{'plan FLOPs':>12}   (the plan at the measured peak + {MARGIN:.1%})")
    for name, saves in policy_saves(g).items():
        keys = frozenset(k for k, s in zip(g.node_key, saves, strict=True) if s and k)
        peak = measure(fun, args, extracted, keys)
        flops = recompute_flops(g, saves)
        try:
            sol = plan_at(fun, args, extracted, int(peak * (1 + MARGIN)))
            mark = "<=" if sol.recompute_flops <= flops else "MORE"
            plan_text = f"{sol.recompute_flops:>12.4g} {mark}"
        except InfeasibleBudgetError as err:
            plan_text = f"infeasible (min {format_bytes(err.min_budget_bytes)})"
        print(f"{name:>34} {format_bytes(peak):>11} {flops:>12.4g} {'':>12} {plan_text}")

    outer = jax.checkpoint(fun, policy=jax.checkpoint_policies.nothing_saveable)
    print(f"{'(one checkpoint around everything)':>34} "
          f"{format_bytes(lowered_peak(Step.of(0).function(outer).lower(*args))):>11}")
    return {"errors": errors, "misses": misses, "fits": fits, "points": len(errors),
            "rises": rises, "model_errors": model_errors}
