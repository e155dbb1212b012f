"""Peak plans as users get them: ``optimize``, ``apply``, ``verify`` and ``explain`` on
the scan corpus (``tests/peak_models.py``), bad input, and nested groups of layers.

The exactness of the peak model, model by model, is ``tests/test_peak.py``'s.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import optiremat
from optiremat.client.peak.placement import Placement, PlacementError
from optiremat.client.peak.step_graph import step_extraction
from optiremat.client.plan import Verification
from optiremat.client.policy import KeyPolicy
from optiremat.client.step import (
    Step,
    StepError,
    compile_ahead,
    compiled_for_memory,
    forget_compiled_memory,
    lowered_memory,
)
from optiremat.solver.graph import CostGraph, GraphError
from optiremat.solver.solution import InfeasibleBudgetError
from optiremat.solver.solve import max_useful_budget, min_feasible_budget, solve
from tests.lm_models import lm
from tests.peak_models import CORPUS, cnn, llama, small_llama, vit

# Among the suite's longest: handed out first (tests/conftest.py).
pytestmark = pytest.mark.slow

STEP = Step.of(0)


def test_apply_keeps_gradients_and_signature() -> None:
    fun, args = CORPUS[0].build()
    plan = optimize_mid(fun, args)
    plain = jax.jit(jax.grad(fun))(*args)
    placed = jax.jit(jax.grad(plan.apply(fun)))(*args)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(placed), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    assert plan.apply(fun)(*args).shape == fun(*args).shape
    assert plan.apply(fun).__name__ == fun.__name__


def optimize_mid(fun, args, **options) -> optiremat.Plan:
    g = step_extraction(fun, args, STEP).graph
    budget = (min_feasible_budget(g) + max_useful_budget(g)) // 2
    return optiremat.optimize(fun, *args, budget=budget, **options)


def test_verify_compiles_the_step_and_reports_both_peaks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fun, args = CORPUS[0].build()
    plan = optimize_mid(fun, args)
    compiles = _counting_compiles(monkeypatch)
    check = plan.verify(fun, *args, peak=True)
    assert check.exact and check.within_budget and not check.warning
    assert check.predicted_peak_bytes == plan.peak_bytes
    assert abs(check.peak_error) <= 0.10
    # optimize compiled the step under the plan it answers: verify reads that peak.
    assert compiles == []


def test_a_second_optimize_of_the_same_step_compiles_no_step_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step program a process compiled is remembered by its text
    (``client.step.lowered_peak``): planning the same function again compiles at most
    the tiny probe programs, never the step."""
    fun, args = CORPUS[0].build()
    first = optimize_mid(fun, args)
    compiles = _counting_compiles(monkeypatch)
    again = optimize_mid(*CORPUS[0].build())
    assert again.solution.fingerprint() == first.solution.fingerprint()
    assert again.peak_bytes == first.peak_bytes
    assert compiles == []


