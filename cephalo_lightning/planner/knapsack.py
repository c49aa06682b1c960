"""Multiple-choice knapsack: can the devices take B samples and store the whole state?

Every device picks one option (b, r); the assignment is feasible iff some choice has
sum b >= B and sum r >= 1 (surplus samples are trimmed afterwards, which only makes ranks faster
and micro-batches smaller). The dynamic program keeps, over devices, the upward-closed table

    dp[j] = max total share of a choice whose samples sum to at least j    (j capped at B)
    new[j] = max over options (b, r) of dp[max(0, j - b)] + r

Only states that can still reach B and that the processed devices can reach are computed: after
device i the window is [B - (max samples of the rest), min(B, max samples so far)], whose width is
the total surplus capacity, far below B near the optimal step time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cephalo_lightning.planner.options import Options

_NEG = -np.inf
SHARE_TOL = 1e-12  # as cost.water_fill: a feasible choice must water-fill


def _windows(options: Sequence[Options], B: int) -> list[tuple[int, int]]:
    max_b = np.array([o.max_b for o in options], dtype=np.int64)
    done = np.cumsum(max_b)
    rest = done[-1] - done
    return [(int(max(0, B - r)), int(min(B, d))) for r, d in zip(rest, done)]


def _quick_infeasible(options: Sequence[Options], B: int) -> bool:
    if any(len(o) == 0 for o in options):
        return True
    if sum(o.max_b for o in options) < B:
        return True
    return sum(o.max_r for o in options) < 1.0 - SHARE_TOL


def feasible(options: Sequence[Options], B: int) -> bool:
    """Whether one option per device reaches B samples and a total share of 1."""
    if _quick_infeasible(options, B):
        return False
    dp = np.full(B + 1, _NEG)
    dp[0] = 0.0
    new = np.full(B + 1, _NEG)  # above its window a buffer must read -inf (unreachable)
    tmp = np.empty(B + 1)
    for opts, (lo, hi) in zip(options, _windows(options, B)):
        new[lo: hi + 1] = _NEG
        for b, r in zip(opts.b.tolist(), opts.r.tolist()):
            if b > lo:  # states below b come from dp[0]
                top = min(hi, b - 1)
                np.maximum(new[lo: top + 1], dp[0] + r, out=new[lo: top + 1])
            start = max(lo, b)
            if start <= hi:
                width = hi + 1 - start
                np.add(dp[start - b: hi + 1 - b], r, out=tmp[:width])
                np.maximum(new[start: hi + 1], tmp[:width], out=new[start: hi + 1])
        dp, new = new, dp
    return bool(dp[B] >= 1.0 - SHARE_TOL)


def choose(options: Sequence[Options], B: int) -> list[int] | None:
    """Each device's option index of a feasible choice, or None when there is none."""
    if _quick_infeasible(options, B):
        return None
    windows = _windows(options, B)
    dp = np.full(B + 1, _NEG)
    dp[0] = 0.0
    picks: list[np.ndarray] = []
    for opts, (lo, hi) in zip(options, windows):
        j = np.arange(lo, hi + 1)
        # candidates[o, j] = dp[max(0, j - b_o)] + r_o, outside the previous reach = -inf
        src = np.maximum(j[None, :] - opts.b[:, None], 0)
        cand = dp[src] + opts.r[:, None]
        best = np.argmax(cand, axis=0)
        new = np.full(B + 1, _NEG)
        new[lo: hi + 1] = cand[best, np.arange(len(j))]
        picks.append(best)
        dp = new
    if dp[B] < 1.0 - SHARE_TOL:
        return None
    chosen = [0] * len(options)
    j = B
    for i in range(len(options) - 1, -1, -1):
        lo, _ = windows[i]
        o = int(picks[i][j - lo])
        chosen[i] = o
        j = max(0, j - int(options[i].b[o]))
    return chosen
