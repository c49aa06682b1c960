"""Shard groups as replica groups (fault tolerance): the torch-free arithmetic of who trains what.

A plan's shard groups ``g_0 .. g_{m-1}`` are the replica groups. At step ``s`` the quorum names the
participants ``p_0 .. p_{n-1}``; the global batch of ``B`` samples is split over them by the re-plan
over the participants (:func:`survivors_batches`: the planner on the cluster file's profiles of their
devices, else :func:`~.replan.replan_for_world` on :func:`group_plan`): participant ``k`` trains on
samples ``[o_k, o_k + b_k)`` with ``o`` the prefix sums of ``b`` and ``sum(b) = B``
(:class:`StepSlice`), and inside a group rank ``r`` on its part of ``b_k`` apportioned by the
in-group plan's batches (:func:`rank_slice`), keeping its micro-batch count (:func:`step_rank_plan`).
Rank ``i`` of every group must hold the same range of every unit (:func:`check_groups_cut_alike`):
torchft reduces rank ``i`` of every group with rank ``i`` of the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning._common.vocabulary import Grouping, Schedule
from cephalo_lightning.planner.planning import plan as make_plan
from cephalo_lightning.planner.replan import apportion, replan, replan_for_world
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.plan import Plan, RankPlan
from cephalo_lightning.planner.schema.planning_error import PlanningError


def check_groups_cut_alike(plan: Plan) -> None:
    """Refuse a plan whose shard groups cut the units at different points: torchft's replica groups
    reduce rank ``i`` of every group with rank ``i`` of the others, so rank ``i`` must hold the same
    range of every unit in every group (equal group sizes, equal shares in group order)."""
    groups = plan.shard_groups
    shares = [tuple(plan.ranks[r].state_share for r in g) for g in groups]  # a layout is a function of these
    if len({len(g) for g in groups}) > 1 or len(set(shares)) > 1:
        raise ConfigurationError(
            f"fault tolerance needs every shard group to cut the units alike (rank i of every group holds the same "
            f"range), but the plan's groups {[list(g) for g in groups]} have in-group shares {shares}; plan one "
            "shard group per node of identical devices (equal groups, equal shares), or run without fault tolerance")


def replica_plan(cluster: Cluster, global_batch_size: int, mode: Schedule = Schedule.LAYERED,
                 groupings: Sequence[str] | None = None) -> Plan:
    """The fastest plan whose shard groups can be torchft's replica groups: two or more groups that
    cut the units alike (:func:`check_groups_cut_alike`), over ``groupings`` (None: every grouping of
    several groups; one group of every rank has no replica to survive its loss). Each grouping is
    planned on its own and kept only if its groups cut alike (nodes of the same devices, in the same
    order, do); a :class:`PlanningError` names why each was refused when none is."""
    names = [g for g in (groupings or tuple(Grouping)) if g != Grouping.FULL]
    if not names:
        raise PlanningError("fault tolerance needs two or more shard groups, one replica each; weigh a grouping of "
                            f"several groups ({', '.join(g for g in Grouping if g != Grouping.FULL)}), not only "
                            f"{Grouping.FULL}")
    best: Plan | None = None
    refused: list[str] = []
    for name in names:
        try:
            candidate = make_plan(cluster, global_batch_size, mode, groupings=(name,))
            if len(candidate.shard_groups) < 2:
                raise PlanningError("one shard group (the cluster has one node, or nodes too small to split)")
            check_groups_cut_alike(candidate)
        except (PlanningError, ConfigurationError) as err:
            refused.append(f"{name}: {str(err).split(';')[0]}")
            continue
        if best is None or (candidate.predicted_step_s or math.inf) < (best.predicted_step_s or math.inf):
            best = candidate
    if best is None:
        raise PlanningError("no plan of several shard groups cutting the units alike, as fault tolerance needs ("
                            + "; ".join(refused) + "); give the nodes the same devices in the same order, or train "
                            "without fault tolerance")
    return best


def local_plan(plan: Plan, group: int) -> Plan:
    """What one group's ``Trainer`` shards by: the group's ranks, numbered from 0 as one shard group,
    their batches the global batch apportioned by the group's own (the loader gives every rank the
    whole global batch; :func:`step_rank_plan` sizes each step's part once the quorum is known)."""
    members = [plan.ranks[r] for r in plan.shard_groups[group]]
    sizes = apportion(plan.global_batch_size, [r.batch_size for r in members])
    ranks = tuple(step_rank_plan(replace(r, rank=i, shard_group=0), size) for i, (r, size) in enumerate(zip(members, sizes)))
    return replace(plan, ranks=ranks)


