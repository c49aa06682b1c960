"""Pipelined plans and idle ranks in the plan file: round trip, version-4 files, refusals by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cephalo_lightning._common.vocabulary import PipelineSchedule
from cephalo_lightning.planner import ModelSummary, Plan, PlanningError, RankPlan


def _rank(rank: int, batch: int, micro: int, share: float, stage: int, pipeline: int, group: int) -> RankPlan:
    return RankPlan(rank, "a100-40gb", batch, micro, -(-batch // micro), share, stage=stage, pipeline=pipeline,
                    shard_group=group)


def pipelined(**change: Any) -> Plan:
    """Two pipelines of two stages over four ranks, plus an idle fifth: stage 0 on ranks 0 and 1 (group 0),
    stage 1 on ranks 2 and 3 (group 1); pipeline 0 takes 10 samples, pipeline 1 takes 6."""
    ranks = [_rank(0, 10, 5, 0.6, 0, 0, 0), _rank(1, 6, 3, 0.4, 0, 1, 0),
             _rank(2, 10, 5, 0.5, 1, 0, 1), _rank(3, 6, 3, 0.5, 1, 1, 1),
             RankPlan(4, "rtx3090", 0, 1, 0, 0.0, idle=True)]
    fields: dict[str, Any] = dict(stage_layers=(3, 5), pipeline_schedule=PipelineSchedule.ONE_F_ONE_B,
                                  model=ModelSummary(num_layers=8))
    fields.update(change)
    return Plan(16, "layered", tuple(ranks), **fields)


def test_a_pipelined_plan_round_trips_through_its_file(tmp_path: Path) -> None:
    plan = pipelined()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert json.loads(path.read_text())["format_version"] == 5
    again = Plan.load(path)
    assert again == plan
    assert again.pipelined and again.num_stages == 2 and again.pipeline_schedule is PipelineSchedule.ONE_F_ONE_B
    assert again.pipelines == ((0, 2), (1, 3))
    assert again.idle_ranks == (4,)
    assert again.shard_groups == ((0, 1), (2, 3))


def test_a_plan_without_pipelines_or_idle_ranks_is_written_and_read_as_version_4() -> None:
    plan = Plan.even(4, 8)
    data = plan.to_dict()
    assert data["format_version"] == 4
    assert "stage_layers" not in data and "stage" not in data["ranks"][0] and "idle" not in data["ranks"][0]
    again = Plan.from_dict(data)
    assert again == plan and not again.pipelined and again.num_stages == 1 and again.pipelines == ((0,), (1,), (2,), (3,))


def test_a_version_4_file_naming_a_version_5_field_is_refused() -> None:
    data = Plan.even(2, 4).to_dict()
    data["ranks"][0]["stage"] = 1
    with pytest.raises(PlanningError, match=r"ranks\[0\]: unknown field\(s\) \['stage'\]"):
        Plan.from_dict(data)


def _with_rank(index: int, **change: Any) -> Plan:
    plan = pipelined()
    ranks = list(plan.ranks)
    values = dict(vars(ranks[index]))
    values.update(change)
    ranks[index] = RankPlan(**values)
    return Plan(plan.global_batch_size, plan.mode, tuple(ranks), stage_layers=plan.stage_layers,
                pipeline_schedule=plan.pipeline_schedule, model=plan.model)


@pytest.mark.parametrize("build, message", [
    (lambda: pipelined(pipeline_schedule=None), r"needs a pipeline_schedule, one of \('gpipe', '1f1b'\)"),
    (lambda: pipelined(stage_layers=(4, 5)), r"stage_layers \[4, 5\] sum to 9, not the model's 8 layers"),
    (lambda: _with_rank(3, stage=0, shard_group=0, state_share=0.0),
     r"rank 3: pipeline 1 already has rank 1 at stage 0"),
    (lambda: _with_rank(2, stage=2), r"rank 2: stage 2 but the plan has 2 stages"),
    (lambda: _with_rank(3, batch_size=6, num_micro_batches=2, micro_batch_size=3),
     r"rank 3 \(pipeline 1, stage 1\) has batch_size 6 and 2 micro-batches but rank 1"),
    (lambda: _with_rank(1, shard_group=1, state_share=1.0),
     r"rank 1 .* is in shard group 1 with rank 2 \(stage 1\)|rank 2 \(stage 1\) is in shard group 1 with rank 1"),
    (lambda: _with_rank(4, batch_size=1, micro_batch_size=1),
     r"rank 4 is idle but has batch_size 1"),
    (lambda: Plan(16, "layered", tuple(RankPlan(**{**vars(r), "pipeline": 2 * r.pipeline}) for r in pipelined().ranks),
                  stage_layers=(3, 5), pipeline_schedule="gpipe"), r"pipelines are numbered \[0, 2\]"),
    (lambda: Plan(8, "layered", Plan.even(2, 8).ranks, pipeline_schedule=PipelineSchedule.GPIPE),
     r"names a pipeline_schedule \(gpipe\) but no stage_layers"),
])
def test_an_inconsistent_pipelined_plan_is_refused_naming_the_rank_and_the_fix(build, message) -> None:
    with pytest.raises(PlanningError, match=message) as raised:
        build()
    assert "re-make the plan" in str(raised.value)


def test_a_pipeline_missing_a_stage_is_refused() -> None:
    ranks = (_rank(0, 4, 1, 1.0, 0, 0, 0), _rank(1, 4, 1, 1.0, 1, 0, 1), _rank(2, 4, 1, 1.0, 0, 1, 2))
    with pytest.raises(PlanningError, match=r"pipeline 1 has no rank at stage\(s\) \[1\]"):
        Plan(8, "layered", ranks, stage_layers=(1, 1), pipeline_schedule="gpipe")


def test_the_global_batch_of_a_pipelined_plan_counts_each_pipeline_once() -> None:
    with pytest.raises(PlanningError, match=r"the pipelines' batches sum to 16, not the global batch 32"):
        Plan(32, "layered", pipelined().ranks, stage_layers=(3, 5), pipeline_schedule="1f1b")


def test_a_file_with_a_bad_stage_field_is_refused() -> None:
    data = pipelined().to_dict()
    data["pipeline_schedule"] = "zero-bubble"
    with pytest.raises(PlanningError, match=r"pipeline_schedule must be one of \('gpipe', '1f1b'\), got 'zero-bubble'"):
        Plan.from_dict(data)
    data = pipelined().to_dict()
    data["stage_layers"] = [3, 0, 5]
    with pytest.raises(PlanningError, match=r"stage_layers must be a list of whole numbers >= 1"):
        Plan.from_dict(data)
    data = pipelined().to_dict()
    data["ranks"][4]["idle"] = "yes"
    with pytest.raises(PlanningError, match=r"ranks\[4\]\.idle \(rank 4\) must be true or false"):
        Plan.from_dict(data)


def test_an_idle_rank_is_in_no_shard_group() -> None:
    ranks = (RankPlan(0, "t4", 0, 1, 0, 0.0, idle=True), RankPlan(1, "t4", 4, 1, 4, 1.0))
    plan = Plan(4, "layered", ranks)
    assert plan.shard_groups == ((1,),) and plan.num_shard_groups == 1 and plan.idle_ranks == (0,)
    assert Plan.from_dict(plan.to_dict()) == plan