def _counting_compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The text of every program XLA compiles from here on (the real compile runs)."""
    compiled: list[str] = []
    original = jax.stages.Lowered.compile

    def compile(lowered, *a, **k):
        compiled.append(lowered.as_text()[:200])
        return original(lowered, *a, **k)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile)
    return compiled


def test_explain_breaks_the_peak_down() -> None:
    fun, args = CORPUS[0].build()
    # One policy per stack: the phases (a plan with layer groups: test_layer_groups.py).
    text = optimize_mid(fun, args, layer_groups=False).explain()
    for part in ("peak of the training step", "arguments", "gradients", "per layer x 8 layers",
                 "working set"):
        assert part in text


def test_the_smallest_peak_is_what_an_infeasible_budget_names() -> None:
    fun, args = CORPUS[0].build()
    floor = min_feasible_budget(step_extraction(fun, args, STEP).graph)
    with pytest.raises(InfeasibleBudgetError) as info:
        optiremat.optimize(fun, *args, budget=floor - 1)
    assert info.value.min_budget_bytes == floor
    assert optiremat.optimize(fun, *args, budget=floor).peak_bytes == floor


def test_shape_dtype_structs_are_enough() -> None:
    fun, args = llama(layers=4, d=128, ffn=256, heads=4, kv_heads=2, batch=1, seq=64)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    planned = optimize_mid(fun, shapes)
    assert planned.graph.content_hash == optimize_mid(fun, args).graph.content_hash
    assert planned.verify(fun, *shapes, peak=True).within_budget


def test_donated_parameters_lower_the_peak_by_their_gradients() -> None:
    fun, args = CORPUS[0].build()
    kept = step_extraction(fun, args, Step.of(0)).graph.step
    donated = step_extraction(fun, args, Step.of(0, donate_argnums=0)).graph.step
    gradient_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(args[0]))
    assert kept.held_bytes - donated.held_bytes == gradient_bytes
    assert donated.alias_bytes == gradient_bytes


def test_residual_budgets_remain_available() -> None:
    fun, args = CORPUS[0].build()
    plan = optiremat.optimize(fun, *args, budget="30MiB", memory="residuals")
    assert plan.memory == "residuals" and plan.peak_bytes is None
    assert plan.verify(fun, *args).exact


def test_a_graph_without_its_step_cannot_plan_a_peak() -> None:
    fun, args = CORPUS[0].build()
    graph = optiremat.extract_graph(fun, *args)
    with pytest.raises(GraphError, match="memory='residuals'"):
        solve(graph, 10**9, memory="peak")


def test_the_step_graph_travels_as_json() -> None:
    fun, args = CORPUS[3].build()
    graph = step_extraction(fun, args, STEP).graph
    again = CostGraph.model_validate_json(graph.model_dump_json())
    assert again == graph and again.content_hash == graph.content_hash
    budget = (min_feasible_budget(graph) + max_useful_budget(graph)) // 2
    assert solve(again, budget).fingerprint() == solve(graph, budget).fingerprint()


def test_no_differentiable_input_is_a_clear_error() -> None:
    def count(ids, w):
        return jnp.sum(w[ids])
    with pytest.raises(StepError, match="no floating-point input"):
        optiremat.optimize(count, jnp.arange(4), jnp.ones(8), budget="1MiB")


def test_a_scan_inside_a_cond_cannot_be_placed() -> None:
    def fun(ws, x, flag):
        def stack(h):
            return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, ws)[0]
        return jnp.sum(lax.cond(flag, stack, lambda h: h, x))
    with pytest.raises(PlacementError, match="inside a cond"):
        optiremat.optimize(fun, jnp.ones((4, 8, 8)), jnp.ones((2, 8)), True, budget="1MiB")


# ---- nested groups: an outer scan over rematerialised groups of layers ------------


@pytest.fixture(scope="module")
def deep_stack() -> tuple:
    """Sixteen layers whose inputs outweigh a group's parameters: nesting pays."""
    fun, args = llama(layers=16, d=128, ffn=344, heads=4, kv_heads=2, batch=8, seq=256)
    return fun, args, step_extraction(fun, args, STEP)