def step_rank_plan(rank: RankPlan, size: int) -> RankPlan:
    """``rank`` training ``size`` samples this step: its micro-batch count kept where the samples allow it."""
    count = min(max(rank.num_micro_batches, 1), size)
    return replace(rank, batch_size=size, num_micro_batches=count, micro_batch_size=-(-size // count) if count else 0)


def group_plan(plan: Plan) -> Plan:
    """The plan seen one shard group at a time: one rank per group, named by the group's first rank's
    device, with the group's batch; what the re-plan over the surviving groups starts from."""
    ranks = []
    for g, members in enumerate(plan.shard_groups):
        first = plan.ranks[members[0]]
        batch = sum(plan.ranks[r].batch_size for r in members)
        ranks.append(RankPlan(g, first.device, batch, 1, batch, 1.0, shard_group=g))
    return Plan(plan.global_batch_size, plan.mode, tuple(ranks), model=plan.model, planner=plan.planner,
                emulated=plan.emulated)


def survivors_batches(plan: Plan, participants: Sequence[int], cluster: Cluster | None = None) -> tuple[tuple[int, ...], str]:
    """Each participating group's samples of the global batch (``participants``: group indices, in the
    quorum's order; the sum is the global batch), and how they were planned, for the log.

    With ``cluster`` profiling every device of the participants' ranks: the planner's plan for those
    ranks (:func:`~.replan.replan`, as an elastic restart re-plans), each group taking its ranks'
    batches, with the planner's predicted step time (for its own sharding of those devices; the
    groups keep theirs). Otherwise the plan's own per-group figures (:func:`~.replan.replan_for_world`
    on :func:`group_plan`)."""
    members = [plan.shard_groups[g] for g in participants]
    devices = [plan.ranks[r].device for ranks in members for r in ranks]
    if cluster is not None and set(devices) <= {d.name for d in cluster.devices}:
        new, _ = replan(None, cluster, devices, plan.global_batch_size, plan.mode)
        batches, at = [], 0
        for ranks in members:
            batches.append(sum(r.batch_size for r in new.ranks[at:at + len(ranks)]))
            at += len(ranks)
        predicted = f", predicted step {new.predicted_step_s:.3f} s" if new.predicted_step_s is not None else ""
        return tuple(batches), f"from the cluster file's profiles{predicted}"
    groups = group_plan(plan)
    new = replan_for_world(groups, [groups.ranks[g].device for g in participants])
    return tuple(new.batch_sizes), "from the plan's own per-group figures"


@dataclass(frozen=True)
class StepSlice:
    """This group's part of step ``step``'s global batch: samples ``[start, start + size)`` of it."""

    step: int
    start: int
    size: int
    participants: tuple[int, ...]  # the groups in the quorum, in its order
    batches: tuple[int, ...]  # each participant's samples, the re-plan over them


def rank_slice(part: StepSlice, weights: Sequence[float], rank: int) -> tuple[int, int]:
    """This rank's samples of its group's ``part``: ``(start, size)`` in the global batch, the group's
    samples apportioned over its ranks in proportion to ``weights`` (the in-group plan's batches)."""
    sizes = apportion(part.size, weights)
    return part.start + sum(sizes[:rank]), sizes[rank]
