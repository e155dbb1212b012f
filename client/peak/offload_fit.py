"""An offload plan fitted to its own measured device peak, where it can be measured.

XLA's CPU memory analysis counts ``pinned_host`` buffers as device ones, so there an
offload plan's device peak is priced, never measured (``docs/design.md``, Offload in
scan layouts). A GPU's and a TPU's analysis keep them apart, and there the price
misses: on a TPU v5e the bf16 Llama of ``bench/offload_step.py --accelerator``
measured 4% to 9% under it (658.51 MiB against 708.36 at the smallest offload
budget), budget the plan left unused; on an H200 a 64-layer Llama's smallest
offload plan measured 0.7% over it (139.93 MiB against 138.93), over its budget.

So where the device peak can be measured (``client.step.host_buffers_apart``), the
answer's step is compiled (the program ``plan.apply(fun)`` lowers to: the one the
user compiles next, and ``verify(peak=True)`` reads it without compiling again) and
the plan answered with its measured peak, exact as refined plans are. Where that is
over the budget, the budget is solved once more, less what the price missed (as
``client.peak.refine`` shifts plans without offload), and that plan measured too.
Where it is under, the room is left unused.
Taking it would compile heavier plans the user never asked for, and XLA's TPU
compiler can abort the process on an offload plan: on the accelerator stack (jax
0.10.2) the answer at 740.36 MiB compiles (658.51 MiB measured, 64 MiB on host), so
does the plan a shift by that room solves for at 790.21 MiB (737.54 MiB, 4.78 MiB on
host), but the solver's answer at 791.18 MiB aborts it ("Sublane slicing size not
multiple of update chunk sublane size"). Planning must not take down a process whose
answer compiles.
"""

from __future__ import annotations

from collections.abc import Callable

from optiremat.solver.solution import InfeasibleBudgetError, Solution


def fitted_offload(budget: int, solve_at: Callable[[int], Solution],
                   measured: Callable[[Solution], int]) -> Solution:
    """The offload plan solved for ``budget``, with the device peak ``measured`` for it
    (its step compiled); where that is over ``budget``, the plan solved at ``budget``
    less what the price missed, measured. Raises ``InfeasibleBudgetError`` naming the
    smallest peak measured where neither fits."""
    answer = solve_at(budget)
    peaks = []
    for _ in range(2):
        assert answer.peak_bytes is not None
        peak = measured(answer)
        if peak <= budget:
            return answer.model_copy(update={"budget_bytes": budget, "peak_bytes": peak})
        peaks.append(peak)
        try:
            answer = solve_at(budget - (peak - answer.peak_bytes))
        except InfeasibleBudgetError:
            break
    raise InfeasibleBudgetError(
        budget, min(peaks), "the offload plans solved for it measured over it on this "
        "device (XLA's memory analysis of their steps)")
