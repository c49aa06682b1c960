"""Elastic restarts: a pinned plan made for another world size, re-planned for the ranks present.

When an elastic launcher (torchrun ``--nnodes MIN:MAX``) restarts the job with fewer or more
ranks, a plan pinned for the old membership no longer fits. With ``CephaloStrategy(elastic=True)``
it is re-planned from its own figures instead of refused: each present rank takes the figures of a
rank of the same device in the old plan (its batch, micro-batch size and state share; a device the
plan does not know takes the plan's mean), batches are apportioned in proportion to them over the
same global batch (so the sequence of global batches, and a resume, stay exact), each rank keeps its
device's micro-batch size (more micro-batches when its batch grows), and state shares are
re-normalised. Memory is not re-checked: the strategy warns and names the planned alternative
(``CephaloCallback``, which profiles the devices present at every start).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from cephalo_lightning.planner import Plan, RankPlan


def replan_for_world(plan: Plan, devices: Sequence[str]) -> Plan:
    """``plan`` re-planned for ranks on ``devices`` (one name per present rank, in rank order)."""
    by_device: dict[str, list[RankPlan]] = {}
    for rank in plan.ranks:
        by_device.setdefault(rank.device, []).append(rank)
    mean = (sum(r.batch_size for r in plan.ranks) / plan.world_size, sum(r.state_share for r in plan.ranks) /
            plan.world_size, max(1, round(sum(r.micro_batch_size for r in plan.ranks) / plan.world_size)))
    figures = []
    for name in devices:
        same = by_device.get(name)
        if same:
            figures.append((sum(r.batch_size for r in same) / len(same), sum(r.state_share for r in same) / len(same),
                            max(1, max(r.micro_batch_size for r in same))))
        else:
            figures.append(mean)
    batches = _apportion(plan.global_batch_size, [f[0] for f in figures])
    shares = [f[1] for f in figures]
    total_share = sum(shares)
    ranks = []
    for rank, (name, batch, share, (_, _, micro)) in enumerate(zip(devices, batches, shares, figures)):
        count = max(1, math.ceil(batch / micro)) if batch else 1
        ranks.append(RankPlan(rank, name, batch, count, math.ceil(batch / count) if batch else 0,
                              share / total_share if total_share > 0 else 1 / len(devices)))
    return Plan(plan.global_batch_size, plan.mode, tuple(ranks), model=dict(plan.model), planner="elastic",
                emulated=plan.emulated)


def _apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders; equal weights when all are 0)."""
    weights = list(weights) if any(w > 0 for w in weights) else [1.0] * len(weights)
    scale = total / sum(weights)
    exact = [w * scale for w in weights]
    out = [math.floor(x) for x in exact]
    for i in sorted(range(len(out)), key=lambda i: exact[i] - out[i], reverse=True)[: total - sum(out)]:
        out[i] += 1
    return out


def describe(old: Plan, new: Plan) -> str:
    return (f"Cephalo: the plan is for {old.world_size} ranks but the job has {new.world_size} (an elastic restart): "
            f"re-planned from the plan's own per-device figures (elastic=True): batches {new.batch_sizes}, state "
            f"shares {[round(r.state_share, 4) for r in new.ranks]}, the global batch unchanged "
            f"({new.global_batch_size}). Device memory was not re-checked: add CephaloCallback() to profile and plan "
            "for the devices present at every start")
