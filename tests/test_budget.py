"""``budget="auto"``: device memory less what the training step holds anyway."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import optiremat
from optiremat.client.budget import HEADROOM, BudgetError, device_memory_bytes
from optiremat.client.measure import saved_residuals
from tests.models import CORPUS
from tests.peak_models import CORPUS as PEAK_CORPUS

KiB = 1024
MiB = 1024 * KiB


def mlp():
    fun, args = CORPUS["mlp"]  # loss(x, w1, w2, w3)
    return fun, args


def test_cpu_reports_no_memory_limit_and_auto_says_what_to_do_instead() -> None:
    assert jax.devices()[0].platform == "cpu"
    fun, args = mlp()
    with pytest.raises(BudgetError, match="device_memory=") as caught:
        optiremat.optimize(fun, *args, budget="auto")
    assert "cpu platform reports no memory limit" in str(caught.value)
    with pytest.raises(BudgetError):
        device_memory_bytes()


def test_auto_with_device_memory_solves_for_what_is_left() -> None:
    fun, args = mlp()
    x, weights = args[0], args[1:]
    weight_bytes = sum(w.nbytes for w in weights)
    opt_state = jax.tree_util.tree_map(lambda w: jnp.zeros((2, *w.shape)), weights)  # Adam
    keywords = dict(device_memory="64KiB", optimizer_state=opt_state, argnums=(1, 2, 3))
    budget = optiremat.memory_budget(fun, *args, **keywords)

    assert budget.device_bytes == 64 * KiB
    assert budget.headroom_bytes == int(64 * KiB * HEADROOM + 0.999)
    assert budget.argument_bytes == x.nbytes + weight_bytes
    assert budget.gradient_bytes == weight_bytes
    assert budget.optimizer_bytes == 2 * weight_bytes
    assert budget.update_bytes == weight_bytes + 2 * weight_bytes  # nothing donated
    assert budget.residual_budget == (budget.device_bytes - budget.held_bytes
                                      + budget.input_residual_bytes)
    assert "= residual budget" in budget.describe("residuals")

    plan = optiremat.optimize(fun, *args, budget="auto", memory="residuals", **keywords)
    assert plan.budget_bytes == budget.residual_budget
    check = plan.verify(fun, *args)
    assert check.exact and check.within_budget


def test_auto_peak_budget_is_the_device_less_headroom_and_optimizer_state() -> None:
    fun, args = PEAK_CORPUS[0].build()
    keywords = dict(device_memory="256MiB", optimizer_state="64MiB")
    budget = optiremat.memory_budget(fun, *args, **keywords)
    assert budget.peak_budget == 256 * MiB - budget.headroom_bytes - 64 * MiB
    assert "= peak budget" in budget.describe()
    plan = optiremat.optimize(fun, *args, budget="auto", **keywords)
    assert plan.budget_bytes == budget.peak_budget and plan.peak_bytes <= plan.budget_bytes


def test_arguments_the_backward_pass_always_reads_are_not_counted_twice() -> None:
    fun, args = mlp()
    budget = optiremat.memory_budget(fun, *args, device_memory="1MiB")
    everything = jax.checkpoint(fun, policy=jax.checkpoint_policies.everything_saveable)
    from_arguments = sum(r.bytes for r in saved_residuals(everything, *args)
                         if r.source.startswith("from the argument"))
    assert budget.input_residual_bytes == from_arguments > 0


def test_donation_aliases_the_updated_parameters_and_optimizer_state() -> None:
    fun, args = mlp()
    weight_bytes = sum(w.nbytes for w in args[1:])
    kept = optiremat.memory_budget(fun, *args, device_memory="1MiB", argnums=(1, 2, 3),
                                optimizer_state="8KiB")
    donated = optiremat.memory_budget(fun, *args, device_memory="1MiB", argnums=(1, 2, 3),
                                   optimizer_state="8KiB", donate_argnums=(1, 2, 3))
    partly = optiremat.memory_budget(fun, *args, device_memory="1MiB", argnums=(1, 2, 3),
                                  optimizer_state="8KiB", donate_argnums=(1,))
    assert kept.update_bytes == weight_bytes + 8 * KiB
    assert donated.update_bytes == 0
    assert partly.update_bytes == weight_bytes - args[1].nbytes + 8 * KiB
    assert donated.residual_budget - kept.residual_budget == weight_bytes + 8 * KiB


def test_too_little_memory_and_misused_keywords_are_clear_errors() -> None:
    fun, args = mlp()
    with pytest.raises(BudgetError, match="leaves no memory for residuals"):
        optiremat.optimize(fun, *args, budget="auto", memory="residuals", device_memory="1KiB")
    with pytest.raises(BudgetError, match="leaves no memory for the training step"):
        optiremat.optimize(fun, *args, budget="auto", device_memory="1KiB",
                           optimizer_state="1KiB")
    with pytest.raises(TypeError, match="only apply to budget='auto'"):
        optiremat.optimize(fun, *args, budget="1MiB", device_memory="1GiB")
    with pytest.raises(ValueError, match="takes 4 arguments"):
        optiremat.memory_budget(fun, *args, device_memory="1MiB", donate_argnums=(7,))
    with pytest.raises(ValueError, match="headroom"):
        optiremat.memory_budget(fun, *args, device_memory="1MiB", headroom=1.5)
