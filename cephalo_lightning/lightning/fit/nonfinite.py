"""Skipping an optimizer step on every rank when any rank's loss or gradient was not finite.

The decision comes from the step's all-reduce (:mod:`.step_sync`), so every rank skips together;
``max_consecutive`` skips in a row stop training with :class:`NonFiniteLossError`.
"""

from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from cephalo_lightning._common.errors import CephaloError
from cephalo_lightning.lightning.steps.step_state import StepReport


class NonFiniteLossError(CephaloError, RuntimeError):
    """Training stopped: too many consecutive steps had a non-finite loss or gradient."""


class NonFiniteGuard:
    """Skips an optimizer step on every rank when any rank's loss or gradient was not finite (see
    the module docstring)."""

    def __init__(self, max_consecutive: int) -> None:
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.skipped = 0
        self._pending: set[int] = set()
        self._what = "loss"

    @property
    def enabled(self) -> bool:
        return self.max_consecutive > 0

    def record(self, report: StepReport) -> None:
        """A batch finished its backward (several per optimizer step under accumulation)."""
        if report.nonfinite:
            self._pending.update(report.nonfinite)
            self._what = report.what

    def should_skip(self, step: int) -> bool:
        """Before the optimizer step: skip it? Raises after too many skips in a row."""
        bad, self._pending = sorted(self._pending), set()
        if not self.enabled or not bad:
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.skipped += 1
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteLossError(
                f"Cephalo: {self.consecutive} optimizer steps in a row had a non-finite loss or gradient (last at step "
                f"{step}, on rank(s) {bad}); training stopped. The weights are as after the last finite step: resume "
                "from the last checkpoint with a lower learning rate, gradient clipping or cleaner data, or raise "
                "CephaloStrategy(max_nonfinite_skips=...)"
            )
        rank_zero_warn(
            f"Cephalo: step {step} had a non-finite {self._what} on rank(s) {bad}; the optimizer step was skipped "
            f"on every rank ({self.consecutive} in a row, stopping at {self.max_consecutive})"
        )
        return True
