"""Plans for the unrolled corpus (``tests/unrolled_models.py``), exact against XLA.

One model per way a block is found (the repeated layers of an Equinox list, a
user's own per-block checkpoints) at three budgets from the no-remat peak to
the smallest per-block built-in: each plan within its budget as XLA measures the
step with the plan applied (checkpoint barriers kept, ``client.schedule``),
predicted within 1%, never rising as the budget falls, and its gradients the
function's own. ``bench/unrolled.py`` runs the whole corpus, 16 points each.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

import optiremat
from optiremat.client.peak.finding import ANCHORS, find_regions, holds
from optiremat.client.peak.placement import PlacementError, check_layer_groups
from optiremat.client.schedule import ScheduleWarning
from optiremat.client.step import Step, lowered_peak
from optiremat.solver.solution import InfeasibleBudgetError
from tests.explain_checks import check_explained
from tests.unrolled_models import BUILTINS, CORPUS, MODELS, Model

STEP = Step.of(0)


def _peak(fun, args) -> int:
    return lowered_peak(STEP.function(fun).lower(*args), keep_barriers=True)


def _optimize(fun, args, budget: int) -> optiremat.PeakPlan:
    """A plan for the step compiled with the barriers kept, as ``_peak`` measures it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ScheduleWarning)
        plan = optiremat.optimize(fun, *args, budget=budget, schedule="barriers_kept")
    assert isinstance(plan, optiremat.PeakPlan)
    return plan


@pytest.mark.parametrize("name", ["equinox_mlp_L6", "user_checkpoint_gpt2_L4"])
def test_plans_fit_are_exact_and_reach_the_per_block_builtins(name: str) -> None:
    model = MODELS[name]
    fun, args = model.build(model.user_policy)
    no_remat = _peak(*model.build(None))
    least = min(_peak(*model.build(policy)) for policy in BUILTINS.values())
    with pytest.raises(InfeasibleBudgetError) as err:
        _optimize(fun, args, 1)
    assert err.value.min_budget_bytes <= least  # the smallest budget it answers
    peaks = []
    for budget in (no_remat, (no_remat + least) // 2, least):
        plan = _optimize(fun, args, budget)
        measured = _peak(plan.apply(fun), args)
        assert measured <= budget
        assert abs(plan.peak_bytes - measured) <= 0.01 * measured
        check_explained(plan.graph, plan.solution)
        peaks.append(measured)
    assert peaks == sorted(peaks, reverse=True)
    got, want = jax.grad(plan.apply(fun))(*args), jax.grad(fun)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("model", CORPUS, ids=lambda m: m.name)
def test_every_block_is_one_region(model: Model) -> None:
    """As many regions as the model has blocks, each holding a whole block (as many
    matmuls and convolutions as the others): a U-Net's blocks of two convolutions each
    (called from five places), penzai's first block (a transpose more) and a decoder's
    first and last (attention unwindowed) as well as the blocks between."""
    fun, args = model.build(None)
    closed = jax.make_jaxpr(fun)(*args)
    params = len(jax.tree.leaves(args[0]))
    regions = find_regions(closed, [True] * params + [False] * (len(closed.in_avals) - params))
    assert len(regions) == model.blocks
    anchors = {sum(holds(e, ANCHORS) for e in r.eqns) for r in regions}
    assert len(anchors) == 1 and anchors.pop() >= 2


def test_blocks_of_different_shapes_are_found_as_calls() -> None:
    """A U-Net's blocks differ in shape at each level: found as the calls of one function,
    whole, the smallest per-block built-in is a budget they answer, fitting and exact."""
    model = MODELS["unet_3level"]
    fun, args = model.build(None)
    least = min(_peak(*model.build(policy)) for policy in BUILTINS.values())
    plan = _optimize(fun, args, least)
    measured = _peak(plan.apply(fun), args)
    assert measured <= least and abs(plan.peak_bytes - measured) <= 0.01 * measured
    assert "repeated block at" in plan.explain()


def test_repeated_blocks_planned_apart_fill_the_budget_one_policy_leaves() -> None:
    """Midway between two per-block built-ins of a decoder in a Python loop, one policy
    for every block leaves a tenth of the budget unused; its last blocks taking the saves
    of a plan recomputing less fill it (``client.peak.block_mixing``), each block its own
    checkpoint: measured as predicted, within the budget, recomputing less, gradients
    the function's own. The plan names its blocks and places them from the plan alone."""
    model = MODELS["jax_loop_llama_L6"]
    fun, args = model.build(None)
    lean, heavy = (_peak(*model.build(BUILTINS[name]))
                   for name in ("nothing_saveable", "dots_with_no_batch_dims_saveable"))
    budget = (lean + heavy) // 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ScheduleWarning)
        one = optiremat.optimize(fun, *args, budget=budget, schedule="barriers_kept",
                                 layer_groups=False)
    apart = _optimize(fun, args, budget)
    groups = apart.solution.layer_groups
    assert groups and [g.layers for g in groups] == [1] * model.blocks
    regions = apart.graph.step.regions
    assert {regions[g.region].kind for g in groups} == {"block"}
    # The first blocks take the plan's own policy, the last ones another's.
    saves = [set(g.saved_keys) for g in groups]
    assert saves[0] == set(apart.solution.saved_keys) != saves[-1]
    assert sum(a != b for a, b in zip(saves[:-1], saves[1:], strict=True)) == 1
    measured = _peak(apart.apply(fun), args)
    assert measured == apart.peak_bytes <= budget
    assert apart.solution.recompute_flops < one.solution.recompute_flops
    assert measured > _peak(one.apply(fun), args)  # it used room one policy left
    text = apart.explain()
    assert "residuals, block 0" in text and f"residuals, block {model.blocks - 1}" in text
    check_explained(apart.graph, apart.solution)
    got, want = jax.grad(apart.apply(fun))(*args), jax.grad(fun)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # A block takes one policy of its own, never layer groups.
    closed = jax.make_jaxpr(fun)(*args)
    params = len(jax.tree.leaves(args[0]))
    block = find_regions(closed, [True] * params + [False] * (len(closed.in_avals) - params))[0]
    with pytest.raises(PlacementError, match="runs once"):
        check_layer_groups(block, [(2, None)])
