"""Per-kind option tables for the solver: at a step-time budget, what can one device take?

An *option* of a device is (b, m, r, keep): it can take b samples in micro-batches of at most m
(one micro-batch keeping its autograd graph when ``keep``) while storing a state share up to r.
Only Pareto-optimal options are kept (more samples always means a smaller share).

Largest batch per micro-batch count. For a per-layer budget t, n near-equal micro-batches of real
size x = b / n meet it iff (cost model, :mod:`.cost`) ``comb(A1, f) + comb(A2, g) <= t`` with
f, g the forward and backward compute and ``comb(a, y) = max(a + w y, w a + y)``, w = 1 - overlap.
The sum is the largest of four linear forms ``cA1 A1 + cA2 A2 + cf f + cg g`` (each c in
{1, w}); f and g are n times piecewise-linear non-decreasing functions of x (the sum over
near-equal micro-batches is exactly n times the interpolated profile at b / n), so each form is
inverted in closed form and the largest b for every n comes from the smallest of four inverses,
vectorised over n and checked against the exact formula.

Share-dependent time. With an optimizer cost (kappa ms for the whole state) a share r also costs
kappa r of the step, so the share an option may hold is ``min(memory room, (S - L t) / kappa)``
at a step budget S. Small tables enumerate every (b, n) exactly; large ones are cut at K share
levels r_j, giving an *inner* table (options that are achievable) and an *outer* one (a
relaxation: every achievable option is dominated by one of it), so a solve from the inner table is
a valid plan and a bound from the outer one a valid lower bound. Without an optimizer cost both
are the same exact table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cephalo_lightning._common.vocabulary import Schedule, StrEnum
from cephalo_lightning.planner.cost.device_cost import DeviceCost
from cephalo_lightning.planner.cost.prices import FREE, Prices

_EPS = 1e-9  # relative slack on time comparisons against floating-point noise
PAIR_LIMIT = 200_000  # (b, n) pairs enumerated exactly with an optimizer cost; beyond, share levels
SHARE_LEVELS = 48
BUDGET_STEP = 1.25e-4  # relative step budget between share levels (a quarter of the solver's tolerance)


@dataclass(frozen=True)
class Options:
    """Pareto-optimal choices of one device: b strictly increasing, r strictly decreasing."""

    b: np.ndarray  # samples (capped at the global batch)
    m: np.ndarray  # largest micro-batch size (0 for the empty option)
    r: np.ndarray  # largest state share that fits (memory, and time with an optimizer cost)
    keep: np.ndarray  # one micro-batch that keeps its autograd graph (no recompute)

    @property
    def max_b(self) -> int:
        return int(self.b[-1]) if len(self.b) else 0

    @property
    def max_r(self) -> float:
        return float(self.r[0]) if len(self.r) else -np.inf

    def __len__(self) -> int:
        return len(self.b)


EMPTY = Options(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0, bool))


def pareto(b: np.ndarray, m: np.ndarray, r: np.ndarray, keep: np.ndarray) -> Options:
    """The Pareto front of candidate options (r >= 0 only); of equal ones, the first listed."""
    ok = r >= -1e-15
    b, m, r, keep = b[ok], m[ok], np.maximum(r[ok], 0.0), keep[ok]
    if len(b) == 0:
        return EMPTY
    order = np.lexsort((np.arange(len(b)), -r, -b))  # b descending, then r descending
    b, m, r, keep = b[order], m[order], r[order], keep[order]
    best_before = np.concatenate(([-np.inf], np.maximum.accumulate(r)[:-1]))
    front = r > best_before
    return Options(b[front][::-1].astype(np.int64), m[front][::-1].astype(np.int64),
                   r[front][::-1].astype(float), keep[front][::-1].astype(bool))


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


@dataclass(frozen=True)
class _Form:
    """One of the four linear forms: cA1 A1 + cA2 A2 + (cg (n - 1) c) + n H(x) <= t."""

    c_a1: float
    c_a2: float
    c_g: float
    inverse: _Inverse | None  # None: H is zero (only communication counts)


class Variant(StrEnum):
    """How a device runs its micro-batches' passes: recomputing the forward in the backward
    (layered), one micro-batch keeping its autograd graph, or the uniform schedule's (graph kept)."""

    RECOMPUTE = "recompute"
    KEEP = "keep"
    UNIFORM = "uniform"


