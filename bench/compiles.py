"""XLA compiles made while a block runs, timed, and what each was for: the benches that
time planning (``plan_time.py``, ``plan_time_since.py``, ``peak.py``) say where its time
goes. Only JAX is imported, so a child process may count an earlier revision's compiles.
"""

from __future__ import annotations

import time
import traceback

import jax

# What each compile planning makes is for: the innermost of these planner functions on
# its call stack.
PHASES = {"barriers_kept": "schedule probe", "working_bytes_in_step": "step working set",
          "traced_step_extraction": "extraction", "calibrate_phases": "calibration",
          "measured_split": "mixing", "measured_blocks": "mixing",
          "as_written_peak": "step as written", "measured": "refinement",
          # A compile started ahead (client.step.compile_ahead) runs on a worker thread,
          # beside the planner's own work: its seconds overlap the others'.
          "_worker": "compiled ahead"}


class CompileTimer:
    """Every XLA compile in a block, timed, with the functions on its call stack,
    innermost first (what the compile was for)."""

    def __enter__(self) -> CompileTimer:
        self.seconds: list[float] = []
        self.callers: list[list[str]] = []
        self._original = jax.stages.Lowered.compile
        timer = self

        def compile(lowered, *a, **k):
            timer.callers.append([f.name for f in reversed(traceback.extract_stack())])
            started = time.perf_counter()
            try:
                return timer._original(lowered, *a, **k)
            finally:
                timer.seconds.append(time.perf_counter() - started)

        jax.stages.Lowered.compile = compile  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc) -> None:
        jax.stages.Lowered.compile = self._original  # type: ignore[method-assign]

    def by_phase(self) -> dict[str, list[float]]:
        """Per phase (``PHASES``), its compiles and their seconds."""
        phases: dict[str, list[float]] = {}
        for callers, took in zip(self.callers, self.seconds, strict=True):
            phase = next((PHASES[name] for name in callers if name in PHASES), "other")
            counted = phases.setdefault(phase, [0, 0.0])
            counted[0] += 1
            counted[1] += took
        return phases
