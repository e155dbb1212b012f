"""XLA's CPU schedule of per-block checkpoints: the probe against a direct measurement.

Per-block ``nothing_saveable`` on an unrolled model is measured with and without the
options ``memory_compile_options`` answers; what the probe says of this process's
default compiles must be what the measurement shows, on whichever JAX is installed
(jaxlib 0.10 removes the barriers on CPU, jax 0.12 keeps them).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optiremat.client.schedule import (
    MEMORY_SCHEDULE_FLAG,
    MEMORY_SCHEDULE_OPTIONS,
    barriers_kept,
    memory_compile_options,
    schedule_advice,
)
from optiremat.client.step import measured_peak

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU schedule")


def _block(x, w):
    h = jnp.tanh(x @ w[0])
    h = jax.nn.gelu(h @ w[1])
    return x + h @ w[2]


def _peak(checkpointed: bool, options: dict[str, str]) -> int:
    """Six unrolled blocks (D 128, B 512): a model of the probe's kind, at another size."""
    block = jax.checkpoint(_block, policy=jax.checkpoint_policies.nothing_saveable) \
        if checkpointed else _block

    def loss(ws, x):
        for w in ws:
            x = block(x, w)
        return jnp.mean(x * x)

    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal((3, 128, 128)) * 0.05, jnp.float32) for _ in range(6)]
    x = jnp.asarray(rng.standard_normal((512, 128)), jnp.float32)
    return measured_peak(jax.jit(jax.grad(loss)).lower(ws, x).compile(options))


def test_checkpoints_lower_the_peak_under_the_memory_options():
    assert _peak(True, memory_compile_options()) < 0.8 * _peak(False, memory_compile_options())


def test_the_probe_says_what_the_default_compile_does():
    lowered = _peak(True, {}) < 0.8 * _peak(False, {})
    assert barriers_kept() == lowered
    if jax.__version_info__ >= (0, 12):
        assert barriers_kept()


def test_options_only_where_the_barriers_are_removed():
    assert memory_compile_options() == ({} if barriers_kept() else MEMORY_SCHEDULE_OPTIONS)


def test_the_advice_keeps_the_barriers_in_a_new_process():
    """What ``schedule_advice`` tells users to set, set: the process keeps the barriers."""
    assert MEMORY_SCHEDULE_FLAG in schedule_advice()
    assert repr(MEMORY_SCHEDULE_OPTIONS) in schedule_advice()
    env = {**os.environ, "XLA_FLAGS": MEMORY_SCHEDULE_FLAG, "JAX_PLATFORMS": "cpu"}
    probe = ("from optiremat.client.schedule import barriers_kept, memory_compile_options\n"
             "print(barriers_kept(), memory_compile_options())")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["True", "{}"]
