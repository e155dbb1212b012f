"""XLA's CPU schedule of checkpoints in straight-line code (stand-in until the probe lands)."""

from __future__ import annotations

import jax

MEMORY_SCHEDULE_OPTIONS: dict[str, str] = {"xla_disable_hlo_passes": "cse_barrier_expander"}


class ScheduleWarning(UserWarning):
    """This process compiles checkpoints in straight-line code so that they do not lower
    the peak; the warning names the setting that fixes it."""


def barriers_kept() -> bool:
    if jax.default_backend() != "cpu":
        return True
    return tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)


def memory_compile_options() -> dict[str, str]:
    return {} if barriers_kept() else dict(MEMORY_SCHEDULE_OPTIONS)


def schedule_advice() -> str:
    return ("set XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander before JAX starts, "
            "or compile the step with jax.jit(step).lower(...).compile("
            "{'xla_disable_hlo_passes': 'cse_barrier_expander'})")
