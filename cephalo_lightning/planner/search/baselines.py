"""Comparison points for a plan: the even and proportional baselines and the upper bound.

* ``even``: equal batches (+-1) and equal shares, the smallest common micro-batch count that fits
  every rank's memory, as plain FSDP with gradient accumulation would run.
* ``ddp-even`` / ``hsdp-even``: ``even`` with a shard group per rank (data parallelism: every
  rank holds the whole state) / per node (FSDP2's 2-D mesh: even shares inside a node, replicas
  across nodes; one node: the same as ``even``).
* ``proportional``: the batch split by each device's best memory-feasible speed (what earlier
  heterogeneity-aware systems do), equal shares, per rank the fewest micro-batches that fit.
* upper bound: the sum over devices of their best memory-feasible samples/s (compute only, no
  state, one micro-batch of the best size, no collectives). Any plan's samples/s is below it.

The ``poplar`` and ``reference`` peers need the solver's machinery: :mod:`.peers`. Every baseline
is priced by the same cost model as the plan, run as this runtime would run it (one-micro-batch
ranks keep their graph where the memory allows, as the plan's do), and computed per device kind.
"""

from __future__ import annotations

import math

import numpy as np

from cephalo_lightning._common.units import memory_text
from cephalo_lightning._common.vocabulary import Schedule
from cephalo_lightning.planner.cost.cluster_cost import evaluate_arrays
from cephalo_lightning.planner.cost.device_cost import DeviceCost, kind_costs
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.plan import BaselineResult
from cephalo_lightning.planner.search.assemble import rank_plans
from cephalo_lightning.planner.search.option_tables import DeviceModel


def micro_times(model: DeviceModel) -> tuple[np.ndarray, np.ndarray]:
    """Micro-batch sizes 1..m_cap and the fastest per-layer compute of one micro-batch of each that fits."""
    cost = model.cost
    m = np.arange(1, max(model.m_cap, 0) + 1)
    if not len(m):
        return m, np.zeros(0)
    ones = np.ones(len(m), np.int64)
    fwd, bwd = cost.compute_parts(m, ones)
    time = np.where(model.room_for(m, 1, b=m) >= 0, fwd + bwd, np.inf)
    if cost.can_keep:
        fwd, bwd = cost.compute_parts(m, ones, keep=True)
        time = np.minimum(time, np.where(model.room_keep[m] >= 0, fwd + bwd, np.inf))
    return m, time


def per_sample_ms(model: DeviceModel) -> float:
    """The least per-layer compute time per sample over the micro-batch sizes that fit (inf if none)."""
    m, time = micro_times(model)
    return float((time / m).min()) if len(m) else math.inf


def upper_bound_samples_per_s(cluster: Cluster, global_batch: int, mode: Schedule = Schedule.LAYERED) -> float:
    """Sum of every device's best samples/s with no state (micro-batches beyond B never occur)."""
    costs, of_rank = kind_costs(cluster, mode)
    counts = np.bincount(of_rank, minlength=len(costs))
    total = 0.0
    for cost, count in zip(costs, counts):
        ps = per_sample_ms(DeviceModel(cost, global_batch))
        if ps < math.inf:
            total += count * 1e3 / (cost.num_layers * ps)
    return total


def largest_micro_batch(cost: DeviceCost, share: float, limit: int, n: int = 1) -> int:
    """The largest micro-batch size <= limit that fits beside ``share`` of the state (0 if none)."""
    top = cost.compute_memory.largest_within(cost.budget_gb, max(limit, 1))
    sizes = np.arange(1, max(top, 0) + 1)
    fits = cost.room(sizes, n) >= share - 1e-12
    return int(np.count_nonzero(fits))  # memory is non-decreasing in m: fitting sizes are a prefix


def best_rate(cost: DeviceCost, share: float, limit: int) -> float:
    """Best samples/s over the micro-batch sizes that fit beside ``share`` of the state."""
    top = largest_micro_batch(cost, share, limit)
    if not top:
        return 0.0
    m = np.arange(1, top + 1)
    fwd, bwd = cost.compute_parts(m, np.ones(top, np.int64))
    return float((m / (cost.num_layers * (fwd + bwd) / 1e3)).max())


def _too_small(cluster: Cluster, rank: int, share: float, samples: int = 1) -> str:
    device = cluster.devices[rank]
    cost = DeviceCost(device, cluster)
    need = float(cost.compute_memory(samples)) + cluster.settings.reserved_memory_gb + share * cost.share_gb
    limit = cluster.settings.usable_memory_fraction * device.memory_gb
    beside = "beside one sample" if samples else "even with no samples"
    part = "the whole state" if share >= 1 else f"1/{round(1 / share)} of the state"
    return (f"rank {rank} ({device.name}) cannot hold {part} "
            f"({memory_text(share * cost.state_gb)}) {beside}: needs {memory_text(need)} of {memory_text(limit)} usable")


