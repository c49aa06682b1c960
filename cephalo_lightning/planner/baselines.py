"""Comparison points for a plan: the even (FSDP-like) and proportional baselines, the upper bound.

* ``even``: equal batches (+-1) and equal shares, the smallest common micro-batch count that fits
  every rank's memory, as plain FSDP with gradient accumulation would run.
* ``proportional``: the batch split by each device's best memory-feasible speed (what earlier
  heterogeneity-aware systems do), equal shares, per rank the fewest micro-batches that fit.
* upper bound: the sum over devices of their best memory-feasible samples/s (compute only, no
  state, one micro-batch of the best size, no collectives). Any plan's samples/s is below it.
"""

from __future__ import annotations

import numpy as np

from cephalo_lightning.planner.assemble import rank_plans
from cephalo_lightning.planner.cluster import Cluster
from cephalo_lightning.planner.cost import DeviceCost
from cephalo_lightning.planner.plan import BaselineResult


def _rates(cost: DeviceCost, sizes: np.ndarray) -> np.ndarray:
    """Samples/s of one micro-batch of each size: forward, recomputed forward and backward."""
    per_layer_ms = 2 * cost.fwd(sizes) + cost.bwd(sizes)
    return sizes / (cost.num_layers * per_layer_ms / 1e3)


def largest_micro_batch(cost: DeviceCost, share: float, limit: int) -> int:
    """The largest micro-batch size <= limit that fits beside ``share`` of the state (0 if none)."""
    sizes = np.arange(1, max(limit, 1) + 1)
    fits = (cost.budget_gb - cost.compute_memory(sizes)) / cost.state_gb >= share - 1e-12
    return int(np.count_nonzero(fits))  # compute memory is non-decreasing: fitting sizes are a prefix


def best_rate(cost: DeviceCost, share: float, limit: int) -> float:
    """Best samples/s over the micro-batch sizes that fit beside ``share`` of the state."""
    top = largest_micro_batch(cost, share, limit)
    return float(_rates(cost, np.arange(1, top + 1)).max()) if top else 0.0


def upper_bound_samples_per_s(cluster: Cluster, global_batch: int) -> float:
    """Sum of every device's best samples/s with no state (micro-batches beyond B never occur)."""
    costs: dict[object, float] = {}
    total = 0.0
    for device in cluster.devices:
        if device not in costs:
            costs[device] = best_rate(DeviceCost(device, cluster), 0.0, global_batch)
        total += costs[device]
    return total


def _too_small(cluster: Cluster, rank: int, share: float, samples: int = 1) -> str:
    device = cluster.devices[rank]
    cost = DeviceCost(device, cluster)
    need = float(cost.compute_memory(samples)) + cluster.settings.reserved_memory_gb + share * cost.state_gb
    limit = cluster.settings.usable_memory_fraction * device.memory_gb
    beside = "beside one sample" if samples else "even with no samples"
    return (f"rank {rank} ({device.name}) cannot hold 1/{cluster.world_size} of the state "
            f"({share * cost.state_gb:.1f} GiB) {beside}: needs {need:.1f} GiB of {limit:.1f} usable")


def _result(cluster: Cluster, batch: list[int], micro: list[int], global_batch: int) -> BaselineResult:
    shares = [1.0 / cluster.world_size] * cluster.world_size
    ranks, step = rank_plans(cluster, batch, micro, shares)
    for r in ranks:  # the checks above should have caught it; never report an overcommitted baseline
        if r.predicted_memory_gb is not None and r.memory_limit_gb is not None and \
                r.predicted_memory_gb > r.memory_limit_gb * (1 + 1e-9):
            return BaselineResult(None, False, reason=f"rank {r.rank} ({r.device}) needs {r.predicted_memory_gb:.1f} "
                                                      f"GiB of {r.memory_limit_gb:.1f} usable")
    return BaselineResult(global_batch / step, True, step, None, ranks)


def even_baseline(cluster: Cluster, global_batch: int) -> BaselineResult:
    """Equal batches and shares with the smallest common micro-batch count that fits."""
    world = cluster.world_size
    q, rem = divmod(global_batch, world)
    batch = [q + (1 if i < rem else 0) for i in range(world)]
    share = 1.0 / world
    need = 1
    for rank, device in enumerate(cluster.devices):
        cost = DeviceCost(device, cluster)
        if batch[rank] == 0:  # an idle rank still holds its share beside the empty-batch memory
            if cost.max_share(0) < share - 1e-12:
                return BaselineResult(None, False, reason=_too_small(cluster, rank, share, 0))
            continue
        top = largest_micro_batch(cost, share, batch[rank])
        if top == 0:
            return BaselineResult(None, False, reason=_too_small(cluster, rank, share))
        need = max(need, -(-batch[rank] // top))
    smallest = min(b for b in batch if b > 0)
    if need > smallest:
        return BaselineResult(None, False, reason=(
            f"no common micro-batch count fits: a rank needs {need} micro-batches but the smallest "
            f"batch is {smallest} samples"))
    return _result(cluster, batch, [need] * world, global_batch)


def _largest_remainder(total: int, weights: list[float]) -> list[int]:
    w = np.asarray(weights, dtype=float)
    exact = total * w / w.sum()
    base = np.floor(exact).astype(int)
    order = np.argsort(-(exact - base), kind="stable")
    base[order[: total - int(base.sum())]] += 1
    return [int(x) for x in base]


def proportional_baseline(cluster: Cluster, global_batch: int) -> BaselineResult:
    """Batch split by each device's best speed at an even share; per-rank fewest micro-batches."""
    share = 1.0 / cluster.world_size
    costs = [DeviceCost(d, cluster) for d in cluster.devices]
    tops = [largest_micro_batch(c, share, global_batch) for c in costs]
    for rank, top in enumerate(tops):
        if top == 0:
            return BaselineResult(None, False, reason=_too_small(cluster, rank, share))
    rates = [best_rate(c, share, global_batch) for c in costs]
    batch = _largest_remainder(global_batch, rates)
    micro = [max(1, -(-b // top)) for b, top in zip(batch, tops)]
    return _result(cluster, batch, micro, global_batch)