def test_nested_groups_lower_the_smallest_peak_and_keep_the_gradients(deep_stack) -> None:
    fun, args, extracted = deep_stack
    nested = min_feasible_budget(extracted.graph)
    per_layer = min_feasible_budget(extracted.graph, nest=False)
    assert nested < per_layer
    plan = optiremat.optimize(fun, *args, budget=nested)
    assert plan.groups is not None and plan.groups[0] in (2, 4, 8)
    check = plan.verify(fun, *args, peak=True)
    assert check.exact and check.within_budget and abs(check.peak_error) <= 0.10
    text = plan.explain()
    assert "rematerialised groups" in text
    assert "what each lever bought" in text and "  nested groups " in text
    plain = jax.jit(jax.grad(fun))(*args)
    nested_grads = jax.jit(jax.grad(plan.apply(fun)))(*args)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(nested_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_nesting_costs_a_second_forward_pass_so_roomy_budgets_do_not_nest(deep_stack) -> None:
    fun, args, extracted = deep_stack
    roomy = optiremat.optimize(fun, *args, budget=max_useful_budget(extracted.graph))
    assert roomy.groups == (1,) and roomy.recompute_flops == 0


def test_a_group_count_that_leaves_a_remainder_is_refused_with_those_that_fit(deep_stack) -> None:
    fun, args, extracted = deep_stack
    placement = Placement(extracted.regions, extracted.differentiated, STEP)
    with pytest.raises(PlacementError, match=r"takes \[1, 2, 4, 8, 16\]"):
        jax.eval_shape(placement.apply(fun, KeyPolicy(frozenset()), [3]), *args)


@pytest.mark.parametrize(("predicted", "measured", "says"), [
    (100, 100, None), (110, 100, None), (91, 100, None),
    (100, 120, "more than the predicted"), (125, 100, "less than the predicted")])
def test_verify_warns_when_the_peak_is_off_by_more_than_a_tenth_either_way(
        predicted: int, measured: int, says: str | None) -> None:
    mib = 2**20
    check = Verification(0, 0, 200 * mib, [], predicted_peak_bytes=predicted * mib,
                         measured_peak_bytes=measured * mib)
    if says is None:
        assert check.warning == ""
    else:
        assert says in check.warning and f"{measured}.00 MiB" in check.warning


@pytest.mark.parametrize("build", [
    lambda: llama(layers=2, dtype=jnp.bfloat16), lambda: vit(layers=2), lambda: cnn(layers=2),
    lambda: lm(layers=2, vocab=1024, dtype=jnp.bfloat16)], ids=["llama_bf16", "vit", "cnn", "lm"])
def test_a_program_compiled_for_its_memory_holds_what_the_default_compile_holds(build) -> None:
    """Measurement compiles skip the code generator's optimisation (client.step): XLA's
    memory analysis is the same to the byte (bench/peak.py compares every corpus model)."""
    fun, args = build()
    remat = jax.checkpoint(fun, policy=jax.checkpoint_policies.nothing_saveable)
    lowered = STEP.function(remat).lower(*args)
    fast, default = compiled_for_memory(lowered).memory_analysis(), lowered.compile(
        ).memory_analysis()
    for field in ("argument", "output", "temp", "alias"):
        attr = f"{field}_size_in_bytes"
        assert getattr(fast, attr) == getattr(default, attr), field


def test_a_program_compiled_ahead_is_measured_once_and_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Refinement starts the compiles of the candidates it measures next on worker threads
    (``client.step.compile_ahead``): the measurement waits for that compile, compiles
    nothing again, and reads what a compile on this thread reads."""
    fun, args = llama(layers=2)
    programs = [STEP.function(jax.checkpoint(fun, policy=policy)).lower(*args)
                for policy in (jax.checkpoint_policies.nothing_saveable,
                               jax.checkpoint_policies.dots_saveable)]
    forget_compiled_memory()
    compiles = _counting_compiles(monkeypatch)
    for lowered in programs:
        compile_ahead(lowered)
        compile_ahead(lowered)  # once only
    ahead = [lowered_memory(lowered) for lowered in programs]
    assert len(compiles) == 2
    forget_compiled_memory()
    here = [lowered_memory(lowered) for lowered in programs]
    assert ahead == here and ahead[0].peak_bytes < ahead[1].peak_bytes


def test_the_first_candidate_compiles_beside_the_first_plan_and_changes_no_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the first plan refinement solves fits as priced, the candidate it measures
    next compiles on a spare worker while that plan compiles here
    (``refine._Refinement._candidates_ahead``): the same plan as with no worker to spare,
    one more program compiled on a worker and none compiled twice. That compile is spent
    where the first plan, measured, moves the best plan past the candidate (here on jax
    0.12.1): then it is the one program the plan made besides."""
    from optiremat.client.peak import refine

    fun, args = small_llama()
    g = step_extraction(fun, args, STEP).graph
    budget = min_feasible_budget(g) + (max_useful_budget(g) - min_feasible_budget(g)) // 4
    compiled: list[tuple[bool, str]] = []
    original = jax.stages.Lowered.compile

    def compile(lowered, *a, **k):
        compiled.append((threading.current_thread() is threading.main_thread(),
                         lowered.as_text()))
        return original(lowered, *a, **k)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile)
    runs = {}
    for workers in (2, 1):  # one candidate ahead; none
        monkeypatch.setattr(refine, "COMPILE_WORKERS", workers)
        forget_compiled_memory()
        compiled.clear()
        planned = optiremat.optimize(fun, *args, budget=budget, layer_groups=False)
        runs[workers] = ((planned.saved_keys, planned.peak_bytes, planned.recompute_flops),
                         [text for _, text in compiled], sum(not here for here, _ in compiled))
    (plan, programs, on_workers), (alone, alone_programs, alone_on_workers) = runs[2], runs[1]
    assert plan == alone
    assert len(set(programs)) == len(programs), "no program compiled twice"
    assert set(alone_programs) <= set(programs) and len(programs) <= len(alone_programs) + 1
    assert on_workers == alone_on_workers + 1, "the candidate compiled on a worker"
