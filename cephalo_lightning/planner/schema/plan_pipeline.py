"""A pipelined plan's structure, and the ranks a plan leaves out: the checks and the file fields.

A pipelined plan cuts the model's L layers into S contiguous stages, ``stage_layers = (l_0, ...,
l_{S-1})`` with ``sum l_s = L``. Its active ranks form D pipelines of S ranks, rank (d, s) computing
stage s for pipeline d:

    global_batch_size = sum_d B_d          (B_d: every rank of pipeline d has batch_size B_d)
    num_micro_batches is M_d on every rank of pipeline d
    the ranks of one stage form that stage's shard groups (shares sum to 1 per group)

An idle rank has batch 0, share 0, one micro-batch, no stage, pipeline or shard group (all 0).

[Note: one rank per stage] Pipeline d holds exactly one rank of every stage: activations go from
rank (d, s) to rank (d, s + 1) point to point, so a chain with a gap or two ranks of one stage
has no order to run in. A shard group that mixes stages would shard two different sets of layers
as one, so every group's ranks share their stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cephalo_lightning._common.vocabulary import PipelineSchedule, values_of
from cephalo_lightning.planner.schema.planning_error import REMAKE, PlanningError


def pipeline_fields_from_dict(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``stage_layers`` and ``pipeline_schedule`` from a plan file (absent: not pipelined)."""
    found: dict[str, Any] = {}
    layers = data.get("stage_layers")
    if layers is not None:
        if not isinstance(layers, list) or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in layers):
            raise PlanningError(f"{where}: stage_layers must be a list of whole numbers >= 1 (the layers of each "
                                f"stage, in order), got {layers!r}; {REMAKE}")
        found["stage_layers"] = tuple(layers)
    schedule = data.get("pipeline_schedule")
    if schedule is not None:
        if schedule not in values_of(PipelineSchedule):
            raise PlanningError(f"{where}: pipeline_schedule must be one of {values_of(PipelineSchedule)}, got "
                                f"{schedule!r}; {REMAKE}")
        found["pipeline_schedule"] = PipelineSchedule(schedule)
    return found


def validate_pipeline(plan: Any) -> None:
    """The structure of idle ranks, stages and pipelines (``plan`` is a :class:`~.plan.Plan`)."""
    for r in plan.ranks:
        if r.idle and (r.batch_size or r.state_share or r.num_micro_batches != 1 or r.stage or r.pipeline
                       or r.shard_group):
            raise PlanningError(
                f"rank {r.rank} is idle but has batch_size {r.batch_size}, state_share {r.state_share:g}, "
                f"num_micro_batches {r.num_micro_batches}, stage {r.stage}, pipeline {r.pipeline}, shard_group "
                f"{r.shard_group}: an idle rank computes and stores nothing (0, 0, 1, 0, 0, 0); {REMAKE}")
    active = [r for r in plan.ranks if not r.idle]
    if not active:
        raise PlanningError(f"every rank of the plan is idle; at least one must compute; {REMAKE}")
    if not plan.stage_layers:
        if plan.pipeline_schedule is not None:
            raise PlanningError(f"the plan names a pipeline_schedule ({plan.pipeline_schedule}) but no stage_layers; "
                                f"give both or neither; {REMAKE}")
        for r in active:
            if r.stage or r.pipeline:
                raise PlanningError(f"rank {r.rank}: stage {r.stage}, pipeline {r.pipeline} in a plan that is not "
                                    f"pipelined (no stage_layers); set both to 0 or {REMAKE}")
        return
    _validate_stages(plan, active)


def _validate_stages(plan: Any, active: list[Any]) -> None:
    stages = len(plan.stage_layers)
    if plan.pipeline_schedule is None:
        raise PlanningError(f"a pipelined plan (stage_layers {list(plan.stage_layers)}) needs a pipeline_schedule, "
                            f"one of {values_of(PipelineSchedule)}; {REMAKE}")
    if plan.model.num_layers is not None and sum(plan.stage_layers) != plan.model.num_layers:
        raise PlanningError(f"stage_layers {list(plan.stage_layers)} sum to {sum(plan.stage_layers)}, not the "
                            f"model's {plan.model.num_layers} layers; {REMAKE}")
    chains: dict[int, dict[int, Any]] = {}
    for r in active:
        if r.stage >= stages:
            raise PlanningError(f"rank {r.rank}: stage {r.stage} but the plan has {stages} stages (0 to {stages - 1}); "
                                f"{REMAKE}")
        chain = chains.setdefault(r.pipeline, {})
        if r.stage in chain:
            raise PlanningError(f"rank {r.rank}: pipeline {r.pipeline} already has rank {chain[r.stage].rank} at stage "
                                f"{r.stage}; a pipeline holds one rank per stage [Note: one rank per stage]; {REMAKE}")
        chain[r.stage] = r
    if sorted(chains) != list(range(len(chains))):
        raise PlanningError(f"pipelines are numbered {sorted(chains)}; number them 0, 1, ... {len(chains) - 1} or "
                            f"{REMAKE}")
    total = 0
    for d, chain in sorted(chains.items()):
        missing = [s for s in range(stages) if s not in chain]
        if missing:
            raise PlanningError(f"pipeline {d} has no rank at stage(s) {missing}; every pipeline needs one rank per "
                                f"stage [Note: one rank per stage]; {REMAKE}")
        first = chain[0]
        for r in chain.values():
            if (r.batch_size, r.num_micro_batches) != (first.batch_size, first.num_micro_batches):
                raise PlanningError(
                    f"rank {r.rank} (pipeline {d}, stage {r.stage}) has batch_size {r.batch_size} and "
                    f"{r.num_micro_batches} micro-batches but rank {first.rank} of the same pipeline has "
                    f"{first.batch_size} and {first.num_micro_batches}: a pipeline's ranks share its batch and its "
                    f"micro-batches; {REMAKE}")
        total += first.batch_size
    if total != plan.global_batch_size:
        raise PlanningError(f"the pipelines' batches sum to {total}, not the global batch {plan.global_batch_size}; "
                            f"{REMAKE}")
    group_stage: dict[int, Any] = {}
    for r in active:
        other = group_stage.setdefault(r.shard_group, r)
        if other.stage != r.stage:
            raise PlanningError(f"rank {r.rank} (stage {r.stage}) is in shard group {r.shard_group} with rank "
                                f"{other.rank} (stage {other.stage}): a shard group holds one stage's state; give "
                                f"each stage its own groups or {REMAKE}")
