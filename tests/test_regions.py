"""Regions beyond lax.scan: repeated blocks, the user's checkpoints, named scopes.

Small unrolled models (a few layers, D 64) planned end to end: the regions found,
plans exact against XLA's peak of the step with the plan applied, gradients equal
to the function's own, and the errors that say why a budget cannot be met.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optiremat
from optiremat.client.peak.finding import find_regions, why_no_regions
from optiremat.client.peak.placement import Placement, keeps_barriers
from optiremat.client.peak.repeats import Run, crossing_bytes, repeated_runs
from optiremat.client.peak.step_graph import step_extraction
from optiremat.client.schedule import ScheduleWarning, barriers_kept
from optiremat.client.step import Step, lowered_peak, measured_peak
from optiremat.solver.graph import KINDS_SCHEMA_VERSION, CostGraph
from optiremat.solver.solution import InfeasibleBudgetError
from optiremat.solver.step import RegionFound, RegionKind
from optiremat.solver.units import format_bytes
from tests.explain_checks import check_explained

D, B, LAYERS = 64, 256, 4
STEP = Step.of(0)
POLICIES = jax.checkpoint_policies


# ---- repeated runs, on signatures alone ---------------------------------------


def test_a_unit_repeated_between_a_head_and_a_tail_is_found_once_per_copy() -> None:
    # Three alike projections per layer and one unlike: the layer is still the unit.
    unit = ["dot", "dot", "dot", "dot_out"]
    sigs = ["embed", "add", *unit * 5, "norm", "loss"]
    anchors = [s.startswith("dot") for s in sigs]
    # The residual stream (1 byte here) crosses each layer boundary; inside a layer 3.
    crossing = [1 if (b - 2) % 4 == 0 else 3 for b in range(len(sigs) + 1)]
    (run,) = repeated_runs(sigs, anchors, crossing)
    assert run == Run(start=2, period=4, count=5)
    assert run.units()[0] == (2, 6) and run.end == 22


def test_two_stacks_are_two_runs_and_positions_without_an_anchor_none() -> None:
    sigs = ["a", "b"] * 3 + ["x", "y", "z"] * 4
    anchors = [s in {"a", "x"} for s in sigs]
    crossing = [0] * (len(sigs) + 1)
    runs = repeated_runs(sigs, anchors, crossing)
    assert [(r.start, r.period, r.count) for r in runs] == [(0, 2, 3), (6, 3, 4)]
    assert repeated_runs(sigs, [False] * len(sigs), crossing) == []
    with pytest.raises(ValueError, match="one crossing per boundary"):
        repeated_runs(sigs, anchors, crossing[:-1])


def test_a_first_and_a_last_block_alike_in_their_matmuls_extend_the_run() -> None:
    # The first block reads its input through two operations more, the last runs another
    # activation: alike to the others only in their matmuls, each is still one block.
    unit = ["copy", "norm", "dot_q", "act", "dot_o", "add"]
    first = ["transpose", "scale", "norm", "dot_q", "act", "dot_o", "add"]
    last = ["copy", "norm", "dot_q", "gelu", "dot_o", "add"]
    sigs = ["embed", *first, *unit * 3, *last, "final_norm", "head_dot", "loss"]
    anchors = [s.startswith(("dot", "head")) for s in sigs]
    edges = {1, 8, 14, 20, 26, 32}  # where only the residual stream crosses
    crossing = [1 if b in edges else 3 for b in range(len(sigs) + 1)]
    (run,) = repeated_runs(sigs, anchors, crossing)
    assert run == Run(start=8, period=6, count=3, head=7, tail=6)
    assert run.units() == [(1, 8), (8, 14), (14, 20), (20, 26), (26, 32)]
    # A position that may not be part of a block (a scan) is in none.
    free = [i != 2 for i in range(len(sigs))]
    (run,) = repeated_runs(sigs, anchors, crossing, free)
    assert not any(a <= 2 < b for a, b in run.units())


def test_boundaries_crossing_alike_are_those_cutting_fewest_scopes() -> None:
    # A pre-norm layer's midpoint crosses as little as its ends: the name scopes decide.
    unit = ["norm", "dot_q", "act", "dot_o", "add"]
    sigs = [*unit * 3, "norm", "dot_q"]
    anchors = [s.startswith("dot") for s in sigs]
    crossing = [1] * (len(sigs) + 1)
    (run,) = repeated_runs(sigs, anchors, crossing)
    assert run.start == 0  # ties: the first offset
    shared = [0 if b in {1, 6, 11, 16} else 2 for b in range(len(sigs) + 1)]
    (run,) = repeated_runs(sigs, anchors, crossing, shared=shared)
    assert run == Run(start=1, period=5, count=3)


def test_crossing_bytes_counts_what_is_live_across_each_boundary() -> None:
    # value 0 made at 0, read last at 2; value 1 made at 1, read at 3 (n = 4)
    assert crossing_bytes([0, 1], [2, 3], [10, 5], 4) == [0, 10, 15, 5, 0]


# ---- models -----------------------------------------------------------------


def _params(layers: int = LAYERS) -> list[dict]:
    keys = jax.random.split(jax.random.key(0), layers)
    return [{"w1": jax.random.normal(k, (D, 4 * D)) * 0.05,
             "w2": jax.random.normal(k, (4 * D, D)) * 0.05} for k in keys]


def _block(p: dict, x: jax.Array) -> jax.Array:
    return x + jnp.tanh(x @ p["w1"]) @ p["w2"]


_BLOCK_LINE = _block.__code__.co_firstlineno + 1


def unrolled(params: list[dict], x: jax.Array) -> jax.Array:
    for p in params:
        x = _block(p, x)
    return jnp.mean(x ** 2)


def user_checkpointed(params: list[dict], x: jax.Array) -> jax.Array:
    block = jax.checkpoint(_block, policy=POLICIES.dots_saveable)
    for p in params:
        x = block(p, x)
    return jnp.mean(x ** 2)


def single_layer(w: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.mean(jnp.tanh(x @ w) ** 2)


X = jnp.ones((B, D))


@pytest.fixture(scope="module")
def extracted():
    return step_extraction(unrolled, (_params(), X), STEP)


def _peak(fun, *args) -> int:
    return lowered_peak(STEP.function(fun).lower(*args), keep_barriers=True)


def test_a_python_loop_has_one_repeated_block_per_layer(extracted) -> None:
    regions = extracted.regions
    assert len(regions) == LAYERS
    assert {(r.kind, r.found) for r in regions} == {(RegionKind.BLOCK, RegionFound.REPEATED)}
    assert len({r.program for r in regions}) == 1  # the same code: calibrated alike
    assert [r.end - r.start for r in regions] == [4] * LAYERS  # dot, tanh, dot, add
    # Named where the user's code is: the block's line, told apart by its place.
    assert [r.describe() for r in regions] == [
        f"repeated block at test_regions.py:{_BLOCK_LINE} (_block), block {i} of {LAYERS}"
        for i in range(1, LAYERS + 1)]
    graph = extracted.graph
    assert graph.schema_version == KINDS_SCHEMA_VERSION
    assert CostGraph.model_validate_json(graph.canonical_json()).content_hash \
        == graph.content_hash


def test_repeated_blocks_plan_exactly_and_reach_the_per_block_builtin(extracted) -> None:
    params = _params()
    no_remat = _peak(unrolled, params, X)
    placement = Placement(extracted.regions, extracted.differentiated, STEP)
    nothing = _peak(placement.apply(unrolled, POLICIES.nothing_saveable), params, X)
    assert nothing < 0.9 * no_remat  # the schedule keeps the checkpoints apart
    want = jax.grad(unrolled)(params, X)
    peaks = []
    for budget in (no_remat, (no_remat + nothing) // 2, nothing):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ScheduleWarning)
            plan = optimize_quietly(unrolled, params, X, budget=budget)
        measured = _peak(plan.apply(unrolled), params, X)
        assert measured <= budget
        assert abs(measured - plan.peak_bytes) <= 0.01 * measured
        peaks.append(measured)
        got = jax.grad(plan.apply(unrolled))(params, X)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert peaks == sorted(peaks, reverse=True)  # never rises as the budget falls


def optimize_quietly(fun, *args, **kwargs):
    """A plan for a step compiled with the barriers kept, as ``_peak`` measures it (where
    this process would merge them, it warns: ignored here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ScheduleWarning)
        return optiremat.optimize(fun, *args, schedule="barriers_kept", **kwargs)


