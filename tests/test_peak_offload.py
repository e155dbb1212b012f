"""Offload in scan layouts: a peak plan keeps per-layer residuals, the stacked layer
inputs included, in host memory; checked against the jaxpr JAX builds.

XLA's CPU memory analysis counts host buffers as device ones, so the device
peak an offloading plan reaches is predicted here, not measured; what JAX
does with the plan (its copies to host and back) is checked exactly.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import optiremat
from optiremat.client._jax_internals import core as jax_core
from optiremat.client.peak.offload_fit import fitted_offload
from optiremat.client.peak.placement import LAYER_INPUT
from optiremat.client.peak.step_graph import step_extraction
from optiremat.client.plan import PlanError
from optiremat.client.planning import check_host_memory
from optiremat.client.step import Step, host_buffers_apart
from optiremat.solver.offload import OffloadOptions, evaluate_offload
from optiremat.solver.solution import InfeasibleBudgetError
from optiremat.solver.solve import max_useful_budget, min_feasible_budget, solve
from optiremat.solver.units import format_bytes
from tests.peak_models import residual_stack
from tests.test_offload import _copies_to

# Transfers priced at nothing: the plan offloads whatever lowers the device peak.
CHEAP = OffloadOptions(host_bandwidth=10**15, device_flop_rate=1)


def smallest_offload_plan(fun, args) -> optiremat.Plan:
    try:
        optiremat.optimize(fun, *args, budget=0, offload=CHEAP)
    except InfeasibleBudgetError as err:
        return optiremat.optimize(fun, *args, budget=err.min_budget_bytes, offload=CHEAP)
    raise AssertionError("a budget of 0 was feasible")


def test_the_layer_inputs_go_to_host_and_each_offloaded_residual_is_copied_once_each_way():
    fun, args = residual_stack()
    plan = smallest_offload_plan(fun, args)
    graph = plan.graph
    named = {k for k, n in zip(graph.node_key, graph.node_primitive, strict=True)
             if n == "name"}
    assert named and named <= plan.offloaded_keys  # the stacked layer inputs left the device

    jaxpr = jax.make_jaxpr(jax.grad(plan.apply(fun)))(*args).jaxpr
    offloaded = plan.solution.offloaded()
    priced = evaluate_offload(graph, plan.solution.kept(), offloaded)
    host_values = [v for v in priced.evaluation.residuals
                   if (p := graph.producer[v]) is not None and offloaded[p]]
    to_host = _copies_to(jaxpr, jax_core.MemorySpace.Host)
    back = _copies_to(jaxpr, jax_core.MemorySpace.Device)
    # The scan body is one jaxpr: one copy each way per offloaded value of a layer.
    assert len(to_host) == len(back) == len(host_values) > 0
    assert any(e is not None and e.params.get("name") == LAYER_INPUT for e in to_host)


def test_offload_lowers_the_smallest_device_peak_and_keeps_the_gradients():
    fun, args = residual_stack()
    plan = smallest_offload_plan(fun, args)
    without = min_feasible_budget(step_extraction(fun, args, Step.of(0)).graph)
    assert plan.peak_bytes is not None and plan.peak_bytes < without
    assert plan.host_bytes > 0 and set(plan.groups) == {1}  # an offload plan is per layer
    text = plan.explain()
    assert "offloaded to host memory" in text
    lever = next(line for line in text.splitlines() if line.strip().startswith("offload "))
    assert format_bytes(plan.host_bytes) in lever  # explain names what offload bought

    want = jax.grad(fun)(*args)
    got = jax.jit(jax.grad(plan.apply(fun)))(*args)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_verify_checks_an_offload_plan_by_jax_and_refuses_a_cpu_device_peak():
    fun, args = residual_stack(layers=4)
    plan = smallest_offload_plan(fun, args)
    check = plan.verify(fun, *args)
    assert check.exact and check.measured_host_bytes == plan.host_bytes > 0
    if jax.default_backend() == "cpu":
        with pytest.raises(PlanError, match="cannot be measured on CPU"):
            plan.verify(fun, *args, peak=True)
    else:  # a backend that keeps pinned_host apart measures the device peak
        assert plan.verify(fun, *args, peak=True).measured_peak_bytes


def test_a_zero_host_budget_is_the_plan_without_offload():
    fun, args = residual_stack(layers=4)
    without = min_feasible_budget(step_extraction(fun, args, Step.of(0)).graph, nest=False)
    plan = optiremat.optimize(fun, *args, budget=without,
                              offload=OffloadOptions(host_budget_bytes=0))
    assert plan.host_bytes == 0 and not plan.offloaded_keys
    with pytest.raises(InfeasibleBudgetError) as info:
        optiremat.optimize(fun, *args, budget=without - 1,
                           offload=OffloadOptions(host_budget_bytes=0))
    assert info.value.min_budget_bytes == without


class _DeviceWithoutHostMemory:
    """A device of a backend with no host memory space (none such runs here)."""

    platform, id = "tpu", 0

    def addressable_memories(self):
        return [type("Memory", (), {"kind": "device"})()]


def test_offload_where_there_is_no_host_memory_is_refused_before_any_solve():
    check_host_memory(jax.devices()[0])  # CPU devices have pinned_host memory
    with pytest.raises(PlanError, match="pinned_host.*\\['device'\\]"):
        check_host_memory(_DeviceWithoutHostMemory())


# Where a backend's memory analysis keeps host buffers apart (a GPU's, a TPU's), an
# offload plan is answered with its step's measured device peak, and solved lower where
# that is over the budget (client.peak.offload_fit). None runs here: these tests stand a
# price missed by a fixed number of bytes in for that analysis, over the real solves of
# an offload plan's step graph. A dear link, so that budgets differ in their plans.
DEAR_LINK = OffloadOptions(host_bandwidth=10**9, device_flop_rate=10**12)


@pytest.fixture(scope="module")
def offload_solves():
    fun, args = residual_stack(layers=4)
    plan = smallest_offload_plan(fun, args)
    graph, options = plan.graph, plan.solution.options.model_copy(update={"offload": DEAR_LINK})
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(graph, 1, options)
    return graph, options, info.value.min_budget_bytes


def test_an_offload_plan_measured_under_its_price_is_answered_with_that_peak(
        offload_solves):
    graph, options, smallest = offload_solves
    budget = (smallest + max_useful_budget(graph)) // 2
    priced = solve(graph, budget, options)
    measured = []

    def measure(plan):
        measured.append(plan)
        return plan.peak_bytes - 4096

    fitted = fitted_offload(budget, lambda b: solve(graph, b, options), measure)
    # One compile, the answer's: a heavier plan for the room would be another program.
    assert len(measured) == 1 and fitted.node_decisions == priced.node_decisions
    assert fitted.peak_bytes == priced.peak_bytes - 4096 and fitted.budget_bytes == budget


def test_an_offload_plan_measured_over_its_budget_is_solved_lower(offload_solves):
    graph, options, smallest = offload_solves
    top = max_useful_budget(graph)
    budget = (smallest + top) // 2
    priced = solve(graph, budget, options)
    missed = budget - priced.peak_bytes + 1  # the answer priced within measures 1 byte over
    assert budget - missed >= smallest

    fitted = fitted_offload(budget, lambda b: solve(graph, b, options),
                            lambda plan: plan.peak_bytes + missed)
    assert fitted.peak_bytes <= budget < priced.peak_bytes + missed
    assert fitted.peak_bytes == solve(graph, budget - missed, options).peak_bytes + missed


def test_no_offload_plan_measured_within_the_budget_names_the_smallest_measured(
        offload_solves):
    graph, options, smallest = offload_solves
    with pytest.raises(InfeasibleBudgetError, match="measured over it") as info:
        fitted_offload(smallest, lambda b: solve(graph, b, options),
                       lambda plan: plan.peak_bytes + 4096)
    assert info.value.min_budget_bytes == smallest + 4096


def test_offload_plans_are_fitted_only_where_host_buffers_are_measured_apart():
    fun, args = residual_stack(layers=4)
    plan = smallest_offload_plan(fun, args)
    assert host_buffers_apart() == (jax.default_backend() != "cpu")
    if not host_buffers_apart():  # CPU: the device peak is the price, none measured
        assert plan.peak_bytes == plan.solution.peak_bytes == plan.budget_bytes
