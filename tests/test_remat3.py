"""A plan means the same with JAX's ``jax_remat3`` flag on and off.

JAX's remat3 path offers a policy only dots, convolutions and named values:
the tanh a plan saves, and the values its derivative adds
(``one_minus_square`` on 0.12), are recomputed whatever the policy says. So a
plan's checkpoints are built on JAX's partial-eval path under either flag
(``client._jax_internals.checkpoint``); these tests check, with the flag on,
that the peak XLA measures is the prediction and the flag-off plan's, that
``saved_residuals`` lists the plan's residuals, and that the backward pass runs
the FLOPs the plan reports, on a small scan stack and a small Llama LM (its head
outside the scan, its values named as LM libraries name them), each planned once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import optiremat
from optiremat.client import _jax_internals as jx
from optiremat.client.measure import backward_flops, saved_residuals
from optiremat.client.plan import PeakPlan, ResidualPlan
from optiremat.client.step import lowered_peak
from optiremat.solver.offload import OffloadOptions
from tests import lm_models

pytestmark = pytest.mark.skipif(
    jx.REMAT3 is None, reason=f"jax {jax.__version__} has no jax_remat3 flag to switch on")

ARGNUMS = (0, 1, 2)


def stack(x, w1, w2):
    def layer(h, w):
        a, b = w
        return h + jnp.sin(jnp.tanh(h @ a)) @ b, None

    h, _ = lax.scan(layer, x, (w1, w2))
    return jnp.sum(h ** 2)


def stack_with_own_checkpoint(x, w1, w2):
    """The same layers under a checkpoint the user wrote (as ``nnx.remat`` does)."""
    def layer(h, w):
        a, b = w
        return h + jnp.sin(jnp.tanh(h @ a)) @ b

    h, _ = lax.scan(lambda h, w: (jax.checkpoint(layer)(h, w), None), x, (w1, w2))
    return jnp.sum(h ** 2)


def _args() -> tuple:
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    layers, batch, d = 4, 32, 64
    return (jax.random.normal(k1, (batch, d)),
            jax.random.normal(k2, (layers, d, 4 * d)) * 0.05,
            jax.random.normal(k3, (layers, 4 * d, d)) * 0.05)


ARGS = _args()


@contextmanager
def remat3(on: bool) -> Iterator[None]:
    before = jax.config.jax_remat3
    jax.config.update("jax_remat3", on)
    try:
        yield
    finally:
        jax.config.update("jax_remat3", before)


@dataclass(frozen=True)
class Model:
    fun: Callable
    args: tuple
    argnums: int | tuple[int, ...]
    fraction: float  # of the no-remat peak: a budget that saves part of each layer

    def budget(self) -> int:
        step = jax.jit(jax.grad(self.fun, argnums=self.argnums))
        return int(lowered_peak(step.lower(*self.args)) * self.fraction)

    def optimize(self, fun: Callable | None = None) -> PeakPlan:
        plan = optiremat.optimize(fun or self.fun, *self.args, budget=self.budget(),
                                  argnums=self.argnums)
        assert isinstance(plan, PeakPlan)
        return plan

    def step_flops(self, fun: Callable) -> int:
        """FLOPs of the step's backward pass, as JAX's jaxpr runs them."""
        return backward_flops(fun, *self.args)


def _models() -> dict[str, Model]:
    lm, lm_args = lm_models.lm(layers=2, d=64, ffn=172, heads=4, kv_heads=2, vocab=512,
                               seq=32)
    # At 0.8 of its peak the LM's plan saves only dots on jax 0.12.1; at 0.85 it saves
    # 16-19 other values on 0.10.2, 0.12.0.1 and 0.12.1.
    return {"scan_stack": Model(stack, ARGS, ARGNUMS, 0.9),
            "lm": Model(lm, lm_args, 0, 0.85)}


MODELS = _models()


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request) -> Model:
    return MODELS[request.param]


@pytest.fixture(scope="module")
def peak_plan(model: Model) -> PeakPlan:
    with remat3(False):
        plan = model.optimize()
    assert any(not k.startswith("dot_general") for k in plan.saved_keys), plan.saved_keys
    return plan


@pytest.fixture(scope="module")
def flag_off(model: Model, peak_plan: PeakPlan):
    with remat3(False):
        return (peak_plan.verify(model.fun, peak=True),
                model.step_flops(peak_plan.apply(model.fun)))


def test_a_plain_policy_saves_nothing_but_dots_on_the_remat3_path() -> None:
    """The fact this rests on: handed to ``jax.checkpoint`` itself under remat3, the plan's
    policy is never asked about its tanh, so JAX recomputes it."""
    def layer(h, a, b):
        return h + jnp.sin(jnp.tanh(h @ a)) @ b

    x, w1, w2 = ARGS[0], ARGS[1][0], ARGS[2][0]
    with remat3(False):
        policy = MODELS["scan_stack"].optimize().policy
    sources = {}
    for on in (False, True):
        with remat3(on):
            residuals = saved_residuals(jax.checkpoint(layer, policy=policy), x, w1, w2)
        sources[on] = [r for r in residuals if "argument" not in r.source]
    assert sources[False], "flag off, the plan's policy saves the layer's tanh"
    assert sources[True] == [], sources[True]


def test_the_policy_taken_out_under_remat3_warns(peak_plan: PeakPlan) -> None:
    with remat3(True), pytest.warns(RuntimeWarning, match="jax_remat3 is on"):
        assert peak_plan.policy.saved_keys == peak_plan.saved_keys
    with remat3(False), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert peak_plan.policy.saved_keys == peak_plan.saved_keys


@pytest.mark.parametrize("on", [False, True], ids=["remat2", "remat3"])
def test_a_peak_plan_measures_its_prediction_under_either_flag(
        model: Model, peak_plan: PeakPlan, flag_off, on: bool) -> None:
    reference, reference_flops = flag_off
    with remat3(on):
        check = peak_plan.verify(model.fun, peak=True)
        flops = model.step_flops(peak_plan.apply(model.fun))
    assert check.measured_peak_bytes == peak_plan.peak_bytes
    assert check.measured_peak_bytes == reference.measured_peak_bytes
    assert check.measured_bytes == peak_plan.residual_bytes
    assert check.residuals == reference.residuals
    assert flops == reference_flops


def test_optimize_under_remat3_answers_the_flag_off_plan(model: Model,
                                                         peak_plan: PeakPlan) -> None:
    with remat3(True):
        plan = model.optimize()
    assert plan.saved_keys == peak_plan.saved_keys
    assert (plan.peak_bytes, plan.recompute_flops) == (peak_plan.peak_bytes,
                                                       peak_plan.recompute_flops)


def test_a_users_own_checkpoint_is_planned_the_same_under_remat3() -> None:
    """Traced under remat3 the user's checkpoint would be a new-path primitive extraction
    cannot read; it is traced on the partial-eval path, and inlined into the plan's."""
    plans = {}
    for on in (False, True):
        with remat3(on):
            plan = MODELS["scan_stack"].optimize(stack_with_own_checkpoint)
            check = plan.verify(stack_with_own_checkpoint, peak=True)
        assert check.measured_peak_bytes == plan.peak_bytes, on
        plans[on] = (plan.saved_keys, plan.peak_bytes, plan.recompute_flops)
    assert plans[True] == plans[False]