def test_the_users_checkpoints_are_regions_whose_policy_the_plan_sets() -> None:
    params = _params(3)
    extracted = step_extraction(user_checkpointed, (params, X), STEP)
    assert [r.found for r in extracted.regions] == [RegionFound.CHECKPOINT] * 3
    theirs = _peak(user_checkpointed, params, X)  # dots_saveable per block
    placement = Placement(extracted.regions, extracted.differentiated, STEP)
    least = _peak(placement.apply(user_checkpointed, POLICIES.nothing_saveable), params, X)
    assert least < theirs
    plan = optimize_quietly(user_checkpointed, params, X, budget=least)
    assert _peak(plan.apply(user_checkpointed), params, X) <= least
    got = jax.grad(plan.apply(user_checkpointed))(params, X)
    want = jax.grad(user_checkpointed)(params, X)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_plan_says_how_it_found_its_blocks(extracted) -> None:
    params = _params()
    # Under the no-remat peak: at it, the plan adds no checkpoint at all.
    plan = optimize_quietly(unrolled, params, X, budget=_peak(unrolled, params, X) * 9 // 10)
    text = plan.explain()
    assert "repeated block at" in text and "lax.scan" not in text


def test_named_scopes_are_blocks_and_a_scope_naming_nothing_lists_those_seen() -> None:
    def scoped(params, x):
        for i, p in enumerate(params):
            with jax.named_scope(f"layer_{i}"):
                x = _block(p, x)
        return jnp.mean(x ** 2)

    params = _params(2)
    closed = jax.make_jaxpr(scoped)(params, X)
    flags = STEP.differentiated((params, X))
    regions = find_regions(closed, flags, scopes=["layer_"])
    assert [r.found for r in regions] == [RegionFound.SCOPE] * 2
    with pytest.raises(optiremat.PlacementError, match=r"Scopes seen: layer_0, layer_1"):
        find_regions(closed, flags, scopes=["decoder"])
    with pytest.raises(optiremat.PlanError, match="non-empty list"):
        optiremat.optimize(scoped, params, X, budget=10**9, regions="layer_")


def test_a_budget_no_region_can_reach_says_why() -> None:
    w = jnp.ones((D, D)) * 0.01
    peak = _peak(single_layer, w, X)
    with pytest.raises(InfeasibleBudgetError, match="No plan can lower the peak: it has "
                       "no differentiated lax.scan, no checkpoint of yours") as err:
        optiremat.optimize(single_layer, w, X, budget=peak // 2)
    assert err.value.min_budget_bytes >= peak // 2
    # At that budget: a plan whose explanation adds up (it printed a negative working set).
    plan = optiremat.optimize(single_layer, w, X, budget=err.value.min_budget_bytes)
    check_explained(plan.graph, plan.solution)


def test_a_function_whose_only_loop_is_a_while_loop_is_told_to_write_it_as_a_scan() -> None:
    def fun(w, x):
        def body(carry):
            return jnp.tanh(carry[0] @ w), carry[1] + 1
        return jnp.mean(jax.lax.while_loop(lambda c: c[1] < 2, body, (x, 0))[0] ** 2)
    w = jnp.ones((D, D)) * 0.01
    closed = jax.make_jaxpr(fun)(w, X)
    assert find_regions(closed, [True, True]) == []
    why = why_no_regions(closed, [True, True])
    assert why.startswith("its only loops are while_loops") and "lax.scan" in why


def test_blocks_warn_only_where_a_plan_is_for_barriers_this_process_would_merge() -> None:
    """A plan for this process (the default) is measured as it compiles: no warning. A plan
    for a step compiled with the barriers kept warns where this process would merge them."""
    params = _params(2)
    budget = _users_peak(unrolled, params, X)
    for schedule in ("process", "barriers_kept"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optiremat.optimize(unrolled, params, X, budget=budget, schedule=schedule)
        warned = [w for w in caught if issubclass(w.category, ScheduleWarning)]
        assert bool(warned) == (schedule == "barriers_kept" and not barriers_kept())
        if warned:
            assert "cse_barrier_expander" in str(warned[0].message)
            assert warned[0].filename == __file__  # points at the caller's line
    assert keeps_barriers(step_extraction(unrolled, (params, X), STEP).regions)
    with pytest.raises(optiremat.PlanError, match="schedule= takes one of 'process', "
                       "'barriers_kept', not 'kept'"):
        optiremat.optimize(unrolled, params, X, budget=budget, schedule="kept")


def _users_peak(fun, *args) -> int:
    """The peak of the step as a user compiles it in this process: no options at all."""
    return measured_peak(jax.jit(jax.grad(fun)).lower(*args).compile())


def test_a_plan_holds_in_this_process_as_it_compiles() -> None:
    """Under this process's own compile (on jax 0.10's CPU backend it merges checkpointed
    blocks back into the forward pass) every plan measures within its budget, predicted
    within 1%; where the compile merges them, the plan says what the barriers kept would
    measure, and a budget only they reach is refused naming the setting and its figure."""
    params = _params()
    no_remat = _users_peak(unrolled, params, X)
    with pytest.raises(InfeasibleBudgetError) as err:
        optiremat.optimize(unrolled, params, X, budget=1)
    least = err.value.min_budget_bytes
    assert least <= no_remat
    merged = not barriers_kept()
    assert ("XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander" in str(err.value)) \
        == merged
    for budget in (no_remat, (no_remat + least) // 2, least):
        plan = optiremat.optimize(unrolled, params, X, budget=budget)
        measured = _users_peak(plan.apply(unrolled), params, X)
        assert measured <= budget
        assert abs(measured - plan.peak_bytes) <= 0.01 * measured
        assert plan.verify(unrolled, params, X, peak=True).measured_peak_bytes == measured
        if budget == no_remat:  # "no checkpoint" is the plan there: nothing recomputed
            assert plan.solution.no_checkpoint and plan.recompute_flops == 0
            assert plan.apply(unrolled) is unrolled
            assert "no checkpoint: the training step as written peaks at" in plan.explain()
            again = type(plan.solution).model_validate_json(plan.solution.model_dump_json())
            assert again == plan.solution
            continue
        assert not plan.solution.no_checkpoint and plan.recompute_flops > 0
        assert ("With the barriers kept the same plan measures" in plan.explain()) == merged
        if merged:  # the figure it names is the plan's own, the barriers kept
            kept = format_bytes(_peak(plan.apply(unrolled), params, X))
            assert f"the same plan measures {kept}" in plan.schedule_note


def test_at_the_no_remat_peak_a_loop_model_recomputes_nothing() -> None:
    """Planned for the barriers kept too: the step as written is a plan, and at its peak
    the one that recomputes least; a budget under it is not answered with it."""
    params = _params()
    no_remat = _peak(unrolled, params, X)
    for budget in (no_remat, 2 * no_remat):  # well above it too, where blocks saving
        # everything fit as well, recompute nothing, and hold more (their barriers kept)
        plan = optimize_quietly(unrolled, params, X, budget=budget)
        assert plan.solution.no_checkpoint and plan.peak_bytes == no_remat
    below = optimize_quietly(unrolled, params, X, budget=no_remat - 1)
    assert not below.solution.no_checkpoint and below.peak_bytes < no_remat


def test_a_scan_stack_and_unrolled_blocks_after_it_are_both_regions() -> None:
    def mixed(params, x):
        stacked = jax.tree.map(lambda *w: jnp.stack(w), *params[:2])
        x, _ = jax.lax.scan(lambda h, p: (_block(p, h), None), x, stacked)
        for p in params[2:]:
            x = _block(p, x)
        return jnp.mean(x ** 2)

    params = _params(4)
    extracted = step_extraction(mixed, (params, X), STEP)
    assert [r.kind for r in extracted.regions] == [RegionKind.SCAN, RegionKind.BLOCK,
                                                   RegionKind.BLOCK]
    no_remat = _peak(mixed, params, X)
    plan = optimize_quietly(mixed, params, X, budget=int(no_remat * 0.8))
    measured = _peak(plan.apply(mixed), params, X)
    assert measured <= int(no_remat * 0.8)
    assert abs(measured - plan.peak_bytes) <= 0.01 * measured


def test_a_block_traced_through_a_librarys_wrappers_is_named_at_the_users_line(
        tmp_path, monkeypatch) -> None:
    """Every operation of these blocks is traced inside an installed library's wrapper
    (as a named-axis library wraps each op): the name is the user's line that called it,
    with the module path it runs under."""
    library = tmp_path / "site-packages"
    library.mkdir()
    (library / "wrapping_lib.py").write_text(
        "def wrapped(op, *args):\n"
        "    return op(*args)\n")
    monkeypatch.syspath_prepend(str(library))
    from wrapping_lib import wrapped  # type: ignore[import-not-found]

    def layer(p, x):
        with jax.named_scope("decoder"):
            h = wrapped(jnp.tanh, wrapped(jnp.matmul, x, p["w1"]))
            return x + wrapped(jnp.matmul, h, p["w2"])

    def model(params, x):
        for p in params:
            x = layer(p, x)
        return jnp.mean(x ** 2)

    line = layer.__code__.co_firstlineno + 2
    regions = step_extraction(model, (_params(3), X), STEP).regions
    assert [r.describe() for r in regions] == [
        f"repeated block at test_regions.py:{line} ({layer.__qualname__}) in decoder, "
        f"block {i} of 3" for i in (1, 2, 3)]
