"""Re-plans: a pinned plan made for another world size, re-planned for the ranks present (torch-free).

When an elastic launcher (torchrun ``--nnodes MIN:MAX``) restarts the job with fewer or more
ranks, a plan pinned for the old membership no longer fits. With ``CephaloStrategy(elastic=True)``
it is re-planned instead of refused, always over the same global batch (so the sequence of global
batches, and a resume, stay exact):

* **from the cluster file** (``cluster=``, alone or beside a pinned plan) when every present device
  is in it: the planner solves again for the profiles of the devices present (:func:`replan`; a
  device that appears twice reuses its profile; the file's calibration, fitted on another
  membership, is left out), memory checked and shard groups chosen as for any plan;
* **from the plan's own figures** otherwise (:func:`replan_for_world`): each present rank takes the
  figures of a rank of the same device in the old plan (its batch, micro-batch size and state
  share; a device the plan does not know takes the plan's mean), batches are apportioned in
  proportion to them, each rank keeps its device's micro-batch size (more micro-batches when its
  batch grows), and state shares are re-normalised, in one shard group. Memory is not re-checked: the warning says so
  and names the planned alternative (``CephaloCallback``, which profiles the devices present at
  every start, from its cache for devices it has seen).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from cephalo_lightning._common.vocabulary import Planner, Schedule
from cephalo_lightning.planner.planning import plan as make_plan
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.plan import Plan, RankPlan
from cephalo_lightning.planner.schema.planning_error import PlanningError


def replan(plan: Plan | None, cluster: Cluster | None, devices: Sequence[str], global_batch_size: int,
           mode: Schedule) -> tuple[Plan, str]:
    """The plan for ranks on ``devices`` (one name per present rank, in rank order) and the warning
    that says how it was made: from ``cluster`` when it profiles every present device, else from
    ``plan``'s figures. Raises ``PlanningError`` when neither can (a device the cluster file does
    not profile and no plan), or when the devices present cannot hold the model."""
    old = plan.world_size if plan is not None else cluster.world_size if cluster is not None else None
    head = f"Cephalo: the plan is for {old} ranks but the job has {len(devices)} (an elastic restart): re-planned"
    unknown = sorted(set(devices) - {d.name for d in cluster.devices}) if cluster is not None else []
    if cluster is not None and not unknown:
        present = cluster_for_devices(cluster, devices)
        try:
            new = make_plan(present, global_batch_size, mode=mode)
        except PlanningError as err:
            raise PlanningError(f"{head[len('Cephalo: '):]} from the cluster file failed for the devices present "
                                f"{list(devices)}: {err}") from err
        return new, (f"{head} from the cluster file's profiles for the devices present (elastic=True): batches "
                     f"{new.batch_sizes}, state shares {[round(r.state_share, 4) for r in new.ranks]}, the global "
                     f"batch unchanged ({new.global_batch_size}), shard groups {[list(g) for g in new.shard_groups]}")
    if plan is None:
        known = sorted({d.name for d in cluster.devices}) if cluster is not None else []
        raise PlanningError(
            f"an elastic restart on {len(devices)} ranks cannot be planned: the cluster file has no profile of "
            f"{unknown} (it profiles {known}); add CephaloCallback() to profile the devices present (profiles it "
            "has cached are not measured again), or add their profiles to the cluster file")
    new = replan_for_world(plan, devices)
    why = f" ({unknown} not in the cluster file)" if unknown else ""
    return new, (f"{head} from the plan's own per-device figures{why} (elastic=True): batches {new.batch_sizes}, "
                 f"state shares {[round(r.state_share, 4) for r in new.ranks]}, the global batch unchanged "
                 f"({new.global_batch_size}), one shard group. Device memory was not re-checked: add "
                 "CephaloCallback() to profile and plan for the devices present at every start")


def cluster_for_devices(cluster: Cluster, devices: Sequence[str]) -> Cluster:
    """``cluster`` cut to the ranks on ``devices`` (every name must be one of its devices'): each
    rank takes the file's next unused profile of its name, a repeated one when all are used. The
    calibration is dropped: its per-rank terms were fitted on the old membership."""
    by_name: dict[str, list] = {}
    for device in cluster.devices:
        by_name.setdefault(device.name, []).append(device)
    used: dict[str, int] = {}
    chosen = []
    for name in devices:
        profiles = by_name[name]
        chosen.append(profiles[min(used.get(name, 0), len(profiles) - 1)])
        used[name] = used.get(name, 0) + 1
    return replace(cluster, devices=tuple(chosen), calibration=None)


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
    batches = apportion(plan.global_batch_size, [f[0] for f in figures])
    shares = [f[1] for f in figures]
    total_share = sum(shares)
    ranks = []
    for rank, (name, batch, share, (_, _, micro)) in enumerate(zip(devices, batches, shares, figures)):
        count = max(1, math.ceil(batch / micro)) if batch else 1
        ranks.append(RankPlan(rank, name, batch, count, math.ceil(batch / count) if batch else 0,
                              share / total_share if total_share > 0 else 1 / len(devices)))
    return Plan(plan.global_batch_size, plan.mode, tuple(ranks), model=plan.model, planner=Planner.ELASTIC,
                emulated=plan.emulated)


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders; equal weights when all are 0)."""
    weights = list(weights) if any(w > 0 for w in weights) else [1.0] * len(weights)
    scale = total / sum(weights)
    exact = [w * scale for w in weights]
    out = [math.floor(x) for x in exact]
    for i in sorted(range(len(out)), key=lambda i: exact[i] - out[i], reverse=True)[: total - sum(out)]:
        out[i] += 1
    return out

