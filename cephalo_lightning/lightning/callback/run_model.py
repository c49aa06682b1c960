"""The callback's model of the run: calibration after warm-up and drift judged by episode.

:class:`CephaloCallback` watches every N steps (a window: the median step and every rank's median
busy time, gathered on every rank). After warm-up it fits the cost model's run-time terms to those
windows once (:func:`~cephalo_lightning.planner.cost.calibration_fit.fit_calibration`), logs the predicted step
before and after against the measured one, and offers the calibrated optimum when it beats the
current plan by more than a threshold. From then on drift is judged against the calibrated
prediction of each rank (before it, against the median rank, as the profile's absolute figures are
biased), and it is reported once per episode: when the set of drifting ranks changes, not every window.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cephalo_lightning.planner import Cluster, Plan
from cephalo_lightning.planner.cost.calibration import describe, with_calibration
from cephalo_lightning.planner.cost.calibration_fit import StepObservation, fit_calibration, plan_label, predicted


def observations(plan: Plan, windows: Sequence[Mapping[str, Any]]) -> list[StepObservation]:
    """The watch windows as the fit's observations (every rank's median busy time, the median step)."""
    def walls(w: Mapping[str, Any]) -> tuple[float, ...] | None:
        values = [r.get("measured_busy_wall_s") for r in w["ranks"]]
        return None if None in values else tuple(values)  # type: ignore[arg-type]

    def collectives(w: Mapping[str, Any]) -> float | None:
        values = [r.get("measured_collective_s") for r in w["ranks"]]
        return None if None in values or len(values) < 2 else min(values)  # type: ignore[type-var]

    return [StepObservation(plan, w["step_s"], tuple(r["measured_busy_s"] for r in w["ranks"]), walls(w),
                            collectives(w)) for w in windows]


@dataclass(frozen=True)
class CalibrationResult:
    """What one calibration found: the calibrated cluster and the figures it is logged with."""

    cluster: Cluster
    measured_step_s: float
    predicted_before_s: float
    predicted_after_s: float
    steps: int

    def message(self) -> str:
        cal = self.cluster.calibration
        terms = describe(cal) if cal is not None else ""
        return (f"Cephalo: calibrated on {self.steps} measured windows: measured step {self.measured_step_s:.4f} s, "
                f"predicted {self.predicted_before_s:.4f} s from the profile (measured / predicted "
                f"{self.measured_step_s / self.predicted_before_s:.2f}), {self.predicted_after_s:.4f} s calibrated "
                f"({self.measured_step_s / self.predicted_after_s:.2f}); {terms}")

    def metrics(self) -> dict[str, float]:
        return {"cephalo/calibration/measured_step_s": self.measured_step_s,
                "cephalo/calibration/predicted_before_s": self.predicted_before_s,
                "cephalo/calibration/predicted_after_s": self.predicted_after_s}


def calibrate(cluster: Cluster, plan: Plan, windows: Sequence[Mapping[str, Any]]) -> CalibrationResult:
    """Fit ``cluster`` (its profile; any earlier calibration is replaced) to ``plan``'s measured windows."""
    profile = with_calibration(cluster, None)
    fitted = fit_calibration(profile, observations(plan, windows), fitted_on=plan_label(plan))
    calibrated = with_calibration(profile, fitted)
    return CalibrationResult(calibrated, statistics.median(w["step_s"] for w in windows),
                             predicted(profile, plan)[0], predicted(calibrated, plan)[0], len(windows))


def gain(current_step_s: float, candidate_step_s: float) -> float:
    """How much faster a candidate is predicted to be (0.1: the current step is 10% longer)."""
    return current_step_s / candidate_step_s - 1.0 if candidate_step_s > 0 else 0.0


def drifting_ranks(ratios: Sequence[float | None], threshold: float, calibrated: bool) -> tuple[list[int], float | None]:
    """Ranks whose measured/predicted busy ratio departs by more than ``threshold`` from the reference:
    1 once calibrated (the prediction is of this run), else the median rank's ratio. Returns the
    ranks and the reference."""
    known = [r for r in ratios if r]
    if not known:
        return [], None
    reference = 1.0 if calibrated else statistics.median(known)
    limit = math.log(1 + threshold)
    return [i for i, r in enumerate(ratios) if r and abs(math.log(r / reference)) > limit], reference


class DriftEpisodes:
    """The drifting ranks' state between windows: a report when it changes, silence while it holds."""

    def __init__(self) -> None:
        self.drifting: tuple[int, ...] = ()

    def update(self, drifting: Sequence[int]) -> str | None:
        """"start" (drift began or moved to other ranks), "end" (no rank drifts any more) or None."""
        now = tuple(drifting)
        if now == self.drifting:
            return None
        self.drifting = now
        return "start" if now else "end"
