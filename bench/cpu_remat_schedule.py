"""Per-block checkpoints in straight-line code under XLA's two CPU schedules.

    .venv/bin/python bench/cpu_remat_schedule.py            # the unrolled corpus and twins
    .venv/bin/python bench/cpu_remat_schedule.py --quick    # four cheap models, a twin

For every model of the unrolled corpus (``tests/unrolled_models.py``) and the
scan twins it prints, in MiB, the peak of the compiled step (argument + output +
temp - alias, as ``client.step`` measures it) without remat and with each JAX
built-in wrapped around each block the way its library writes it, twice: as this
process compiles by default, and with ``client.schedule.MEMORY_SCHEDULE_OPTIONS``
(checkpoints keep their barriers, so their recomputation stays in the backward
pass). Where this process keeps the barriers already (jax 0.12.0.1) the two rows
agree but for the dots policies' peaks of unrolled models, which the option still
lowers by up to 2.25 MiB. ``s``: seconds to build and compile the model's eight steps. Every compile
is for its memory analysis only (``MEMORY_ONLY_OPTIONS``: the same figures to the
byte in half the time, with the schedule option too).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

from optiremat.client.schedule import (  # noqa: E402
    MEMORY_SCHEDULE_OPTIONS,
    barriers_kept,
    memory_compile_options,
)
from optiremat.client.step import MEMORY_ONLY_OPTIONS, measured_peak  # noqa: E402
from tests.unrolled_models import BUILTINS, CORPUS, MODELS, QUICK, Model  # noqa: E402

MiB = 2**20
SCHEDULES = {"default": {}, "memory": MEMORY_SCHEDULE_OPTIONS}
SHORT = {"nothing_saveable": "nothing", "dots_saveable": "dots",
         "dots_with_no_batch_dims_saveable": "dots_no_batch"}


def peaks(model: Model) -> dict[str, dict[str, int]]:
    """Peak bytes by schedule, then by remat (``none`` or a built-in's name)."""
    out: dict[str, dict[str, int]] = {schedule: {} for schedule in SCHEDULES}
    for remat, policy in {"none": None, **BUILTINS}.items():
        loss, args = model.build(policy)
        lowered = jax.jit(jax.grad(loss)).lower(*args)
        for schedule, options in SCHEDULES.items():
            compiled = lowered.compile(MEMORY_ONLY_OPTIONS | options)
            out[schedule][remat] = measured_peak(compiled)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="only the QUICK models")
    quick = parser.parse_args().quick
    names = QUICK if quick else [m.name for m in CORPUS]
    names += [twin for name in names if (twin := MODELS[name].scan)]
    print(f"jax {jax.__version__}, {jax.default_backend()}; this process keeps checkpoint "
          f"barriers: {barriers_kept()}; memory_compile_options() = {memory_compile_options()}")
    remats = ["none", *BUILTINS]
    print(f"\n{'model':<24} {'schedule':<8} {'no remat':>9} "
          + " ".join(f"{SHORT[r]:>13}" for r in BUILTINS) + f" {'best/none':>9} {'s':>5}")
    for name in names:
        started = time.perf_counter()
        measured = peaks(MODELS[name])
        seconds = time.perf_counter() - started
        for schedule, row in measured.items():
            best = min(row[r] for r in BUILTINS) / row["none"]
            print(f"{name:<24} {schedule:<8} "
                  + " ".join(f"{row[r] / MiB:>{9 if r == 'none' else 13}.2f}" for r in remats)
                  + f" {best:>9.2f} " + (f"{seconds:>5.1f}" if schedule == "memory" else ""),
                  flush=True)


if __name__ == "__main__":
    main()
