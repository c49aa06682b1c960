"""A plan from the knapsack's choice: options expanded to ranks, trimmed to the batch, shares filled.

The knapsack (:mod:`.knapsack`) picks one option per device kind at a step time S; this module
turns that choice into per-rank arrays: each group's fastest micro-batch count, the surplus
samples trimmed from the slowest ranks to one time level, the shares water-filled under every
rank's memory cap (and the time left for its optimizer step), and, off the critical path, the
fewest micro-batches that keep the step. Step 2 of the algorithm in :mod:`.solver`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from cephalo_lightning.planner.cost.cluster_cost import evaluate_arrays
from cephalo_lightning.planner.cost.device_cost import water_fill
from cephalo_lightning.planner.cost.prices import Prices
from cephalo_lightning.planner.search.knapsack import Group
from cephalo_lightning.planner.search.problem import Problem


@dataclass(frozen=True)
class Assignment:
    batch: np.ndarray
    micro: np.ndarray
    shares: np.ndarray
    keep: np.ndarray  # one micro-batch keeping its graph (RankPlan.recompute = False)
    step_s: float  # priced exactly by cluster_cost.evaluate_arrays
    groups: np.ndarray | None = None  # every rank's shard group (None: one group of all)




def assign(problem: Problem, S: float, prices: Prices, cap: float, n_fixed: int | None,
           groups: list[Group]) -> Assignment:
    inner, _ = problem.tables(S, prices, cap, n_fixed)
    rows = []  # [kind, count, b, m cap, n, keep]
    for g in groups:
        t = inner[g.kind]
        b, m, keep = int(t.b[g.option]), int(t.m[g.option]), bool(t.keep[g.option])
        rows.append([g.kind, g.count, b, m, split(problem, g.kind, b, m, prices, n_fixed, keep), keep])
    trim(problem, rows, prices, n_fixed)
    for row in rows:
        row[4] = split(problem, row[0], row[2], row[3], prices, n_fixed, row[5])
    caps = [share_cap(problem, row, S, prices, cap) for row in rows]
    shares = water_fill(caps, [row[1] for row in rows])
    if shares is None:  # pragma: no cover - the knapsack guarantees sum of caps >= 1
        raise RuntimeError("shares do not fit after trimming")
    if n_fixed is None:
        finish(problem, rows, shares, prices)
    batch, micro, share, keep = expand(problem, rows, shares)
    step, _, _ = evaluate_arrays(problem.cluster, batch, micro, share, ~keep, problem.mode,
                                 kinds=(problem.costs, problem.of_rank))
    return Assignment(batch, micro, share, keep, float(step.max()))

def split(problem: Problem, kind: int, b: int, m: int, prices: Prices, n_fixed: int | None, keep: bool) -> int:
    """The fastest micro-batch count for b samples with micro-batches of at most m (fewest on ties)."""
    if keep or b == 0:
        return 1
    if n_fixed is not None:
        return n_fixed
    model = problem.kinds[kind]
    return model.fastest(b, model.splits(b, m, None), prices)[0]

def share_cap(problem: Problem, row: list, S: float, prices: Prices, cap: float) -> float:
    kind, _, b, _, n, keep = row[:6]
    model = problem.kinds[kind]
    m = -(-b // n) if b else 0
    room = float(model.room_for(np.array([m]), n, keep, b)[0])
    if model.kappa > 0:  # the time the optimizer step may take within S
        layer = float(model.layer_ms(np.array([b]), np.array([n]), prices, keep)[0])
        room = min(room, (S - problem.L * layer) / model.kappa)
    return min(room, cap)

def trim(problem: Problem, rows: list[list], prices: Prices, n_fixed: int | None) -> None:
    """Remove the surplus samples from the slowest ranks: every trimmed rank ends at one time level.

    Rows are [kind, count, b, m cap, n, keep]; a row of a shard group solve carries, beyond these,
    its ranks (split with the row) and its own collective prices (prices, exposed), which replace the given ones.
    """
    excess = sum(row[1] * row[2] for row in rows) - problem.B
    if excess <= 0:
        return
    floor = 0 if n_fixed is None else n_fixed
    lows, times = [], []  # per row: the fewest samples it may keep, and its time at each b from there
    for row in rows:
        low = max(floor, row[2] - excess)
        b = np.arange(low, row[2] + 1)
        n = np.maximum(1, np.minimum(row[4], b))
        lows.append(low)
        # a row's exposed part (row[7][1]) is the same for every group of its grouping (groups of one
        # rank), so it shifts every row's time alike and leaves the trim as it is
        row_prices = row[7][0] if len(row) > 7 else prices
        times.append(np.maximum.accumulate(problem.kinds[row[0]].layer_ms(b, n, row_prices, row[5])))

    def cut(i: int, level: float) -> int:
        """The largest b of row i whose time is <= level (its lowest if none)."""
        return lows[i] + max(0, int(np.searchsorted(times[i], level, side="right")) - 1)

    def removed(level: float) -> int:
        return sum(row[1] * (row[2] - cut(i, level)) for i, row in enumerate(rows))

    # the smallest time level whose cut removes no more than the excess: the best makespan
    levels = np.unique(np.concatenate(times))
    lo, hi = 0, len(levels) - 1  # removed(levels[hi]) == 0 <= excess
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if removed(float(levels[mid])) <= excess else (mid + 1, hi)
    level = float(levels[hi])
    rest = excess - removed(level)
    for i, row in enumerate(rows):
        row[2] = cut(i, level)
    # the rest one sample per rank from the slowest ranks left (all are within the level)
    heap = [(-float(times[i][row[2] - lows[i]]), i) for i, row in enumerate(rows) if row[2] > lows[i]]
    heapq.heapify(heap)
    while rest > 0:
        _, i = heapq.heappop(heap)
        row = rows[i]
        take = min(row[1], rest)
        if take < row[1]:
            tail = [row[0], row[1] - take, *row[2:]]
            if len(row) > 6:  # the ranks: the first `take` stay with this row
                tail[6], row[6] = row[6][take:], row[6][:take]
            rows.append(tail)
            lows.append(lows[i])
            times.append(times[i])
            heapq.heappush(heap, (-float(times[i][row[2] - lows[i]]), len(rows) - 1))
            row[1] = take
        row[2] -= 1
        rest -= take
        if row[2] > lows[i]:
            heapq.heappush(heap, (-float(times[i][row[2] - lows[i]]), i))
    rows[:] = [row for row in rows if row[1] > 0]
    for row in rows:
        row[4] = n_fixed if n_fixed is not None else max(1, min(row[4], row[2]))

def finish(problem: Problem, rows: list[list], shares: list[float], prices: Prices) -> None:
    """Per group, the micro-batch count and recompute choice: fastest where the share leaves
    room, then, off the critical path, the fewest micro-batches within the step.

    A rank that is not the bottleneck gains nothing from being faster; fewer, larger
    micro-batches cost less per-micro-batch overhead than the model may know (on CPU it
    measures none), so among equally good plans this one runs fastest.
    """
    configs = []
    for row, share in zip(rows, shares):
        kind, _, b, _, _, _ = row
        model = problem.kinds[kind]
        optimizer = float(model.cost.optimizer_ms(share))
        if b == 0:
            configs.append((np.array([1]), np.array([False]), np.array([problem.L * model.idle_ms(prices) + optimizer])))
            continue
        n = np.arange(1, b + 1, dtype=np.int64)
        n = n[-(-b // n) <= model.m_cap]
        n = n[model.room_for(-(-b // n), n, b=b) >= share - 1e-12]
        keep = np.zeros(len(n), bool)
        if model.keep_cap >= b and model.room_keep[b] >= share - 1e-12:
            n, keep = np.concatenate(([1], n)), np.concatenate(([True], keep))
        times = problem.L * model.layer_ms(np.full(len(n), b), n, prices, keep) + optimizer
        configs.append((n, keep, times))
    step = max(float(times.min()) for _, _, times in configs)
    for row, (n, keep, times) in zip(rows, configs):
        ok = np.nonzero(times <= step * (1 + 1e-9))[0]
        fewest = n[ok].min()
        best = ok[n[ok] == fewest]
        pick = int(best[np.argmin(times[best])])
        row[4], row[5] = int(n[pick]), bool(keep[pick])

def expand(problem: Problem, rows: list[list], shares: list[float]) -> tuple[np.ndarray, ...]:
    """Groups back to ranks: each kind's ranks take its groups in turn (larger batches first)."""
    batch = np.zeros(problem.W, np.int64)
    micro = np.ones(problem.W, np.int64)
    share = np.zeros(problem.W)
    keep = np.zeros(problem.W, bool)
    ranks = [np.nonzero(problem.of_rank == k)[0] for k in range(len(problem.kinds))]
    taken = [0] * len(problem.kinds)
    for i in sorted(range(len(rows)), key=lambda i: (rows[i][0], -rows[i][2])):
        kind, count, b, _, n, kept = rows[i]
        at = ranks[kind][taken[kind]: taken[kind] + count]
        taken[kind] += count
        batch[at], micro[at], share[at], keep[at] = b, n, shares[i], kept
    return batch, micro, share, keep
