"""The cost model applied to the whole cluster: every rank's predicted step time, memory and fit
for one assignment (:func:`evaluate`), and the terms only the ranks together decide.

Each rank's step_i is its device kind's (:mod:`cephalo_lightning.planner.cost.device_cost`), with its
collectives priced for its shard group (:mod:`cephalo_lightning.planner.cost.collective_prices`)::

    step = max_i step_i

With ``settings.sync_passes`` (the profiler sets it) every layer's pass ends together on the ranks of
one shard group, as its collectives wait for the group's slowest rank, so a rank's step is at least
its group's::

    step_g = contention * (num_layers * (max_{i in g} fwd_i + max_{i in g} bwd_i) + max_{i in g} opt_i) + step_overhead

which exceeds the slowest rank's sum where ranks split their time between the passes differently
(one recomputes, another keeps its graph; kinds whose forward and backward scale apart). The solve
prices ranks alone (a lower bound of this), and the plan's price and certified gap include it
(:func:`synced_group_ms`).

Ranks sharing one host (``settings.host_cores`` = K, CPU ranks and emulated clusters) compete for
its cores: an emulated slow rank sleeps through (1 - 1/slowdown) of its compute, and only its real
compute needs a core. The step is then at least every rank's real compute spread over the cores::

    step >= step_overhead + sum_i busy_i / slowdown_i / K      (busy_i: layers and optimizer step)

(:func:`shared_host_floor_ms`); without ``host_cores`` (one device per rank) there is no such term.

A cluster's ``calibration:`` block (terms measured on a run) is folded in first
(:func:`cephalo_lightning.planner.cost.calibration.calibrated`), for the shard groups priced;
``step_overhead`` is zero and ``contention`` one without one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cephalo_lightning._common.vocabulary import Schedule
from cephalo_lightning.planner.cost.calibration import calibrated
from cephalo_lightning.planner.cost.collective_prices import communication, link_prices, single_group
from cephalo_lightning.planner.cost.device_cost import DeviceCost, kind_costs, slowdown_of, step_ms
from cephalo_lightning.planner.cost.pipeline_cost import busy_s as pipeline_busy_s
from cephalo_lightning.planner.cost.prices import Prices
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.plan import Plan


@dataclass(frozen=True)
class RankCost:
    step_s: float
    memory_gb: float
    fits: bool


def collective_ms(cluster: Cluster, shares: Sequence[float] | np.ndarray,
                  shard_groups: Sequence[int] | np.ndarray | None = None
                  ) -> tuple[Prices, np.ndarray]:
    """Every rank's per-layer (all-gather and reduce-scatter plus the cross-group reduction, exposed) in
    ms, under ``shard_groups`` (None: one group of all; ``shares`` within each group). The exposed part
    (groups of one rank: the last gradient bucket's all-reduce, which starts when the backward ends)
    adds to the layer's time after :meth:`DeviceCost.layer_ms` instead of overlapping its compute. A
    cluster that still carries its calibration is folded for these groups."""
    cluster = calibrated(cluster, np.zeros(len(shares), np.int64) if shard_groups is None else shard_groups)
    r = np.asarray(shares, dtype=float)
    if single_group(shard_groups):
        comm = communication(cluster)
        rho = float(r.max()) if len(r) else 0.0
        return Prices(np.full(len(r), comm.allgather(rho)), np.full(len(r), comm.reduce_scatter(rho))), np.zeros(len(r))
    groups = np.unique(np.asarray(shard_groups, dtype=np.int64), return_inverse=True)[1]
    return link_prices(cluster).ranks(groups, np.asarray(cluster.nodes, dtype=np.int64), r)


def evaluate_arrays(
    cluster: Cluster,
    batch_sizes: Sequence[int] | np.ndarray,
    num_micro_batches: Sequence[int] | np.ndarray,
    shares: Sequence[float] | np.ndarray,
    recompute: Sequence[bool] | np.ndarray | None = None,
    mode: Schedule = Schedule.LAYERED,
    kinds: tuple[list[DeviceCost], np.ndarray] | None = None,
    shard_groups: Sequence[int] | np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every rank's predicted step time (s), memory (GiB) and whether it fits, vectorised by kind.

    ``shard_groups``: every rank's shard group (None: one group of all); ``shares`` are then within
    each group, and each group's collectives are priced by :class:`LinkPrices`.
    """
    cluster = calibrated(cluster, np.zeros(len(batch_sizes), np.int64) if shard_groups is None else shard_groups)
    b = np.asarray(batch_sizes, dtype=np.int64)
    n = np.maximum(np.asarray(num_micro_batches, dtype=np.int64), 1)
    r = np.asarray(shares, dtype=float)
    keep = np.zeros(len(b), bool) if recompute is None else ~np.asarray(recompute, dtype=bool)
    prices, exposed = collective_ms(cluster, r, shard_groups)
    costs, of_rank = kinds if kinds is not None else kind_costs(cluster, mode)
    step = np.empty(len(b))
    memory = np.empty(len(b))
    limit = np.empty(len(b))
    m = np.where(b > 0, -(-b // n), 0)
    reserved = cluster.settings.reserved_memory_gb
    busy = np.zeros(len(b))  # contention-free compute ms, for the shared-host bound
    passes = np.empty((2, len(b)))  # per-layer forward and backward with collectives, for settings.sync_passes
    optimizer = np.empty(len(b))
    for k, cost in enumerate(costs):
        at = np.nonzero(of_rank == k)[0]
        if not len(at):
            continue
        passes[:, at] = cost.pass_ms(b[at], n[at], prices.at(at), keep[at])
        passes[1, at] += exposed[at]
        optimizer[at] = cost.optimizer_ms(r[at])
        step[at] = step_ms(cluster.settings, cost.num_layers * (passes[0, at] + passes[1, at]) + optimizer[at]) / 1e3
        if cluster.settings.host_cores:
            fwd, bwd = cost.compute_parts(b[at], n[at], keep[at])
            busy[at] = cost.num_layers * (fwd + bwd) + optimizer[at]
        used = cost.compute_memory(m[at]) + cost.extra_memory_gb(m[at], n[at], keep[at], b[at])
        memory[at] = used + reserved + cost.share_gb * r[at]
        limit[at] = cluster.settings.usable_memory_fraction * cost.device.memory_gb
    if cluster.settings.sync_passes:
        step = np.maximum(step, synced_group_ms(cluster, passes[0], passes[1], optimizer, shard_groups) / 1e3)
    if cluster.settings.host_cores:
        step = np.maximum(step, shared_host_floor_ms(cluster, busy) / 1e3)
    return step, memory, memory <= limit * (1 + 1e-9)


def evaluate(
    cluster: Cluster,
    batch_sizes: Sequence[int],
    num_micro_batches: Sequence[int],
    shares: Sequence[float],
    recompute: Sequence[bool] | None = None,
    mode: Schedule = Schedule.LAYERED,
    shard_groups: Sequence[int] | None = None,
) -> list[RankCost]:
    """The cost model applied to one assignment: every rank's predicted step time and memory
    (``shard_groups``: each rank's group, shares within it; None: one group)."""
    step, memory, fits = evaluate_arrays(cluster, batch_sizes, num_micro_batches, shares, recompute, mode,
                                         shard_groups=shard_groups)
    return [RankCost(float(s), float(m), bool(f)) for s, m, f in zip(step, memory, fits)]


def shared_host_floor_ms(cluster: Cluster, busy_ms: np.ndarray) -> float:
    """The shared-host bound on the step (ms; 0 without ``settings.host_cores``): the ranks' real compute
    (``busy_ms`` per rank, contention-free, divided by each rank's emulated slowdown) over the host's
    cores, plus the fixed per-step overhead."""
    cores = cluster.settings.host_cores
    if not cores:
        return 0.0
    real = np.asarray(busy_ms, dtype=float) / np.array([slowdown_of(d) for d in cluster.devices])
    return float(real.sum()) / cores + cluster.settings.step_overhead_ms


def synced_group_ms(cluster: Cluster, fwd: np.ndarray, bwd: np.ndarray, optimizer: np.ndarray,
                    shard_groups: Sequence[int] | np.ndarray | None) -> np.ndarray:
    """Every rank's step (ms) if each layer's pass ended together on its shard group: the group's
    slowest forward plus its slowest backward per layer (``fwd``, ``bwd``: per-layer pass times with
    their collectives) and its slowest optimizer step (``settings.sync_passes``; see the module)."""
    s = cluster.settings
    groups = np.zeros(len(fwd), np.int64) if shard_groups is None else np.asarray(shard_groups, dtype=np.int64)
    out = np.empty(len(fwd))
    for g in np.unique(groups):
        at = groups == g
        out[at] = step_ms(s, cluster.model.num_layers * (fwd[at].max() + bwd[at].max()) + optimizer[at].max())
    return out


def predicted_busy_s(cluster: Cluster, plan: Plan) -> list[float]:
    """Each rank's predicted compute seconds per step: its layers' forward and backward passes (with
    any recompute) and its optimizer step, which is what the runtime counts as busy (everything
    but collectives and waiting); a pipelined plan's from its stages (:func:`.pipeline_cost.busy_s`)."""
    cluster = calibrated(cluster)
    if plan.pipelined:
        return pipeline_busy_s(cluster, plan)
    out = []
    for device, rank in zip(cluster.devices, plan.ranks):
        cost = DeviceCost(device, cluster, plan.mode)
        fwd, bwd = cost.compute_ms(rank.batch_size, rank.num_micro_batches, rank.recompute)
        out.append((cost.num_layers * (fwd + bwd) + float(cost.optimizer_ms(rank.state_share))) / 1e3)
    return out
