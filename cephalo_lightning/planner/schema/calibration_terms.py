"""A calibration's terms: the cost-model terms fitted on a run's measured steps (a value type).

What each term means and how the cost model folds them in is
:mod:`cephalo_lightning.planner.cost.calibration`; a cluster file's ``calibration:`` block is read by
:mod:`cephalo_lightning.planner.schema.cluster` and fitted by :func:`cephalo_lightning.planner.cost.calibration_fit.fit_calibration`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cephalo_lightning._common.vocabulary import ProfileSource, Schedule, hold_member
from cephalo_lightning.planner.schema.planning_error import PlanningError

# the fitted terms, each one number (the per-rank compute_scale and the measured host_contention aside)
CALIBRATION_TERMS = ("step_overhead_ms", "micro_batch_overhead_ms", "allgather_ms", "reduce_scatter_ms", "overlap")


@dataclass(frozen=True)
class Calibration:
    """Terms fitted on measured steps (times in ms; compute_scale per rank, 1 = as profiled)."""

    step_overhead_ms: float
    micro_batch_overhead_ms: float
    allgather_ms: float  # one layer, even shares, as run
    reduce_scatter_ms: float
    overlap: float
    compute_scale: tuple[float, ...]
    host_contention: float = 1.0  # wall per busy second while computing: ranks waiting for a shared host's cores
    steps: int = 0  # measured steps the fit used
    fitted_on: str = ""  # the plan(s) measured, e.g. "B=32 layered b=[20, 12]"
    source: ProfileSource = ProfileSource.MEASURED
    mode: Schedule | None = None  # the measured steps' mode (None: steps of both modes)
    shard_groups: tuple[int, ...] | None = None  # and their grouping, every rank's group (None: every grouping)

    def __post_init__(self) -> None:
        hold_member(self, "source", ProfileSource, PlanningError, "write one of those")
        if self.mode is not None:
            hold_member(self, "mode", Schedule, PlanningError, "write one of those, or leave it out")

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {k: getattr(self, k) for k in CALIBRATION_TERMS}
        data["compute_scale"] = list(self.compute_scale)
        data["host_contention"] = self.host_contention
        data.update(steps=self.steps, fitted_on=self.fitted_on, source=self.source.value)
        if self.mode is not None:
            data["mode"] = self.mode.value
        if self.shard_groups is not None:
            data["shard_groups"] = list(self.shard_groups)
        return data

    def prices_collectives_of(self, shard_groups: Sequence[int] | None = None) -> bool:
        """Whether the fitted collective terms price plans under ``shard_groups`` (every rank's group;
        None for either: the calibration's own)."""
        return self.shard_groups is None or shard_groups is None or same_grouping(shard_groups, self.shard_groups)


def same_grouping(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether two lists of every rank's group put the same ranks together (whatever the numbers)."""
    if len(a) != len(b):
        return False
    pairs = dict(zip(a, b))
    return len(pairs) == len(set(pairs.values())) and all(pairs[x] == y for x, y in zip(a, b))
