"""An offload plan fitted to its own measured device peak, where it can be measured.

XLA's CPU memory analysis counts ``pinned_host`` buffers as device ones, so there an
offload plan's device peak is priced, never measured (``docs/design.md``, Offload in
scan layouts). A GPU's and a TPU's analysis keep them apart, and there the price
misses: on a TPU v5e the bf16 Llama of ``bench/offload_step.py --accelerator``
measured 4% to 9% under it (658.51 MiB against 708.36 at the smallest offload
budget), budget the plan left unused; on an H200 a 64-layer Llama's smallest
offload plan measured 0.7% over it (139.93 MiB against 138.93), over its budget.

So where the device peak can be measured (``client.step.host_buffers_apart``), the
answer's step is compiled and the budget solved once more, shifted by what the price
missed, as ``client.peak.refine`` shifts plans without offload; the answer is the plan
adding the fewest estimated seconds (``OffloadReport``) of those measured within the
budget, with its measured peak. On the TPU's stack at 740.36 MiB the answer keeps 64
MiB on host (658.51 MiB measured, 35.3 ms a step) and the shift solves at 790.21 MiB
for a plan keeping 4.78 MiB (737.54 MiB measured: within the budget, and no more
estimated seconds, the answer being feasible there too). Each round is one solve and
one compile, and two rounds, not more: every compile of an offload plan is one more
chance of XLA's TPU compiler aborting the process on it (jax 0.10.2: "Sublane slicing
size not multiple of update chunk sublane size", on the plan the solver answers at
791.18 MiB on that stack, fitted or not), so none is compiled that the fit does not
need.
"""

from __future__ import annotations

from collections.abc import Callable

from optiremat.solver.solution import InfeasibleBudgetError, Solution

# The answer, then the plan at the budget shifted by what its price missed (within the
# budget on the TPU's stack at each budget tried; see above why no third).
MAX_ROUNDS = 2


def fitted_offload(budget: int, solve_at: Callable[[int], Solution],
                   measured: Callable[[Solution], int]) -> Solution:
    """The offload plan for ``budget`` adding the fewest estimated seconds among those
    ``measured`` (the step's device peak, compiled) within it, with that peak; solved at
    ``budget`` and then at ``budget`` shifted by what each measured plan's price missed.
    Raises ``InfeasibleBudgetError`` naming the smallest peak measured where none fits."""
    answer = solve_at(budget)
    fitting: list[tuple[tuple[float, int], Solution]] = []
    peaks: list[int] = []
    seen: set[tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...] | None]] = set()
    for _ in range(MAX_ROUNDS):
        plan = (tuple(answer.saved_keys), tuple(answer.offloaded_keys),
                None if answer.groups is None else tuple(answer.groups))
        if plan in seen:
            break
        seen.add(plan)
        assert answer.peak_bytes is not None
        peak = measured(answer)
        peaks.append(peak)
        if peak <= budget:
            fitting.append((_added(answer), answer.model_copy(
                update={"budget_bytes": budget, "peak_bytes": peak})))
        missed = peak - answer.peak_bytes
        if missed == 0:
            break
        try:
            answer = solve_at(budget - missed)
        except InfeasibleBudgetError:
            break
    if not fitting:
        raise InfeasibleBudgetError(
            budget, min(peaks), "the offload plans solved for it measured over it on this "
            "device (XLA's memory analysis of their steps)")
    return min(fitting, key=lambda pair: pair[0])[1]


def _added(plan: Solution) -> tuple[float, int]:
    """What the solver minimised: estimated seconds, then host bytes."""
    if plan.offload is None:  # solved without an offload report: its recompute alone
        return float(plan.recompute_flops), 0
    return plan.offload.estimated_seconds, plan.offload.host_bytes
