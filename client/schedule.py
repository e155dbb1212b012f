"""XLA's CPU schedule of checkpoints in straight-line code, and the setting that keeps them.

Under ``jax.grad``, ``jax.checkpoint`` stages its recomputation into the backward
pass behind an optimization barrier (``prevent_cse=True``), so that XLA does not
merge it back with the forward pass it copies or run it there. On jaxlib 0.10's
CPU backend the ``cse_barrier_expander`` pass removes those barriers before CSE
and scheduling: XLA merges the recomputation with the forward pass (CSE) or
schedules it early, either way the forward values stay alive until the backward
pass, and per-block checkpoints in straight-line code barely move the peak.
Measured (jax 0.10.2, CPU): six unrolled 3-matmul blocks (D 256, B 1024, f32)
peak at 33.00 MiB without remat and 33.25 MiB with ``nothing_saveable`` per
block; with that pass disabled the same checkpoints peak at 19.00 MiB (no remat
unchanged). jax 0.12's XLA keeps the barriers by default (81920 temp bytes
against 126976 without checkpoints in ``barriers_kept``'s probe, jax 0.12.0.1).

Disabling the pass is a per-compile option (``MEMORY_SCHEDULE_OPTIONS``) or a
process flag (``XLA_FLAGS``). ``xla_cpu_enable_concurrency_optimized_scheduler=false``
is not the fix: its depth-first order is not memory-minimizing and raises the
peak of most checkpointed models.

``barriers_kept`` asks this process's XLA directly, once, rather than reading
version numbers or flags: it compiles a tiny four-block step with and without
checkpoints and compares XLA's temp bytes. (Counting the recomputed matmuls does
not tell: where XLA schedules the recomputation early rather than merging it, the dots
are all there and the peak is still the no-remat one.)
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

from optiremat.client.memory_cache import entry_name, keep_figures, kept_figures, program_hash
from optiremat.solver.units import format_bytes

# The pass that removes checkpoint barriers, and how to disable it for one compile.
BARRIER_PASS = "cse_barrier_expander"
MEMORY_SCHEDULE_OPTIONS: dict[str, str] = {"xla_disable_hlo_passes": BARRIER_PASS}
# The same for every compile of a process: XLA reads it when JAX starts its backend.
MEMORY_SCHEDULE_FLAG = f"--xla_disable_hlo_passes={BARRIER_PASS}"


# What compile a peak plan's budget holds under (``optimize(..., schedule=)``): this
# process's own ``jax.jit(step).lower(...).compile()``, or one that keeps checkpoints'
# barriers (``MEMORY_SCHEDULE_FLAG`` / ``MEMORY_SCHEDULE_OPTIONS``, jax 0.12's default).
# They differ only for checkpoints in straight-line code where ``barriers_kept()`` is false.
Schedule = Literal["process", "barriers_kept"]
SCHEDULES: tuple[Schedule, ...] = ("process", "barriers_kept")


class ScheduleWarning(UserWarning):
    """This process's XLA merges checkpoints' recomputation back into the forward pass,
    so the peak it compiles for per-block checkpoints is not the one a plan means."""


def _block(x: jax.Array, w: jax.Array) -> jax.Array:
    return x + jnp.tanh(jnp.tanh(x @ w[0]) @ w[1])


def _probe_temp_bytes(checkpointed: bool) -> int:
    block = jax.checkpoint(_block, policy=jax.checkpoint_policies.nothing_saveable) \
        if checkpointed else _block

    def loss(ws: jax.Array, x: jax.Array) -> jax.Array:
        for w in ws:
            x = block(x, w)
        return jnp.sum(x * x)

    ws = jax.ShapeDtypeStruct((4, 2, 32, 32), jnp.float32)
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    lowered = jax.jit(jax.grad(loss)).lower(ws, x)
    # Under the process's default options: a cache entry of its own (``client.memory_cache``).
    entry = entry_name(program_hash(lowered), None)
    kept = kept_figures(entry)
    if kept is not None and "temp_bytes" in kept:
        return kept["temp_bytes"]
    analysis = lowered.compile().memory_analysis()
    temp = 0 if analysis is None else int(analysis.temp_size_in_bytes)
    keep_figures(entry, {"temp_bytes": temp})
    return temp


@functools.cache
def barriers_kept() -> bool:
    """Whether this process's default compiles keep ``jax.checkpoint``'s barriers (its
    recomputation runs in the backward pass). Only the CPU backend is asked; elsewhere
    the defaults stand and the answer is True. Asked once per process (XLA reads its
    flags once)."""
    if jax.default_backend() != "cpu":
        return True
    # Kept, the checkpoints hold a third less (84 KiB against 128 KiB, jax 0.10.2 with
    # the pass disabled); removed, exactly the no-remat figure.
    return _probe_temp_bytes(True) < 0.9 * _probe_temp_bytes(False)


def memory_compile_options() -> dict[str, str]:
    """Compiler options under which a step's checkpoints keep their recomputation in the
    backward pass: ``MEMORY_SCHEDULE_OPTIONS`` where this process's CPU compiles would
    merge it back, else none."""
    if jax.default_backend() == "cpu" and not barriers_kept():
        return dict(MEMORY_SCHEDULE_OPTIONS)
    return {}


def merged_schedule_note(peak_bytes: int, kept_peak_bytes: int) -> str:
    """What a plan for this process (whose compiles merge checkpointed blocks back into the
    forward pass) would measure with the barriers kept."""
    return (f"Planned for this process's own compile, which merges checkpointed blocks back "
            f"into the forward pass ({BARRIER_PASS}): {format_bytes(peak_bytes)}. With the "
            f"barriers kept the same plan measures {format_bytes(kept_peak_bytes)}, and plans "
            f"reach lower: {_BARRIERS_KEPT}.")


def merged_infeasible_why(kept_min_budget_bytes: int) -> str:
    """Why a budget is out of reach in this process, and what reaches it."""
    return (f"This process's XLA ({BARRIER_PASS}) merges checkpointed blocks back into the "
            f"forward pass, and plans are made for its own compile; with the barriers kept "
            f"plans reach down to {kept_min_budget_bytes} bytes "
            f"({format_bytes(kept_min_budget_bytes)}): {_BARRIERS_KEPT}")


# How a user plans for the barriers kept, in this process or in a compile of their own.
_BARRIERS_KEPT = (f"set XLA_FLAGS={MEMORY_SCHEDULE_FLAG} before JAX starts and plan again, or "
                  "plan with schedule='barriers_kept' for a step compiled with "
                  f"compiler_options={MEMORY_SCHEDULE_OPTIONS!r}")


def schedule_advice() -> str:
    """How a user gets, in their own process, the schedule peaks are measured under."""
    return (f"This process's XLA ({BARRIER_PASS}) removes jax.checkpoint's barriers on CPU, "
            "so checkpointed blocks outside a lax.scan are merged back into the forward pass "
            "and barely lower the peak. Set XLA_FLAGS="
            f"{MEMORY_SCHEDULE_FLAG} before JAX starts, or compile the step as "
            "jax.jit(step).lower(*args).compile(compiler_options="
            f"{MEMORY_SCHEDULE_OPTIONS!r}).")
