"""Can the devices take B samples and store the whole state? A multiple-choice knapsack.

Every device picks one option (b, r); the assignment is feasible iff some choice has
sum b >= B and sum r >= 1 (surplus samples are trimmed afterwards, which only makes ranks faster
and micro-batches smaller). Three solvers, all over device *kinds* (identical devices share one
option table and a count):

* :func:`feasible` / :func:`choose`: exact, a dynamic program over the devices keeping the
  upward-closed table ``dp[j] = max total share of a choice whose samples sum to at least j``
  (``new[j] = max_o dp[max(0, j - b_o)] + r_o``), only on the window of states that can still
  reach B and that the processed devices can reach (its width is the total surplus capacity).
  Its work grows with devices x options x window: used when :func:`dense_work` is affordable.
* :func:`relaxation`: the linear relaxation over kinds, exact in O(options log options): along
  each kind's upper concave hull of (b, r), moving devices to the next vertex buys samples at a
  price in share; the cheapest increments are bought first (a fractional knapsack). When even it
  cannot reach a total share of 1, no integer choice can: a proof of infeasibility.
* :func:`round_and_repair`: the relaxation's choice rounded to whole devices (one kind straddles
  two vertices), then, if that falls short, an exact sparse dynamic program over a few freed
  devices per kind near their vertices. A heuristic: a choice it finds is feasible, a miss proves
  nothing (the solver then reports the gap to the relaxation's bound).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cephalo_lightning.planner.search.option_tables import Options

_NEG = -np.inf
SHARE_TOL = 1e-12  # as device_cost.water_fill: a feasible choice must water-fill
FREE_PER_KIND = 8  # devices per kind the repair may re-choose
NEIGHBOURS = 6  # options either side of a device's hull vertices the repair may use
SPARSE_LIMIT = 60_000  # Pareto points kept by the repair's sparse program


# ------------------------------------------------------------------------------------ exact


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


def dense_work(options: Sequence[Options], B: int) -> float:
    """Element operations the exact program needs (options x window, summed over devices)."""
    if _quick_infeasible(options, B):
        return 0.0
    return float(sum(len(o) * (hi - lo + 1) for o, (lo, hi) in zip(options, _windows(options, B))))


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


# ------------------------------------------------------------------------------------ relaxation


def upper_hull(opts: Options) -> np.ndarray:
    """Indices of the upper concave hull of a Pareto table's (b, r), from the largest r to the largest b."""
    idx = np.arange(len(opts))
    b, r = opts.b.astype(float), opts.r
    while len(idx) > 2:
        db, dr = np.diff(b[idx]), np.diff(r[idx])
        # an interior point lies on or below the chord of its neighbours: left slope <= right slope
        below = dr[:-1] * db[1:] <= dr[1:] * db[:-1]
        if not below.any():
            break
        keep = np.ones(len(idx), bool)
        keep[1:-1] = ~below
        idx = idx[keep]
    return idx


