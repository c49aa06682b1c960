"""The published peers as baselines, re-derived and priced by this cost model.

* ``poplar`` (the closest published peer): memory-aware uneven batches and per-rank micro-batches
  under EVEN state shares: each device takes as many samples as its time budget allows with
  micro-batches that fit beside 1/W of the state. The same bisection and options as the planner,
  with every share fixed at 1/W.
* ``reference`` (the Cephalo release's optimizer, as its code reads): every GPU gets n x m samples
  (whole micro-batches, at least one) with m no larger than what fits with no state, collectives
  charged +25% on a GPU whose micro-batch would not fit beside an even share, the step minimised
  subject to memory checked only IN AGGREGATE (sum over GPUs of compute memory, reserve and the
  whole state within usable_memory_fraction of the total capacity), then state shares water-filled
  on memory utilisation (even shares when every GPU stays under half its memory at an even share).
  A plan that overcommits one GPU is reported infeasible with that GPU's figures. Its dynamic
  program is over the exact sample count, so it is only computed up to ``REFERENCE_LIMIT``.

Both, like every baseline, run as this runtime would run them (one-micro-batch ranks keep their
graph where the memory allows) and are computed per device kind where they can be.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from cephalo_lightning._common.units import GIB
from cephalo_lightning._common.vocabulary import Planner, Schedule
from cephalo_lightning.planner.cost.prices import Prices
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.plan import BaselineResult
from cephalo_lightning.planner.schema.planning_error import PlanningError
from cephalo_lightning.planner.search.assignment import expand, finish, split, trim
from cephalo_lightning.planner.search.baselines import even_baseline, proportional_baseline, result
from cephalo_lightning.planner.search.grouped import canonical
from cephalo_lightning.planner.search.problem import BISECTION_TOL, Problem

BASELINES = tuple(p.value for p in (Planner.EVEN, Planner.PROPORTIONAL, Planner.POPLAR, Planner.REFERENCE,
                                    Planner.DDP_EVEN, Planner.HSDP_EVEN))
# the shard grouping each baseline runs under (the plan table names it beside the baseline)
BASELINE_GROUPINGS = {Planner.EVEN: "full shard", Planner.PROPORTIONAL: "full shard",
                      Planner.POPLAR: "full shard", Planner.REFERENCE: "full shard",
                      Planner.DDP_EVEN: "a group per rank: data parallel",
                      Planner.HSDP_EVEN: "a group per node: HSDP"}
REFERENCE_LIMIT = 4096  # ranks x global batch for the reference's exact-sum dynamic program
REFERENCE_UNEVEN = 1.25  # the release's surcharge on an uneven collective
REFERENCE_BALANCE = 0.5  # the release's max_balance_util: below it shares stay even


def _bisect(feasible, lo: float, hi: float) -> float | None:
    """The smallest feasible value in [lo, hi] to BISECTION_TOL (hi doubles from lo); None if none."""
    top = hi
    hi = max(lo * 1.25, 1e-9)
    while not feasible(min(hi, top)):
        if hi >= top:
            return None
        lo, hi = hi, hi * 2
    hi = min(hi, top)
    while hi > lo * (1 + BISECTION_TOL):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return hi


def poplar_baseline(cluster: Cluster, global_batch: int, with_ranks: bool = False,
                    problem: Problem | None = None) -> BaselineResult:
    """Uneven batches and micro-batches under even state shares (see module docstring)."""
    problem = problem or Problem(cluster, global_batch, Schedule.LAYERED)
    share = 1.0 / problem.W
    prices = Prices(problem.comm.allgather(share), problem.comm.reduce_scatter(share))

    def picks(S: float) -> list[tuple[int, int]] | None:
        inner, _ = problem.tables(S, prices, 1.0, None)
        out = []
        for table in inner:
            fits = np.nonzero(table.r >= share - 1e-12)[0]
            if not len(fits):
                return None
            out.append((int(fits[-1]), int(table.b[fits[-1]])))
        return out

    def feasible(S: float) -> bool:
        chosen = picks(S)
        return chosen is not None and sum(c * b for c, (_, b) in zip(problem.counts, chosen)) >= global_batch

    S = _bisect(feasible, max(problem.compute_floor, 1e-9), problem.saturated(prices, None))
    if S is None:
        for k, model in enumerate(problem.kinds):
            rank = int(np.nonzero(problem.of_rank == k)[0][0])
            if model.room[0] < share - 1e-12:
                return BaselineResult(None, False, reason=f"rank {rank} ({model.device.name}) cannot hold 1/{problem.W} "
                                                          f"of the state even with no samples")
        return BaselineResult(None, False, reason=f"the GPUs cannot take {global_batch} samples beside 1/{problem.W} "
                                                  f"of the state each")
    inner, _ = problem.tables(S, prices, 1.0, None)
    rows = []
    for k, (o, _) in enumerate(picks(S) or []):
        t = inner[k]
        b, m, keep = int(t.b[o]), int(t.m[o]), bool(t.keep[o])
        rows.append([k, int(problem.counts[k]), b, m, split(problem, k, b, m, prices, None, keep), keep])
    trim(problem, rows, prices, None)
    for row in rows:
        row[4] = split(problem, row[0], row[2], row[3], prices, None, row[5])
    shares = [share] * len(rows)
    finish(problem, rows, shares, prices)
    batch, micro, shares_arr, _ = expand(problem, rows, shares)
    return result(cluster, batch, micro, shares_arr, global_batch, Schedule.LAYERED, with_ranks)


def _reference_options(problem: Problem, kind: int, prices: Prices, S: float
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Per b = 0..B: the aggregate room of the smallest micro-batch m dividing b that meets S, and m."""
    model = problem.kinds[kind]
    B, share = problem.B, 1.0 / problem.W
    top = min(model.m_cap, B)
    room = np.full(B + 1, -np.inf)
    micro = np.zeros(B + 1, np.int64)
    if top < 1:
        return room, micro
    m_even = int(np.count_nonzero(model.room[1: top + 1] >= share - 1e-12))
    sizes = np.arange(1, top + 1)
    pair_m = np.concatenate([np.full(B // mm, mm) for mm in sizes])
    pair_n = np.concatenate([np.arange(1, B // mm + 1) for mm in sizes])
    pair_b = pair_m * pair_n
    time = np.empty(len(pair_b))
    for factor, at in ((1.0, pair_m <= m_even), (REFERENCE_UNEVEN, pair_m > m_even)):
        time[at] = problem.L * model.layer_ms(pair_b[at], pair_n[at], prices.scaled(factor))
    ok = time <= S * (1 + 1e-9)
    best = np.full(B + 1, top + 1)
    np.minimum.at(best, pair_b[ok], pair_m[ok])
    found = best <= top
    room[found] = model.room[best[found]]
    micro[found] = best[found]
    return room, micro


def reference_baseline(cluster: Cluster, global_batch: int, with_ranks: bool = False,
                       problem: Problem | None = None) -> BaselineResult:
    """The Cephalo release's optimizer (see module docstring), priced by this cost model."""
    W, B = cluster.world_size, global_batch
    if W * B > REFERENCE_LIMIT:
        return BaselineResult(None, False, skipped=True, reason=(
            f"not computed: the release's exact-sample dynamic program is run up to {REFERENCE_LIMIT:,} "
            f"ranks x samples, this is {W * B:,}"))
    if B < W:
        return BaselineResult(None, False, reason=f"the release gives every GPU at least one sample; "
                                                  f"the global batch {B} is smaller than the {W} GPUs")
    problem = problem or Problem(cluster, B, Schedule.LAYERED)
    share = 1.0 / W
    prices = Prices(problem.comm.allgather(share), problem.comm.reduce_scatter(share))
    kinds = problem.of_rank

    def solve(S: float) -> list[tuple[int, int]] | None:
        tables = [_reference_options(problem, k, prices, S) for k in range(len(problem.kinds))]
        dp = np.full(B + 1, -np.inf)
        dp[0] = 0.0
        picks = []
        for k in kinds:
            room, _ = tables[k]
            new = np.full(B + 1, -np.inf)
            arg = np.zeros(B + 1, np.int64)
            for b in np.nonzero(np.isfinite(room))[0].tolist():
                cand = dp[: B + 1 - b] + room[b]
                better = cand > new[b:]
                new[b:] = np.where(better, cand, new[b:])
                arg[b:] = np.where(better, b, arg[b:])
            dp = new
            picks.append(arg)
        if dp[B] < 1.0 - 1e-12:  # the aggregate check: total room for the whole state
            return None
        chosen, j = [], B
        for rank in range(W - 1, -1, -1):
            b = int(picks[rank][j])
            chosen.append((b, int(tables[kinds[rank]][1][b])))
            j -= b
        return chosen[::-1]

    limit = problem.saturated(prices.scaled(REFERENCE_UNEVEN), None)
    S = _bisect(lambda S: solve(S) is not None, max(problem.compute_floor, 1e-9), limit)
    if S is None:
        return BaselineResult(None, False, reason="no assignment fits even the aggregate memory")
    chosen = solve(S)
    assert chosen is not None
    batch = np.array([b for b, _ in chosen], np.int64)
    m = np.array([mm for _, mm in chosen], np.int64)
    micro = batch // m
    shares = _utilisation_shares(problem, m)
    out = result(cluster, batch, micro, shares, B, Schedule.LAYERED, with_ranks)
    if not out.feasible:
        return BaselineResult(None, False, reason=f"{out.reason} (the release checks memory only in aggregate)")
    return out


def _utilisation_shares(problem: Problem, m: np.ndarray) -> np.ndarray:
    """The release's shares: even below half memory, else water-filled on memory utilisation."""
    cluster = problem.cluster
    state = cluster.model.state_bytes / GIB
    reserved = cluster.settings.reserved_memory_gb
    base = np.array([float(problem.kinds[k].cost.compute_memory(int(mm))) + reserved
                     for k, mm in zip(problem.of_rank, m)])
    capacity = np.array([d.memory_gb for d in cluster.devices])
    if ((base + state / problem.W) / capacity).max() < REFERENCE_BALANCE:
        return np.full(problem.W, 1.0 / problem.W)
    lo, hi = 0.0, float(((base + state) / capacity).max())
    for _ in range(200):
        u = (lo + hi) / 2
        lo, hi = (u, hi) if np.maximum(0.0, u * capacity - base).sum() < state else (lo, u)
    shares = np.maximum(0.0, hi * capacity - base)
    return shares / shares.sum()


def compute_baselines(cluster: Cluster, global_batch: int, mode: Schedule = Schedule.LAYERED,
                      names: Sequence[str] = BASELINES, with_ranks: bool = False,
                      problem: Problem | None = None) -> dict[str, BaselineResult]:
    """The named baselines (``with_ranks``: with their per-rank plans) for a plan in ``mode``."""
    out: dict[str, BaselineResult] = {}
    for name in names:
        if name == Planner.EVEN:
            out[name] = even_baseline(cluster, global_batch, mode, with_ranks)
        elif name == Planner.DDP_EVEN:
            out[name] = even_baseline(cluster, global_batch, mode, with_ranks, np.arange(cluster.world_size))
        elif name == Planner.HSDP_EVEN:
            out[name] = even_baseline(cluster, global_batch, mode, with_ranks, canonical(np.asarray(cluster.nodes)))
        elif mode == Schedule.UNIFORM:
            out[name] = BaselineResult(None, False, skipped=True, reason=(
                f"not computed: {name} picks each rank's micro-batch count, which the uniform mode does not"))
        elif name == Planner.PROPORTIONAL:
            out[name] = proportional_baseline(cluster, global_batch, with_ranks)
        elif name == Planner.POPLAR:
            out[name] = poplar_baseline(cluster, global_batch, with_ranks, problem)
        elif name == Planner.REFERENCE:
            out[name] = reference_baseline(cluster, global_batch, with_ranks, problem)
        else:
            raise PlanningError(f"unknown baseline {name!r}; choose from {BASELINES}")
    return out
