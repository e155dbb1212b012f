"""What ``plan.verify()`` returns: a plan's prediction next to what JAX and XLA measure."""

from __future__ import annotations

from dataclasses import dataclass

from optiremat.client.measure import Residual
from optiremat.client.schedule import schedule_advice
from optiremat.solver.units import format_bytes

# A measured peak this far from the prediction, either way, is warned about: above it, XLA
# did not follow the plan; below it, the plan recomputes more than its budget needs.
PEAK_TOLERANCE = 0.10


@dataclass(frozen=True)
class Verification:
    """A plan's prediction next to what JAX (``saved_residuals``) and XLA measure."""

    predicted_bytes: int  # residuals on the device
    measured_bytes: int
    budget_bytes: int
    residuals: list[Residual]
    predicted_recompute_flops: int | None = None
    measured_recompute_flops: int | None = None
    predicted_host_bytes: int = 0  # offloaded to host memory
    measured_host_bytes: int = 0
    # verify(..., peak=True): the compiled step's peak (argument + output + temp - alias).
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None

    @property
    def exact(self) -> bool:
        """Residuals (and FLOPs, host bytes) exactly as predicted."""
        flops_ok = (self.measured_recompute_flops is None
                    or self.measured_recompute_flops == self.predicted_recompute_flops)
        host_ok = self.predicted_host_bytes == self.measured_host_bytes
        return self.predicted_bytes == self.measured_bytes and flops_ok and host_ok

    @property
    def peak_error(self) -> float | None:
        """(predicted - measured) / measured peak; positive when the plan was cautious."""
        if self.predicted_peak_bytes is None or not self.measured_peak_bytes:
            return None
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes

    @property
    def within_budget(self) -> bool:
        """The measured peak (or, without ``peak=True``, the residuals) fits the budget."""
        if self.measured_peak_bytes is not None and self.predicted_peak_bytes is not None:
            return self.measured_peak_bytes <= self.budget_bytes
        return self.measured_bytes <= self.budget_bytes

    @property
    def warning(self) -> str:
        """Empty, or what to do when XLA's peak and the prediction differ by more than
        ``PEAK_TOLERANCE`` either way."""
        error = self.peak_error
        if error is None or abs(error) <= PEAK_TOLERANCE:
            return ""
        measured, predicted = self.measured_peak_bytes or 0, self.predicted_peak_bytes or 0
        if error < 0:
            return (f"XLA's schedule holds {format_bytes(measured)}, {-error:.0%} more than the "
                    f"predicted {format_bytes(predicted)}: it does not follow the plan's "
                    "regions. " + schedule_advice())
        return (f"XLA's schedule holds {format_bytes(measured)}, {error:.0%} less than the "
                f"predicted {format_bytes(predicted)}: the plan recomputes more than its budget "
                "needs. A plan made for other arguments than these (other shapes, or other "
                "shardings: on a mesh a plan prices what one device holds) is cautious too.")
