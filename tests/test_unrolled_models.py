"""The unrolled corpus itself: each model traces, trains, wraps each block once, and its
per-block checkpoints lower the peak under the schedule ``client.schedule`` sets."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.extend
import numpy as np
import pytest

import optiremat.client._jax_internals as jx
from optiremat.client.schedule import memory_compile_options
from optiremat.client.step import MEMORY_ONLY_OPTIONS, measured_peak
from tests.unrolled_models import BUILTINS, CORPUS, MODELS, QUICK, SCAN_TWINS, Model


def _checkpoints(jaxpr) -> int:
    """``jax.checkpoint`` equations, through call-like and control-flow equations."""
    return sum((eqn.primitive is jx.remat_p)
               + sum(_checkpoints(sub) for sub in jax.extend.core.jaxprs_in_params(eqn.params))
               for eqn in jaxpr.eqns)


# The steps here run once on tiny batches: without the code generator's optimisation
# they compile in about half the time.
QUICK_COMPILE = {"xla_backend_optimization_level": "0"}


@functools.cache
def _trained(name: str) -> tuple[float, Any, int]:
    """One step of the model without remat: loss, gradients, checkpoints in its jaxpr."""
    loss, args = MODELS[name].build(None)
    traced = jax.jit(jax.value_and_grad(loss)).trace(*args)
    value, grads = traced.lower().compile(QUICK_COMPILE)(*args)
    return float(value), jax.tree.map(np.asarray, grads), _checkpoints(traced.jaxpr.jaxpr)


@pytest.mark.parametrize("model", list(MODELS.values()), ids=list(MODELS))
def test_model_trains(model: Model):
    """The no-remat step compiles and runs to a finite loss and gradient, and no block of
    it is checkpointed; a built-in checkpoints each block once (a twin: its scan's body)."""
    value, grads, checkpoints = _trained(model.name)
    assert checkpoints == 0
    assert np.isfinite(value)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    loss, args = model.build(BUILTINS["dots_saveable"])
    wrapped = 1 if model.name in SCAN_TWINS else model.blocks
    assert _checkpoints(jax.make_jaxpr(loss)(*args).jaxpr) == wrapped


@pytest.mark.parametrize("model", [m for m in CORPUS if m.scan], ids=lambda m: m.name)
def test_scan_twin_computes_the_same_step(model: Model):
    """The same layers and weights: the same loss and gradients (the unrolled model's list
    of per-layer gradients, stacked, is the twin's)."""
    assert model.scan is not None
    unrolled, unrolled_grads, _ = _trained(model.name)
    scanned, scanned_grads, _ = _trained(model.scan)
    np.testing.assert_allclose(unrolled, scanned, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6),
                 _stacked(unrolled_grads), scanned_grads)


def _stacked(tree: Any) -> Any:
    """A list of per-layer trees as one tree of arrays stacked along a leading axis."""
    if isinstance(tree, list):
        return jax.tree.map(lambda *layers: np.stack(layers), *tree)
    if isinstance(tree, dict):
        return {key: _stacked(value) for key, value in tree.items()}
    return tree


def test_the_user_wrote_checkpoints_once():
    written = [m for m in CORPUS if m.user_policy is not None]
    assert [m.name for m in written] == ["user_checkpoint_gpt2_L4"]
    loss, args = written[0].build(written[0].user_policy)
    assert _checkpoints(jax.make_jaxpr(loss)(*args).jaxpr) == written[0].blocks


def test_quick_names_corpus_models():
    assert set(QUICK) <= {m.name for m in CORPUS}


@pytest.mark.parametrize("name", ["jax_loop_llama_L6", "equinox_mlp_L6"])
def test_per_block_checkpoints_lower_the_peak(name: str):
    """Measured as ``client.step`` measures a step, with this process's memory schedule."""
    options = MEMORY_ONLY_OPTIONS | memory_compile_options()

    def peak(remat):
        loss, args = MODELS[name].build(remat)
        return measured_peak(jax.jit(jax.grad(loss)).lower(*args).compile(options))

    assert peak(BUILTINS["nothing_saveable"]) < 0.6 * peak(None)
