"""Re-planning a pinned plan for the ranks an elastic restart brings (``CephaloStrategy(elastic=True)``);
the restart itself, resumed exactly on fewer ranks, is in tests/test_preemption.py."""

from __future__ import annotations

from cephalo_lightning import Plan
from cephalo_lightning.lightning.elastic import replan_for_world
from cephalo_lightning.planner import RankPlan

PLAN3 = Plan(24, "layered", (RankPlan(0, "big", 12, 2, 6, 0.5), RankPlan(1, "mid", 8, 2, 4, 0.3),
                             RankPlan(2, "small", 4, 2, 2, 0.2)))


def test_the_ranks_left_keep_their_devices_figures_over_the_same_global_batch():
    plan = replan_for_world(PLAN3, ["big", "small"])  # "mid" left
    assert plan.global_batch_size == 24 and plan.planner == "elastic"
    assert plan.batch_sizes == [18, 6]  # 12 : 4, scaled to 24
    assert [r.micro_batch_size for r in plan.ranks] == [6, 2]  # each device's micro-batch size kept
    assert [r.num_micro_batches for r in plan.ranks] == [3, 3]
    assert [round(r.state_share, 6) for r in plan.ranks] == [round(0.5 / 0.7, 6), round(0.2 / 0.7, 6)]
    assert [r.device for r in plan.ranks] == ["big", "small"]


def test_a_device_the_plan_does_not_know_takes_the_plans_mean_and_more_ranks_split_the_batch():
    plan = replan_for_world(PLAN3, ["big", "mid", "small", "new"])  # one joined
    assert sum(plan.batch_sizes) == 24 and plan.batch_sizes == [9, 6, 3, 6]  # 12 : 8 : 4 : mean 8
    assert abs(sum(r.state_share for r in plan.ranks) - 1.0) < 1e-12
    single = replan_for_world(PLAN3, ["cpu"])
    assert single.batch_sizes == [24] and single.ranks[0].state_share == 1.0
