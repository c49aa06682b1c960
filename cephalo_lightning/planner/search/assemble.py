"""Turn an assignment (batches, micro-batch counts, shares, recompute) into priced RankPlans."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cephalo_lightning._common.vocabulary import Schedule
from cephalo_lightning.planner.cost.cluster_cost import evaluate_arrays
from cephalo_lightning.planner.cost.device_cost import DeviceCost
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.plan import ModelSummary, RankPlan


def rank_plans(
    cluster: Cluster, batch: Sequence[int], micro: Sequence[int], shares: Sequence[float],
    recompute: Sequence[bool] | None = None, mode: Schedule = Schedule.LAYERED,
    kinds: tuple[list[DeviceCost], np.ndarray] | None = None,
    shard_groups: Sequence[int] | np.ndarray | None = None,
) -> tuple[tuple[RankPlan, ...], float]:
    """Every rank's plan priced by the cost model, and the predicted step time (s).

    ``shard_groups``: every rank's group (numbered 0, 1, ... by first rank; None: one group)."""
    b = np.asarray(batch, dtype=np.int64)
    n = np.where(b > 0, np.asarray(micro, dtype=np.int64), 1)
    r = np.asarray(shares, dtype=float)
    rc = np.ones(len(b), bool) if recompute is None else np.asarray(recompute, dtype=bool) | (b == 0)
    step, memory, _ = evaluate_arrays(cluster, b, n, r, rc, mode, kinds, shard_groups)
    groups = np.zeros(len(b), np.int64) if shard_groups is None else np.asarray(shard_groups, dtype=np.int64)
    fraction = cluster.settings.usable_memory_fraction
    m = np.where(b > 0, -(-b // n), 0)
    ranks = tuple(
        RankPlan(
            rank=rank,
            device=device.name,
            batch_size=int(bi),
            num_micro_batches=int(ni),
            micro_batch_size=int(mi),
            state_share=float(ri),
            predicted_step_s=float(si),
            predicted_memory_gb=float(gi),
            source=device.source,
            memory_limit_gb=fraction * device.memory_gb,
            memory_capacity_gb=device.memory_gb,
            recompute=bool(ci),
            shard_group=int(gr),
        )
        for rank, (device, bi, ni, mi, ri, si, gi, ci, gr) in enumerate(
            zip(cluster.devices, b.tolist(), n.tolist(), m.tolist(), r.tolist(), step.tolist(), memory.tolist(),
                rc.tolist(), groups.tolist()))
    )
    return ranks, float(step.max())


def model_summary(cluster: Cluster) -> ModelSummary:
    """What the plan records about the model and settings it was made for."""
    m = cluster.model
    return ModelSummary(m.name, m.parameters, m.trainable, m.num_layers, m.state_bytes_per_param,
                        m.weight_bytes_per_param)