@pytest.fixture(scope="module")
def residual_budget() -> int:
    graph = optiremat.extract_graph(stack, *ARGS)
    from optiremat.solver.solve import max_useful_budget, min_feasible_budget

    lo, hi = min_feasible_budget(graph), max_useful_budget(graph)
    return lo + (hi - lo) // 2


@pytest.mark.parametrize("form", ["policy", "names", "offload"])
def test_residual_plans_are_exact_under_remat3(residual_budget: int, form: str) -> None:
    """Every form of a residual plan (the key policy, the names form, a policy that
    offloads) saves what the plan predicts and recomputes the FLOPs it reports, with the
    flag on as with it off."""
    options: dict = {"tie": form != "names"}
    if form == "offload":  # transfers all but free: the plan offloads what the budget cuts
        options["offload"] = OffloadOptions(host_bandwidth=10**18)
    plan = optiremat.optimize(stack, *ARGS, budget=residual_budget, memory="residuals",
                              **options)
    assert isinstance(plan, ResidualPlan)
    assert (plan.host_bytes > 0) == (form == "offload")
    with remat3(False):
        off = plan.verify(stack, *ARGS, flops=True)
    with remat3(True):
        on = plan.verify(stack, *ARGS, flops=True)
    assert on.exact and off.exact, (on, off)
    assert on.residuals == off.residuals
    assert on.measured_recompute_flops == off.measured_recompute_flops == plan.recompute_flops
