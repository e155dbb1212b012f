"""The client's pieces: policy keys, policies, plans and their errors."""

from __future__ import annotations

import doctest
import pickle
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import optiremat.client.extract.graphs
import optiremat.client.planning
from optiremat.client import (
    ExtractionError,
    KeyPolicy,
    PlanError,
    extract_graph,
    optimize,
    policy_key,
)
from optiremat.client._jax_internals import _version_tuple
from optiremat.client.peak.placement import TraceCache
from optiremat.solver.solution import InfeasibleBudgetError
from optiremat.solver.solve import min_feasible_budget
from optiremat.solver.units import parse_bytes
from tests.models import CORPUS

KEY_SCRIPT = textwrap.dedent("""
    import jax.numpy as jnp
    from tests.models import CORPUS
    from optiremat.client import extract_graph
    fun, args = CORPUS["transformer_block"]
    print(",".join(extract_graph(fun, *args).node_key))
""")


def test_policy_keys_are_stable_across_processes():
    runs = {
        subprocess.run([sys.executable, "-c", KEY_SCRIPT], capture_output=True, text=True,
                       check=True, env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout
        for seed in ("1", "2")
    }
    fun, args = CORPUS["transformer_block"]
    here = ",".join(extract_graph(fun, *args).node_key)
    assert runs == {here + "\n"}


def test_policy_key_tells_shapes_dtypes_and_params_apart():
    f32 = jax.core.ShapedArray((4, 8), jnp.float32)
    bf16 = jax.core.ShapedArray((4, 8), jnp.bfloat16)
    sin = lax.sin_p
    assert policy_key(sin, [f32], {}) == policy_key(sin, [f32], {})
    assert policy_key(sin, [f32], {}) != policy_key(sin, [bf16], {})
    assert policy_key(sin, [f32], {"accuracy": None}) != policy_key(sin, [f32], {"accuracy": 1})
    assert policy_key(sin, [f32], {}).startswith("sin:")


def test_policy_is_immutable_hashable_and_picklable():
    fun, args = CORPUS["mlp"]
    plan = optimize(fun, *args, budget=10_000, memory="residuals")
    policy = plan.policy
    assert hash(policy) == hash(KeyPolicy(policy.saved_keys))
    assert pickle.loads(pickle.dumps(policy)) == policy
    with pytest.raises(AttributeError):
        policy.saved_keys = frozenset()


def test_same_request_same_plan():
    fun, args = CORPUS["scan_stack"]
    a = optimize(fun, *args, budget="17KiB", memory="residuals").solution
    b = optimize(fun, *args, budget=17 * 1024, memory="residuals").solution
    assert a.fingerprint() == b.fingerprint()


def test_untied_plan_refuses_a_stateless_policy_and_checkpoints_by_names():
    fun, args = CORPUS["mlp"]
    plan = optimize(fun, *args, budget=9_000, tie=False, memory="residuals")
    with pytest.raises(PlanError, match="one by one"):
        _ = plan.policy
    check = plan.verify()
    assert check.exact and check.within_budget
    assert all(name.startswith("optiremat/") for name in plan.names.names)


def test_verify_reports_prediction_and_measurement():
    fun, args = CORPUS["transformer_block"]
    plan = optimize(fun, *args, budget=15_000, memory="residuals")
    check = plan.verify(fun, *args, flops=True)
    assert check.exact and check.within_budget
    assert check.measured_bytes == sum(r.bytes for r in check.residuals)
    assert check.predicted_recompute_flops == plan.recompute_flops
    assert plan.names.residual_bytes <= plan.budget_bytes
    assert plan.verify(fun, *args).exact  # the names form leaves the key policy in charge


def test_infeasible_budget_names_the_smallest_feasible_one():
    fun, args = CORPUS["mlp"]
    floor = min_feasible_budget(extract_graph(fun, *args))
    with pytest.raises(InfeasibleBudgetError, match=str(floor)) as err:
        optimize(fun, *args, budget=floor - 1, memory="residuals")
    assert err.value.min_budget_bytes == floor
    assert optimize(fun, *args, budget=floor, memory="residuals").residual_bytes <= floor


def test_differentiated_while_carry_is_a_clear_error():
    def f(x):
        return lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * 2.0, c[1] + 1), (x, 0))[0]
    with pytest.raises(ExtractionError, match="while_loop"):
        extract_graph(lambda x: jnp.sum(f(x)), jnp.ones(3))