class DeviceModel:
    """One device kind's cost functions, vectorised for the solver (one mode)."""

    def __init__(self, cost: DeviceCost, global_batch: int) -> None:
        self.cost = cost
        self.device = cost.device
        self.uniform = cost.mode == Schedule.UNIFORM
        self.B = global_batch
        self.c = cost.overhead_ms
        self.L = cost.num_layers
        self.kappa = cost.optimizer_ms_per_share
        f, bw = cost.fwd, cost.bwd
        k = max(len(f.points), len(bw.points))
        xs = np.arange(1, k + 1)
        fv, bv, x_copy = f(xs), bw(xs), cost.copy_ms_per_sample
        w = 1.0 - cost.overlap
        pairs = sorted({(1.0, w), (w, 1.0)})  # (coefficient of the communication, of the compute)
        self._forms: dict[Variant, list[_Form]] = {}
        for variant in Variant:
            forms = []
            for c_a1, c_f in pairs:
                for c_a2, c_g in pairs:
                    if variant == Variant.RECOMPUTE:  # f = F + X x, g = F + B + X x per micro-batch
                        values = (c_f + c_g) * (fv + x_copy * xs) + c_g * bv
                        slope = (c_f + c_g) * (f.slope + x_copy) + c_g * bw.slope
                    else:  # f = F, g = B
                        values, slope = c_f * fv + c_g * bv, c_f * f.slope + c_g * bw.slope
                    inverse = _Inverse(values, slope) if c_f + c_g > 0 else None
                    forms.append(_Form(c_a1, c_a2, c_g, inverse))
            self._forms[variant] = forms
        # per-layer compute of one micro-batch of one sample: a lower bound on any micro-batch's
        self.unit_ms = float(fv[0] + bv[0]) if self.uniform else float(2 * fv[0] + bv[0] + 2 * x_copy)
        # memory: share rooms for m = 0..m_cap (micro-batch sizes that fit with no state)
        self.m_cap = cost.compute_memory.largest_within(cost.budget_gb, global_batch)
        ms = np.arange(0, max(self.m_cap, 0) + 1)
        self.room = cost.room(ms)  # layered recompute, or uniform with one micro-batch
        self.room_many = cost.room(ms, n=2) if self.uniform else self.room  # uniform, n > 1
        self.room_keep = cost.room(ms, keep=True) if cost.can_keep else np.full(len(ms), -np.inf)
        self.keep_cap = int(np.count_nonzero(self.room_keep >= 0)) - 1 if cost.can_keep else 0
        # the share each sample's stash takes while it stays on the device (0: on the host, or uniform)
        self.kept = cost.kept_gb_per_sample / cost.share_gb if cost.share_gb > 0 else 0.0

    # ------------------------------------------------------------------ exact times

    def layer_ms(self, b: np.ndarray, n: np.ndarray, prices: Prices,
                 keep: np.ndarray | bool = False) -> np.ndarray:
        """Per-layer step time of b samples in n micro-batches (b = 0: collectives only)."""
        return self.cost.layer_ms(b, n, prices, keep)

    def idle_ms(self, prices: Prices, n: int = 1) -> float:
        """The per-layer time of the collectives alone (no samples; uniform: n gathers each way)."""
        return 2 * float(self.cost.gathers(n)) * prices.ag + prices.rs

    def room_for(self, m: np.ndarray, n: np.ndarray | int, keep: np.ndarray | bool = False,
                 b: np.ndarray | int | None = None) -> np.ndarray:
        """Share room at micro-batch size m (indices 0..m_cap); with the batch b, beside its stash."""
        m = np.asarray(m, dtype=np.int64)
        base = np.where(np.asarray(n) > 1, self.room_many[m], self.room[m])
        if b is not None and self.kept:
            base = base - np.asarray(b, dtype=float) * self.kept
        return np.where(keep, self.room_keep[m], base)

    # ------------------------------------------------------------------ largest batch per n

    def max_batch(self, t: float, prices: Prices, n: np.ndarray, variant: Variant = Variant.RECOMPUTE) -> np.ndarray:
        """Largest b (<= B) that n micro-batches finish within t; 0 where n is infeasible."""
        n = np.asarray(n, dtype=np.int64)
        nf = n.astype(float)
        a1, a2 = self.cost.collectives(n, prices)
        over = (nf - 1) * self.c
        x = np.full(len(n), np.inf)
        for form in self._forms[variant]:
            room = t - form.c_a1 * a1 - form.c_a2 * a2 - form.c_g * over
            if form.inverse is None:
                x = np.where(room >= -abs(t) * _EPS, x, 0.0)
            else:
                x = np.minimum(x, form.inverse(room / nf))
        with np.errstate(invalid="ignore", over="ignore"):
            b = np.where(np.isfinite(x), np.floor(np.minimum(nf * x, self.B) * (1 + 1e-12)), self.B)
        b = b.astype(np.int64)
        keep = variant == Variant.KEEP
        limit = t * (1 + _EPS)
        check = np.nonzero(b >= n)[0]
        for _ in range(3):  # repair floating-point overshoot against the exact formula
            bad = check[self.layer_ms(b[check], n[check], prices, keep) > limit]
            if not len(bad):
                break
            b[bad] -= 1
            check = bad[b[bad] >= n[bad]]
        return np.where(b >= n, b, 0)

    def max_micro_batches(self, t: float, prices: Prices = FREE) -> int:
        """No more micro-batches than fit t even at size 1."""
        unit = self.unit_ms
        n = (t + self.c) / (unit + self.c) if unit + self.c > 0 else float(self.B)
        repeat = self.cost.settings.repeated_gather_fraction
        if self.uniform and prices.ag > 0 and repeat > 0:  # 2 G(n) AG + RS <= t, G(n) = 1 + (n - 1) q
            n = min(n, 1 + ((t - prices.rs) / (2 * prices.ag) - 1) / repeat)
        return int(min(self.B, max(0.0, n) * (1 + 1e-12)))

    # ------------------------------------------------------------------ options

    def options(self, step_ms: float, prices: Prices, cap: float, n_fixed: int | None = None
                ) -> tuple[Options, Options]:
        """(inner, outer) Pareto options at a per-step budget; ``n_fixed`` for the uniform mode."""
        t = step_ms / self.L
        if t < self.idle_ms(prices, n_fixed or 1) * (1 - _EPS) or self.m_cap < 0:
            return EMPTY, EMPTY
        if self.kappa <= 0:
            exact = self._static(t, prices, cap, n_fixed)
            return exact, exact
        exact = self._enumerated(step_ms, prices, cap, n_fixed)
        if exact is not None:
            return exact, exact
        return self._levels(step_ms, prices, cap, n_fixed)

    def _counts(self, t: float, prices: Prices, n_fixed: int | None) -> tuple[np.ndarray, np.ndarray]:
        """Micro-batch counts that fit t, and the largest batch for each."""
        if n_fixed is None:
            n = np.arange(1, self.max_micro_batches(t, prices) + 1, dtype=np.int64)
        else:
            n = np.array([n_fixed], dtype=np.int64)
        variant = Variant.UNIFORM if self.uniform else Variant.RECOMPUTE
        bmax = self.max_batch(t, prices, n, variant) if len(n) else np.zeros(0, np.int64)
        valid = bmax >= n
        return n[valid], bmax[valid]

    def _keep_max(self, t: float, prices: Prices) -> int:
        """Largest one-micro-batch batch that keeps its graph within t and fits with no state."""
        if self.uniform or self.keep_cap < 1:
            return 0
        return int(min(self.keep_cap, self.max_batch(t, prices, np.array([1]), Variant.KEEP)[0]))

    def _static(self, t: float, prices: Prices, limit: float, n_fixed: int | None) -> Options:
        """Options at per-layer budget t, shares capped at ``limit``."""
        return self._table(self._per_m(t, prices, n_fixed), limit, n_fixed)

    def _per_m(self, t: float, prices: Prices, n_fixed: int | None) -> tuple[np.ndarray, int] | None:
        """Within budget t: the most samples per largest micro-batch m = 0..M, and the largest batch
        one micro-batch keeping its graph may take; None when even the collectives do not fit."""
        if t < self.idle_ms(prices, n_fixed or 1) * (1 - _EPS):
            return None
        n, bmax = self._counts(t, prices, n_fixed)
        return self._best_per_m(n, bmax), self._keep_max(t, prices)

    def _table(self, per_m: tuple[np.ndarray, int] | None, limit: float, n_fixed: int | None) -> Options:
        if per_m is None:
            return EMPTY
        b_m, top = per_m
        m = np.arange(len(b_m))
        r = np.minimum(self.room_for(m, n_fixed or 1), limit)
        take = np.ones(len(b_m), bool)
        if n_fixed is not None:  # uniform: every rank computes at least n samples
            take &= b_m >= n_fixed
        take[0] = n_fixed is None and self.room[0] >= 0
        if self.kept and n_fixed is None:
            # a stash on the device: every batch is its own option (fewer samples leave more room), each at
            # the smallest micro-batch size that takes it, m*(b) = min{m : b_m[m] >= b}
            bs = np.arange(0, int(b_m[take].max(initial=0)) + 1)
            ms = np.searchsorted(b_m, bs, side="left")  # b_m is non-decreasing in m
            ok = (ms < len(b_m)) & take[np.minimum(ms, len(b_m) - 1)]
            bs, ms = bs[ok], ms[ok]
            cand = [(bs, ms, np.minimum(self.room_for(ms, 1, b=bs), limit), np.zeros(len(bs), bool))]
        else:
            cand = [(b_m[take], m[take], r[take], np.zeros(int(take.sum()), bool))]
        if top >= 1:
            ks = np.arange(1, top + 1)
            cand.append((ks, ks, np.minimum(self.room_keep[ks], limit), np.ones(top, bool)))
        return pareto(*(np.concatenate(parts) for parts in zip(*cand)))

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

    def _enumerated(self, step_ms: float, prices: Prices, cap: float, n_fixed: int | None) -> Options | None:
        """Every (b, n) with its exact share limit under an optimizer cost; None when too many."""
        t = step_ms / self.L
        n, bmax = self._counts(t, prices, n_fixed)
        counts = bmax - n + 1
        keep_top = self._keep_max(t, prices)
        if int(counts.sum()) + keep_top > PAIR_LIMIT:
            return None
        starts = np.repeat(n, counts)
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        bb, nn = starts + offsets, np.repeat(n, counts)
        m = -(-bb // nn)
        fits = m <= self.m_cap
        bb, nn, m = bb[fits], nn[fits], m[fits]
        parts = [(bb, nn, m, np.zeros(len(bb), bool))]
        if keep_top >= 1:
            ks = np.arange(1, keep_top + 1)
            parts.append((ks, np.ones(keep_top, np.int64), ks, np.ones(keep_top, bool)))
        if n_fixed is None and self.room[0] >= 0:
            parts.append((np.zeros(1, np.int64), np.ones(1, np.int64), np.zeros(1, np.int64), np.zeros(1, bool)))
        bb, nn, m, keep = (np.concatenate(p) for p in zip(*parts))
        slack = (step_ms - self.L * self.layer_ms(bb, nn, prices, keep)) / self.kappa
        r = np.minimum(np.minimum(self.room_for(m, nn, keep, bb), cap), slack)
        return pareto(bb, m, r, keep)

    def _levels(self, step_ms: float, prices: Prices, cap: float, n_fixed: int | None
                ) -> tuple[Options, Options]:
        """Share levels 0 = r_0 < ... < r_K: inner options at each, outer ones from the next looser.

        K is as small as keeps the budget between levels (kappa * top / K) within a quarter of the
        bisection's tolerance of the step, at most SHARE_LEVELS.
        """
        top = max(0.0, min(cap, float(max(self.room.max(), self.room_keep.max()))))
        spread = self.kappa * top / step_ms
        count = int(min(SHARE_LEVELS, max(1, np.ceil(spread / (BUDGET_STEP)))))
        levels = np.linspace(0.0, top, count + 1)
        budgets = (step_ms - self.kappa * levels) / self.L
        per_m = [self._per_m(t_j, prices, n_fixed) if t_j > 0 else None for t_j in budgets]
        inner = [self._table(per_m[j], min(cap, r_j), n_fixed) for j, r_j in enumerate(levels)]
        # a share in (r_{j-1}, r_j] leaves no more time than budget t_{j-1} allows
        outer = [inner[0]] + [self._table(per_m[j - 1], min(cap, r_j), n_fixed) for j, r_j in enumerate(levels) if j]

        def union(tables: list[Options]) -> Options:
            return pareto(*(np.concatenate([getattr(o, f) for o in tables]) for f in ("b", "m", "r", "keep")))

        return union(inner), union(outer)

    # ------------------------------------------------------------------ plan assembly helpers

    def splits(self, b: int, m: int | None, n_fixed: int | None) -> np.ndarray:
        """The micro-batch counts b samples may use with micro-batches of at most m."""
        if n_fixed is not None:
            return np.array([n_fixed], dtype=np.int64)
        if b == 0:
            return np.array([1], dtype=np.int64)
        low = 1 if m is None else -(-b // max(m, 1))
        return np.arange(low, b + 1, dtype=np.int64)

    def fastest(self, b: int, n: np.ndarray, prices: Prices, keep: bool = False) -> tuple[int, float]:
        """Of the counts n, the fastest for b samples (fewest on ties), and its per-layer time."""
        times = self.layer_ms(np.full(len(n), b), n, prices, keep)
        i = int(np.nonzero(times <= times.min() * (1 + 1e-12))[0][0])
        return int(n[i]), float(times[i])