def hull_steps(tables: Sequence[Options], hulls: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every step between neighbouring hull vertices of every table, cheapest share per sample first
    (a table's steps stay in hull order, the hull being concave): its table, samples gained, share lost."""
    kinds, price, db, dr = [], [], [], []
    for k, (t, h) in enumerate(zip(tables, hulls)):
        steps_b = np.diff(t.b[h]).astype(float)
        steps_r = -np.diff(t.r[h])
        kinds.append(np.full(len(steps_b), k))
        price.append(steps_r / steps_b)
        db.append(steps_b)
        dr.append(steps_r)
    order = np.argsort(np.concatenate(price), kind="stable")
    return np.concatenate(kinds).astype(np.int64)[order], np.concatenate(db)[order], np.concatenate(dr)[order]


@dataclass(frozen=True)
class Group:
    """``count`` devices of kind ``kind`` on option ``option`` of that kind's table."""

    kind: int
    count: int
    option: int


@dataclass(frozen=True)
class Relaxed:
    value: float  # the relaxation's largest total share at sum b >= B (-inf: B unreachable)
    groups: tuple[Group, ...]  # its choice rounded to whole devices
    rounded_share: float  # the total share of that rounded choice
    vertices: tuple[tuple[int, int], ...]  # per kind, the option indices the choice straddles


def relaxation(tables: Sequence[Options], counts: Sequence[int], B: int) -> Relaxed:
    """The linear relaxation over kinds and its choice rounded up to whole devices (see module)."""
    hulls = [upper_hull(t) if len(t) else np.zeros(0, np.int64) for t in tables]
    if any(len(h) == 0 for h in hulls):
        return Relaxed(-np.inf, (), -np.inf, ())
    first = [int(h[0]) for h in hulls]
    samples = sum(c * int(t.b[o]) for t, c, o in zip(tables, counts, first))
    share = sum(c * float(t.r[o]) for t, c, o in zip(tables, counts, first))
    at = [0] * len(tables)  # per kind, position on its hull
    straddle: int | None = None
    moved = 0
    if samples < B:
        kind_of, step_b, step_r = hull_steps(tables, hulls)
        gain = step_b * np.asarray(counts, dtype=float)[kind_of]
        cum = np.cumsum(gain)
        need = B - samples
        last = int(np.searchsorted(cum, need - 0.5))  # the first step that reaches B
        if last >= len(cum):
            return Relaxed(-np.inf, (), -np.inf, ())
        full_gain = cum[last - 1] if last else 0.0
        loss = np.asarray(counts, dtype=float)[kind_of] * step_r
        full_loss = float(loss[:last].sum())
        for k in kind_of[:last].tolist():
            at[k] += 1
        straddle = int(kind_of[last])
        fraction = (need - full_gain) / gain[last]
        value = share - full_loss - fraction * float(loss[last])
        moved = int(np.ceil((need - full_gain) / step_b[last] - 1e-9))  # devices moved to the next vertex
        rounded = share - full_loss - moved * float(step_r[last])
    else:
        value = rounded = share
    groups: list[Group] = []
    vertices = []
    for k, (h, c) in enumerate(zip(hulls, counts)):
        here = int(h[at[k]])
        nxt = int(h[min(at[k] + 1, len(h) - 1)])
        vertices.append((here, nxt))
        if k == straddle and moved:
            if c - moved:
                groups.append(Group(k, c - moved, here))
            groups.append(Group(k, moved, nxt))
        else:
            groups.append(Group(k, c, here))
    return Relaxed(float(value), tuple(groups), float(rounded), tuple(vertices))


# ------------------------------------------------------------------------------------ repair


def _sparse_choice(tables: Sequence[Options], target: int, need: float) -> list[int] | None:
    """Exact over the given (small) tables: each picks one option, sum b >= target, sum r >= need."""
    s = np.zeros(1, np.int64)
    r = np.zeros(1)
    history: list[tuple[np.ndarray, np.ndarray]] = []  # per table: (parent point, option) of each point
    for i, t in enumerate(tables):
        cand_s = np.minimum(s[:, None] + t.b[None, :], target).ravel()
        cand_r = (r[:, None] + t.r[None, :]).ravel()
        parent = np.repeat(np.arange(len(s)), len(t))
        option = np.tile(np.arange(len(t)), len(s))
        order = np.lexsort((-cand_r, -cand_s))
        cand_s, cand_r, parent, option = cand_s[order], cand_r[order], parent[order], option[order]
        before = np.concatenate(([-np.inf], np.maximum.accumulate(cand_r)[:-1]))
        front = cand_r > before
        s, r, parent, option = cand_s[front], cand_r[front], parent[front], option[front]
        if len(s) > SPARSE_LIMIT:  # thin evenly over the samples: a heuristic anyway
            pick = np.unique(np.linspace(0, len(s) - 1, SPARSE_LIMIT).astype(np.int64))
            s, r, parent, option = s[pick], r[pick], parent[pick], option[pick]
        history.append((parent, option))
        done = np.nonzero((s >= target) & (r >= need - SHARE_TOL))[0]
        if len(done):  # the rest take their largest-share option: never less share
            point = int(done[np.argmax(r[done])])
            chosen = [0] * len(tables)
            for j in range(i, -1, -1):
                parents, options = history[j]
                chosen[j] = int(options[point])
                point = int(parents[point])
            return chosen
    return None


def round_and_repair(tables: Sequence[Options], counts: Sequence[int], B: int,
                     relaxed: Relaxed) -> list[Group] | None:
    """A feasible whole-device choice near the relaxation's, or None (see module docstring)."""
    if relaxed.rounded_share >= 1.0 - SHARE_TOL:
        return list(relaxed.groups)
    if relaxed.value < 1.0 - SHARE_TOL:
        return None
    fixed: list[Group] = []
    free: list[tuple[int, Options, np.ndarray]] = []  # (kind, allowed table, option indices)
    left = {k: min(c, FREE_PER_KIND) for k, c in enumerate(counts)}
    for g in relaxed.groups:
        take = min(g.count, left[g.kind])
        left[g.kind] -= take
        if g.count - take:
            fixed.append(Group(g.kind, g.count - take, g.option))
        if take:
            here, nxt = relaxed.vertices[g.kind]
            lo, hi = max(0, min(here, nxt) - NEIGHBOURS), max(here, nxt) + NEIGHBOURS
            t = tables[g.kind]
            allowed = np.arange(lo, min(hi, len(t) - 1) + 1)
            sub = Options(t.b[allowed], t.m[allowed], t.r[allowed], t.keep[allowed])
            free.extend([(g.kind, sub, allowed)] * take)
    fixed_b = sum(g.count * int(tables[g.kind].b[g.option]) for g in fixed)
    fixed_r = sum(g.count * float(tables[g.kind].r[g.option]) for g in fixed)
    chosen = _sparse_choice([t for _, t, _ in free], max(0, B - fixed_b), 1.0 - fixed_r)
    if chosen is None:
        return None
    picked: dict[tuple[int, int], int] = {}
    for (kind, _, allowed), o in zip(free, chosen):
        key = (kind, int(allowed[o]))
        picked[key] = picked.get(key, 0) + 1
    merged: dict[tuple[int, int], int] = {}
    for g in fixed:
        merged[(g.kind, g.option)] = merged.get((g.kind, g.option), 0) + g.count
    for key, c in picked.items():
        merged[key] = merged.get(key, 0) + c
    return [Group(k, c, o) for (k, o), c in sorted(merged.items())]


def groups_of(picks: Sequence[int], kind_of_device: Sequence[int]) -> list[Group]:
    """Per-device option picks as groups of (kind, option) with counts."""
    merged: dict[tuple[int, int], int] = {}
    for kind, o in zip(kind_of_device, picks):
        merged[(int(kind), int(o))] = merged.get((int(kind), int(o)), 0) + 1
    return [Group(k, c, o) for (k, o), c in sorted(merged.items())]
