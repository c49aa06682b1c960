"""Per-device option tables for the solver: at a step-time budget, what can a device take?

For a per-layer time budget ``t`` (ms) and collective times ``ag``/``rs``, a device running ``b``
samples in ``n`` near-equal micro-batches meets the budget iff (cost model, per layer)::

    max(ag, f) + max(ag + rs, tot) <= t,   f = n * F(b / n),   tot = n * (F + B)(b / n) + (n - 1) c

where F, B are the profiles interpolated linearly between integer sizes (the sum over near-equal
micro-batches is exactly n times that interpolation at b / n). Given ``t >= 2 ag + rs`` this is
three monotone conditions on x = b / n, so the largest b for every n is found by inverting
piecewise-linear functions, vectorised over n.

An *option* of a device is (b, m, r): it can take b samples with micro-batches of at most m while
storing a state share up to r (its memory cap at micro-batch m). Only Pareto-optimal options are
kept (more samples always means a smaller share).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cephalo_lightning.planner.cluster import Cluster, DeviceProfile
from cephalo_lightning.planner.cost import DeviceCost

_EPS = 1e-9  # relative slack on time comparisons against floating-point noise


@dataclass(frozen=True)
class Options:
    """Pareto-optimal choices of one device: b strictly increasing, r strictly decreasing."""

    b: np.ndarray  # samples (capped at the global batch)
    m: np.ndarray  # largest micro-batch size (0 for the empty option)
    r: np.ndarray  # largest state share that fits beside compute at m

    @property
    def max_b(self) -> int:
        return int(self.b[-1]) if len(self.b) else 0

    @property
    def max_r(self) -> float:
        return float(self.r[0]) if len(self.r) else -np.inf

    def __len__(self) -> int:
        return len(self.b)


EMPTY = Options(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))


class _Inverse:
    """Largest real x >= 1 with G(x) <= y, for a non-decreasing piecewise-linear G on [1, inf)."""

    def __init__(self, values: np.ndarray, slope: float) -> None:
        self.values = values  # G(1), G(2), ..., G(k)
        self.slope = slope  # beyond k

    def __call__(self, y: np.ndarray) -> np.ndarray:
        v, k = self.values, len(self.values)
        idx = np.searchsorted(v, y, side="right") - 1
        inner = np.clip(idx, 0, max(k - 2, 0))
        with np.errstate(divide="ignore", invalid="ignore"):
            if k >= 2:
                step = v[inner + 1] - v[inner]
                x_in = inner + 1 + (y - v[inner]) / np.where(step > 0, step, 1.0)
            else:
                x_in = np.ones_like(y)
            x_out = k + ((y - v[-1]) / self.slope if self.slope > 0 else np.inf)
        x = np.where(idx >= k - 1, x_out, x_in)
        return np.where(idx < 0, 0.0, x)


class DeviceModel:
    """One device kind's cost functions, vectorised for the solver."""

    def __init__(self, device: DeviceProfile, cluster: Cluster, global_batch: int) -> None:
        self.device = device
        self.cost = DeviceCost(device, cluster)
        self.B = global_batch
        self.c = self.cost.overhead_ms
        f, bw = self.cost.fwd, self.cost.bwd
        k = max(len(device.layer_fwd_ms), len(device.layer_bwd_ms))
        xs = np.arange(1, k + 1)
        fv, bv = f(xs), bw(xs)
        self._inv_f = _Inverse(fv, f.slope)
        self._inv_fb = _Inverse(fv + bv, f.slope + bw.slope)
        self._inv_ffb = _Inverse(2 * fv + bv, 2 * f.slope + bw.slope)
        self.g3_one = float(2 * fv[0] + bv[0])
        # memory: share caps r_max(m) for m = 0..m_cap, the largest micro-batch that fits at share 0
        ms = np.arange(0, global_batch + 1)
        caps = (self.cost.budget_gb - self.cost.compute_memory(ms)) / self.cost.state_gb
        # caps is non-increasing (compute memory is), so the fitting sizes are a prefix 0..m_cap
        self.m_cap = int(np.count_nonzero(caps >= 0)) - 1
        self.share_cap = caps  # indexed by m

    # ------------------------------------------------------------------ exact times

    def sums(self, b: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer sum of forwards and of forward+backward+overheads (b >= n >= 1)."""
        q, rem = np.divmod(b, n)
        f, bw = self.cost.fwd, self.cost.bwd
        f_q, f_q1 = f(q), f(q + 1)
        fb_q, fb_q1 = f_q + bw(q), f_q1 + bw(q + 1)
        fwd = (n - rem) * f_q + rem * f_q1
        tot = (n - rem) * fb_q + rem * fb_q1 + (n - 1) * self.c
        return fwd, tot

    def layer_ms(self, b: np.ndarray, n: np.ndarray, ag: float, rs: float) -> np.ndarray:
        """Per-layer step time of b samples in n micro-batches (b = 0: collectives only)."""
        b = np.asarray(b, dtype=np.int64)
        n = np.maximum(np.asarray(n, dtype=np.int64), 1)
        fwd, tot = self.sums(np.maximum(b, n), n)
        t = np.maximum(ag, fwd) + np.maximum(ag + rs, tot)
        return np.where(b == 0, 2 * ag + rs, t)

    # ------------------------------------------------------------------ largest batch per n

    def max_batch(self, t: float, ag: float, rs: float, n: np.ndarray) -> np.ndarray:
        """Largest b (<= B) that n micro-batches finish within t; values < n mean n is infeasible."""
        n = np.asarray(n, dtype=np.int64)
        nf = n.astype(float)
        over = (nf - 1) * self.c
        x = np.minimum(
            np.minimum(self._inv_f((t - ag - rs) / nf), self._inv_fb((t - ag - over) / nf)),
            self._inv_ffb((t - over) / nf),
        )
        with np.errstate(invalid="ignore", over="ignore"):
            b = np.where(np.isfinite(x), np.floor(np.minimum(nf * x, self.B) * (1 + 1e-12)), self.B)
        b = b.astype(np.int64)
        limit = t * (1 + _EPS)
        for _ in range(3):  # repair floating-point overshoot against the exact formula
            bad = (b >= n) & (self.layer_ms(b, n, ag, rs) > limit)
            if not bad.any():
                break
            b = np.where(bad, b - 1, b)
        return np.where(b >= n, b, 0)

    def max_micro_batches(self, t: float) -> int:
        """No more micro-batches than fit t even at size 1: n (2F+B)(1) + (n-1) c <= t."""
        return int(min(self.B, max(0.0, (t + self.c) / (self.g3_one + self.c)) * (1 + 1e-12)))

    # ------------------------------------------------------------------ options

    def options(self, t: float, ag: float, rs: float, cap: float, n_fixed: int | None = None) -> Options:
        """Pareto options at per-layer budget t; ``n_fixed`` for the uniform mode (no empty option)."""
        if t < (2 * ag + rs) * (1 - _EPS) or self.m_cap < 0:
            return EMPTY
        if n_fixed is None:
            n = np.arange(1, self.max_micro_batches(t) + 1, dtype=np.int64)
        else:
            n = np.array([n_fixed], dtype=np.int64)
        bmax = self.max_batch(t, ag, rs, n) if len(n) else np.zeros(0, np.int64)
        valid = bmax >= n
        n, bmax = n[valid], bmax[valid]
        b_m = self._best_per_m(n, bmax)
        return self._pareto(b_m, cap, with_empty=n_fixed is None)

    def _best_per_m(self, n: np.ndarray, bmax: np.ndarray) -> np.ndarray:
        """b_max(m) = max over n of min(n m, bmax_n), for m = 0..M (M <= m_cap)."""
        if len(n) == 0 or self.m_cap < 1:
            return np.zeros(1, np.int64)
        k = -(-bmax // n)  # micro-batch size when n micro-batches carry bmax_n
        top = int(min(self.m_cap, k.max()))
        bucket = np.minimum(k, top + 1)
        # n with k_n <= m contribute bmax_n; n with k_n > m contribute n * m
        full = np.zeros(top + 2, np.int64)
        np.maximum.at(full, bucket, bmax)
        full = np.maximum.accumulate(full)
        wide = np.zeros(top + 3, np.int64)
        np.maximum.at(wide, bucket, n)
        wide = np.maximum.accumulate(wide[::-1])[::-1]  # wide[j] = max n with k_n >= j
        m = np.arange(0, top + 1)
        out = np.maximum(full[: top + 1], m * wide[1: top + 2])
        out[0] = 0
        return np.minimum(out, self.B)

    def _pareto(self, b_m: np.ndarray, cap: float, with_empty: bool) -> Options:
        m = np.arange(len(b_m))
        r = np.minimum(self.share_cap[: len(b_m)], min(cap, 1.0))
        keep = np.ones(len(b_m), bool)
        keep[1:] = b_m[1:] > np.maximum.accumulate(b_m)[:-1]  # strictly more samples than any smaller m
        if not with_empty:
            keep[0] = False
        elif self.share_cap[0] < 0:
            keep[0] = False
        b_k, m_k, r_k = b_m[keep], m[keep], r[keep]
        if len(b_k) == 0:
            return EMPTY
        # r is non-increasing along m: of a run of equal r keep the last (largest b)
        last = np.ones(len(r_k), bool)
        last[:-1] = r_k[1:] < r_k[:-1]
        return Options(b_k[last].astype(np.int64), m_k[last].astype(np.int64), r_k[last].astype(float))

    # ------------------------------------------------------------------ plan assembly helpers

    def best_split(self, b: int, m: int, ag: float, rs: float, n_fixed: int | None = None) -> int:
        """The fastest micro-batch count for b samples with micro-batches of at most m (fewest on ties)."""
        if b == 0:
            return 1
        if n_fixed is not None:
            return n_fixed
        return self._fastest(b, np.arange(-(-b // m), b + 1, dtype=np.int64), ag, rs)

    def split_for_share(self, b: int, share: float, ag: float, rs: float) -> int:
        """The fastest micro-batch count whose micro-batches fit beside ``share`` (fewest on ties)."""
        if b == 0:
            return 1
        n = np.arange(1, b + 1, dtype=np.int64)
        n = n[self.share_cap[-(-b // n)] >= share - 1e-12]
        return self._fastest(b, n, ag, rs)

    def fewest_within(self, b: int, share: float, ag: float, rs: float, budget_ms: float) -> int | None:
        """The fewest micro-batches that fit beside ``share`` and finish within the step budget.

        A rank that is not the bottleneck gains nothing from being faster; fewer, larger
        micro-batches cost less per-micro-batch overhead than the model may know (on CPU it
        measures none), so among equally good plans this one runs fastest.
        """
        if b == 0:
            return 1
        n = np.arange(1, b + 1, dtype=np.int64)
        n = n[self.share_cap[-(-b // n)] >= share - 1e-12]
        ok = n[self.layer_ms(np.full(len(n), b), n, ag, rs) <= budget_ms * (1 + 1e-9)]
        return int(ok[0]) if len(ok) else None

    def _fastest(self, b: int, n: np.ndarray, ag: float, rs: float) -> int:
        times = self.layer_ms(np.full(len(n), b), n, ag, rs)
        return int(n[np.nonzero(times <= times.min() * (1 + 1e-12))[0][0]])


def device_kinds(cluster: Cluster, global_batch: int) -> tuple[list[DeviceModel], list[int]]:
    """One DeviceModel per distinct device profile, and each rank's kind index."""
    kinds: list[DeviceModel] = []
    index: dict[DeviceProfile, int] = {}
    of_rank: list[int] = []
    for device in cluster.devices:
        key = device
        if key not in index:
            index[key] = len(kinds)
            kinds.append(DeviceModel(device, cluster, global_batch))
        of_rank.append(index[key])
    return kinds, of_rank