def keep_where_fits(cluster: Cluster, batch: np.ndarray, micro: np.ndarray, shares: np.ndarray,
                    mode: Schedule) -> np.ndarray:
    """One-micro-batch ranks keep their graph where its memory is known and fits (as plans do)."""
    keep = np.zeros(len(batch), bool)
    if mode != Schedule.LAYERED:
        return keep
    costs, of_rank = kind_costs(cluster, mode)
    for k, cost in enumerate(costs):
        if not cost.can_keep:
            continue
        at = np.nonzero((of_rank == k) & (micro == 1) & (batch > 0))[0]
        if len(at):
            keep[at] = cost.room(batch[at], 1, keep=True) >= shares[at] - 1e-12
    return keep


def result(cluster: Cluster, batch: np.ndarray, micro: np.ndarray, shares: np.ndarray, global_batch: int,
           mode: Schedule, with_ranks: bool, shard_groups: np.ndarray | None = None) -> BaselineResult:
    """A baseline's assignment priced by the cost model (an overcommitted rank makes it infeasible)."""
    keep = keep_where_fits(cluster, batch, micro, shares, mode)
    step, memory, fits = evaluate_arrays(cluster, batch, micro, shares, ~keep, mode, shard_groups=shard_groups)
    if not fits.all():
        r = int(np.nonzero(~fits)[0][0])
        limit = cluster.settings.usable_memory_fraction * cluster.devices[r].memory_gb
        return BaselineResult(None, False, reason=f"rank {r} ({cluster.devices[r].name}) needs "
                                                  f"{memory_text(memory[r])} of {memory_text(limit)} usable")
    ranks = rank_plans(cluster, batch, micro, shares, ~keep, mode, shard_groups=shard_groups)[0] if with_ranks else ()
    top = float(step.max())
    return BaselineResult(global_batch / top, True, top, None, ranks)


def even_baseline(cluster: Cluster, global_batch: int, mode: Schedule = Schedule.LAYERED,
                  with_ranks: bool = True, shard_groups: np.ndarray | None = None) -> BaselineResult:
    """Equal batches and shares (within each shard group; None: one group) with the smallest common
    micro-batch count that fits."""
    world = cluster.world_size
    q, rem = divmod(global_batch, world)
    batch = q + (np.arange(world) < rem).astype(np.int64)
    groups = np.zeros(world, np.int64) if shard_groups is None else np.asarray(shard_groups, dtype=np.int64)
    shares = 1.0 / np.bincount(groups)[groups]
    costs, of_rank = kind_costs(cluster, mode)
    need = 1
    for k, cost in enumerate(costs):
        ranks = np.nonzero(of_rank == k)[0]
        for b, share in sorted({(int(x), float(r)) for x, r in zip(batch[ranks], shares[ranks])}):
            rank = int(ranks[(batch[ranks] == b) & (shares[ranks] == share)][0])
            if b == 0:  # an idle rank still holds its share beside the empty-batch memory
                if cost.max_share(0) < share - 1e-12:
                    return BaselineResult(None, False, reason=_too_small(cluster, rank, share, 0))
                continue
            if largest_micro_batch(cost, share, b) >= b:
                continue  # one micro-batch of b fits
            top = largest_micro_batch(cost, share, b, n=2)
            if top == 0:
                return BaselineResult(None, False, reason=_too_small(cluster, rank, share))
            need = max(need, -(-b // top))
    smallest = int(batch[batch > 0].min())
    if need > smallest:
        return BaselineResult(None, False, reason=(
            f"no common micro-batch count fits: a rank needs {need} micro-batches but the smallest "
            f"batch is {smallest} samples"))
    return result(cluster, batch, np.full(world, need), shares, global_batch, mode, with_ranks,
                  None if shard_groups is None else groups)


def _largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    w = np.asarray(weights, dtype=float)
    exact = total * w / w.sum()
    base = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - base), kind="stable")
    base[order[: total - int(base.sum())]] += 1
    return base


def proportional_baseline(cluster: Cluster, global_batch: int, with_ranks: bool = True) -> BaselineResult:
    """Batch split by each device's best speed at an even share; per-rank fewest micro-batches."""
    share = 1.0 / cluster.world_size
    costs, of_rank = kind_costs(cluster)
    tops = np.array([largest_micro_batch(c, share, global_batch) for c in costs])
    for k, top in enumerate(tops):
        if top == 0:
            return BaselineResult(None, False, reason=_too_small(cluster, int(np.nonzero(of_rank == k)[0][0]), share))
    rates = np.array([best_rate(c, share, global_batch) for c in costs])
    batch = _largest_remainder(global_batch, rates[of_rank])
    micro = np.maximum(1, -(-batch // tops[of_rank]))
    return result(cluster, batch, micro, np.full(cluster.world_size, share), global_batch, Schedule.LAYERED, with_ranks)