def test_forced_nodes_are_marked_in_the_graph():
    fun, args = CORPUS["while_loop"]
    graph = extract_graph(fun, *args)
    forced = {p for p, m in zip(graph.node_primitive, graph.node_mode, strict=True)
              if m == "recompute"}
    assert "while" in forced


@pytest.mark.parametrize("text,expected", [
    (1024, 1024), ("1024", 1024), ("12MiB", 12 * 2**20), ("1.5GB", 1_500_000_000),
    ("800 KiB", 800 * 1024), ("2_000b", 2000),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["12 parsecs", "", "-5", -5, 1.5, True])
def test_parse_bytes_rejects_nonsense(bad):
    with pytest.raises((ValueError, TypeError)):
        parse_bytes(bad)


def test_version_parsing_for_the_supported_range():
    assert _version_tuple("0.10.2") == (0, 10, 2)
    assert _version_tuple("0.11.0.dev20261101") == (0, 11, 0)


@pytest.mark.parametrize("module", [optiremat.client.extract.graphs, optiremat.client.planning])
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def _counting_stack(calls: list[int]):
    """A scan stack of tanh layers whose Python body counts how often it is traced."""
    def loss(ws, x):
        calls.append(1)
        h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.sum(h)
    return loss


@pytest.mark.parametrize("memory", ["peak", "residuals"])
def test_optimize_traces_the_function_once(memory):
    calls: list[int] = []
    ws, x = jnp.ones((4, 32, 32)), jnp.ones((8, 32))
    plan = optimize(_counting_stack(calls), ws, x, budget="1MiB", memory=memory)
    assert calls == [1]
    assert plan.memory == memory and type(plan).__name__ == {
        "peak": "PeakPlan", "residuals": "ResidualPlan"}[memory]


def test_a_trace_is_reused_for_the_same_argument_structure_and_types_only():
    calls: list[int] = []
    cache = TraceCache(_counting_stack(calls))
    ws, x = jnp.ones((4, 32, 32)), jnp.ones((8, 32))
    first = cache.traced((ws, x), {})
    assert cache.traced((ws + 1, x), {}) is first and calls == [1]
    cache.traced((ws, jnp.ones((16, 32))), {})  # another shape
    cache.traced((ws.astype(jnp.bfloat16), x.astype(jnp.bfloat16)), {})  # another dtype
    cache.traced((ws,), {"x": x})  # another structure
    assert calls == [1, 1, 1, 1]


def test_apply_traces_once_per_argument_structure_and_types():
    calls: list[int] = []
    loss = _counting_stack(calls)
    ws, x = jnp.ones((4, 32, 32)), jnp.ones((8, 32))
    applied = optimize(loss, ws, x, budget="1MiB").apply(loss)
    calls.clear()
    first = jax.jit(jax.grad(applied))(ws, x)
    again = jax.jit(jax.grad(applied))(ws * 2, x)  # another jit: its own trace of applied
    assert calls == [1]
    assert jnp.allclose(first, jax.grad(loss)(ws, x))
    assert jnp.allclose(again, jax.grad(loss)(ws * 2, x))


def test_apply_does_not_reuse_a_trace_that_closed_over_another_traces_value():
    """A function reading a value of an enclosing trace (here a learning-rate-like scale
    set by the caller) is traced anew in each: a reused jaxpr would leak the tracer."""
    ws, x = jnp.ones((4, 32, 32)), jnp.ones((8, 32))
    box = {"scale": 1.0}

    def loss(ws, x):
        h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), box["scale"] * x, ws)
        return jnp.sum(h)

    def outer(scale, fun):
        box["scale"] = scale
        return jax.grad(fun)(ws, x).sum()

    applied = optimize(loss, ws, x, budget="1MiB").apply(loss)
    got = [jax.grad(outer)(s, applied) for s in (0.5, 0.7)]
    assert jnp.allclose(jnp.array(got), jnp.array([jax.grad(outer)(s, loss) for s in (0.5, 0.7)]),
                        rtol=1e-5)
