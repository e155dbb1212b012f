"""Plans are exact: JAX saves what the plan predicts, byte for byte and FLOP for FLOP.

For every corpus model, at budgets from the smallest feasible to "save
everything", the residuals ``saved_residuals`` lists for the plan's policy sum
to ``plan.residual_bytes`` and fit the budget, the backward pass's extra FLOPs
over ``everything_saveable`` equal ``plan.recompute_flops``, and the names form
holds to its own prediction the same way.
"""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optiremat.client import KeyPolicy, extract_graph, optimize
from optiremat.client.extract import graph_of_traced, trace
from optiremat.client.measure import backward_flops, residual_bytes, xla_backward_flops
from optiremat.solver.semantics import evaluate
from optiremat.solver.solution import InfeasibleBudgetError
from optiremat.solver.solve import max_useful_budget, min_feasible_budget
from tests.models import CORPUS

FRACTIONS = (0.0, 0.2, 0.45, 0.7, 1.0)
BUILTINS = {
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}


def budgets(fun, args) -> list[int]:
    graph = extract_graph(fun, *args)
    lo, hi = min_feasible_budget(graph), max_useful_budget(graph)
    return sorted({lo + int(f * (hi - lo)) for f in FRACTIONS})


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_any_key_policy_is_predicted_exactly(name):
    """The extraction alone, no solver: random save sets over the graph's keys
    (expanded through its tie groups) cost what semantics.evaluate says."""
    fun, args = CORPUS[name]
    extraction = graph_of_traced(trace(fun, args, {}))
    graph = extraction.graph
    keys = sorted({k for k, m in zip(graph.node_key, graph.node_mode, strict=True)
                   if k and m == "free"})
    for seed in range(4):
        rnd = random.Random(seed)
        chosen = {k for k in keys if rnd.random() < 0.5}
        saved = [k in chosen for k in graph.node_key]
        policy_keys = frozenset().union(*(extraction.key_aliases.get(k, {k}) for k in chosen))
        forced = {k for k, m in zip(graph.node_key, graph.node_mode, strict=True)
                  if k and m == "save"}
        policy = KeyPolicy(policy_keys | forced)
        assert residual_bytes(jax.checkpoint(fun, policy=policy), *args) == \
            evaluate(graph, saved).residual_bytes


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_policy_form_is_exact(name):
    fun, args = CORPUS[name]
    points = budgets(fun, args)
    assert len(points) >= 5 or points[0] == points[-1]
    for budget in points:
        plan = optimize(fun, *args, budget=budget, memory="residuals")
        check = plan.verify(fun, *args, flops=True)
        assert check.measured_bytes == plan.residual_bytes, (budget, check.residuals)
        assert check.measured_bytes <= budget
        assert check.measured_recompute_flops == plan.recompute_flops, budget


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_names_form_is_exact(name):
    fun, args = CORPUS[name]
    feasible = 0
    for budget in budgets(fun, args):
        plan = optimize(fun, *args, budget=budget, memory="residuals")
        try:
            names = plan.names
        except InfeasibleBudgetError as err:
            # The names form cannot save values that exist only in the
            # differentiated program (such as 1 - tanh(x)^2), so its smallest
            # budget can sit above the policy form's.
            assert err.min_budget_bytes > budget
            continue
        feasible += 1
        measured = residual_bytes(names.checkpoint(), *args)
        assert measured == names.residual_bytes <= budget
        everything = jax.checkpoint(names.fun, policy=jax.checkpoint_policies.everything_saveable)
        extra = backward_flops(names.checkpoint(), *args) - backward_flops(everything, *args)
        assert extra == names.recompute_flops
    assert feasible >= 2


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_never_worse_than_builtin_policies(name):
    fun, args = CORPUS[name]
    everything = jax.checkpoint(fun, policy=BUILTINS["everything_saveable"])
    base = backward_flops(everything, *args)
    floor = min_feasible_budget(extract_graph(fun, *args))
    for policy in BUILTINS.values():
        checkpointed = jax.checkpoint(fun, policy=policy)
        bytes_, flops = residual_bytes(checkpointed, *args), backward_flops(checkpointed, *args)
        assert bytes_ >= floor
        plan = optimize(fun, *args, budget=bytes_, memory="residuals")
        assert plan.recompute_flops <= flops - base


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_same_gradients_as_without_checkpointing(name):
    fun, args = CORPUS[name]
    graph = extract_graph(fun, *args)
    budget = (min_feasible_budget(graph) + max_useful_budget(graph)) // 2
    plan = optimize(fun, *args, budget=budget, memory="residuals")
    argnums = tuple(i for i, a in enumerate(args)
                    if all(jnp.issubdtype(x.dtype, jnp.inexact)
                           for x in jax.tree_util.tree_leaves(a)))
    want = jax.jit(jax.grad(fun, argnums=argnums))(*args)
    got = jax.jit(jax.grad(plan.checkpoint(fun), argnums=argnums))(*args)
    # Recomputing bf16 work in the backward pass rounds differently from the
    # forward pass (XLA fuses it in higher precision); JAX pins only residuals
    # with reduce_precision. So bf16 models agree to bf16 precision.
    low_precision = name == "mixed_bf16"
    for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got), strict=True):
        w, g = np.asarray(w, np.float32), np.asarray(g, np.float32)
        atol = 2e-2 * float(np.max(np.abs(w))) if low_precision else 1e-6
        np.testing.assert_allclose(g, w, rtol=0 if low_precision else 1e-5, atol=atol)


# XLA's cost analysis prices a loop body once, whatever its trip count, so
# models with scan or while loops are left out; on CPU it also emulates bf16
# arithmetic with extra conversions, so the mixed-precision model is too; and
# it prices elementwise work its own way, so only models whose recompute is
# matrix work are compared.
@pytest.mark.parametrize("name", ["mlp", "transformer_block", "conv_net"])
def test_xla_agrees_on_recompute_flops(name):
    """XLA's cost analysis of the compiled backward pass is within 10% of the
    plan's recompute FLOPs at the smallest budget."""
    fun, args = CORPUS[name]
    graph = extract_graph(fun, *args)
    plan = optimize(fun, *args, budget=min_feasible_budget(graph), memory="residuals")
    everything = jax.checkpoint(fun, policy=BUILTINS["everything_saveable"])
    xla_plan = xla_backward_flops(plan.checkpoint(fun), *args)
    xla_base = xla_backward_flops(everything, *args)
    assert xla_plan is not None and xla_base is not None, "XLA reported no FLOPs"
    assert plan.recompute_flops > 0
    assert abs((xla_plan - xla_base) - plan.recompute_flops) <= 0.1 * plan.recompute_flops
