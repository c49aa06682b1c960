"""One device kind's per-layer curves: a measured (or estimated) series f(1..k) as f(m) for any m >= 0.

Profiles are piecewise linear between measured sizes; beyond the last measured size each series is
extrapolated on its own, linearly through its last two points (one point: proportionally,
f(m) = m f(1)). Series are made non-decreasing (a running maximum): a larger micro-batch never
costs less time or memory, which keeps noisy profiles from producing absurd plans::

    f(m) = p_m                      for 1 <= m <= k   (p: the running maximum of the series)
    f(m) = p_k + slope (m - k)      for m > k         (slope = p_k - p_(k-1); one point: p_1)
    f(0) = 0                        for times
    f(0) = max(0, min(p_1, 2 p_1 - p_2))   for memory (``intercept_at_zero``: the gathered layer,
                                           the workspace; one point: p_1)

Used for every device's forward, backward, compute-memory and activation-memory series
(:class:`cephalo_lightning.planner.cost.device_cost.DeviceCost`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _monotone(series: Sequence[float]) -> np.ndarray:
    return np.maximum.accumulate(np.asarray(series, dtype=float))


class PiecewiseLinear:
    """f(m) for integer m >= 0 from measured f(1..k): linear between points, linear beyond."""

    def __init__(self, measured: Sequence[float], *, intercept_at_zero: bool = False) -> None:
        self.points = _monotone(measured)
        k = len(self.points)
        self.slope = float(self.points[-1] - self.points[-2]) if k >= 2 else float(self.points[0])
        if not intercept_at_zero:
            self.zero = 0.0
        elif k >= 2:  # memory at m=0: the intercept (gathered layer, workspace), never negative
            self.zero = float(max(0.0, min(self.points[0], 2 * self.points[0] - self.points[1])))
        else:
            self.zero = float(self.points[0])

    def __call__(self, m: int | np.ndarray) -> np.ndarray:
        m_arr = np.asarray(m, dtype=np.int64)
        k = len(self.points)
        inside = np.clip(m_arr, 1, k)
        values = self.points[inside - 1] + self.slope * np.maximum(m_arr - k, 0)
        values = np.where(m_arr <= 0, self.zero, values)
        return values if values.ndim else float(values)

    def largest_within(self, limit: float, top: int) -> int:
        """The largest m in 0..top with f(m) <= limit (-1 when even f(0) is above it)."""
        if float(self(0)) > limit:
            return -1
        k = len(self.points)
        inside = int(np.searchsorted(self.points, limit, side="right"))  # f(1..inside) <= limit
        if inside < k or self.slope <= 0:
            return min(top, inside) if inside < k else top
        m = min(top, k + int(np.floor((limit - self.points[-1]) / self.slope)) + 1)
        while m > 0 and float(self(m)) > limit:  # floating-point overshoot of the division
            m -= 1
        return m

