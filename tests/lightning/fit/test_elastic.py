"""Re-planning for the ranks an elastic restart brings (``CephaloStrategy(elastic=True)``): a pinned
plan from its own figures, or from the cluster file beside it; the restart resumed exactly on fewer
ranks is in tests/lightning/fit/test_preemption.py, the torchrun run that loses and regains a node in
tests/lightning/fit/test_elastic_torchrun.py."""

from __future__ import annotations

import warnings

import pytest
import torch

from cephalo_lightning import CephaloStrategy, Plan
from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning.planner import PlanningError, cluster_from_dict, plan
from cephalo_lightning.planner.replan import replan, replan_for_world
from tests import helpers
from tests.distributed import run_distributed
from tests.elastic_cluster import BIG, BIG_AND_SMALL, CLUSTER3, MID, SMALL, layered_cluster, layered_device
from tests.lightning_models import TinyLayered, token_data
from tests.plans import plan_of
from tests.sgd_run import SEED

PLAN3 = plan_of(batches=[12, 8, 4], micro=[2, 2, 2], shares=[0.5, 0.3, 0.2], devices=["big", "mid", "small"])


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


def test_the_samples_left_over_go_to_the_largest_remainders():
    plan = plan_of(batches=[7, 2, 1], micro=[1, 1, 1], shares=[0.7, 0.2, 0.1])
    # 10 x 7/9 = 7.78 and 10 x 2/9 = 2.22: floors 7 + 2, the sample left goes to the remainder 0.78
    assert replan_for_world(plan, ["a", "b"]).batch_sizes == [8, 2]
    # 10 x 7/9 = 7.78, 10 x 1/9 = 1.11 twice: floors 7 + 1 + 1, the sample left goes to 0.78
    assert replan_for_world(plan, ["a", "c", "c"]).batch_sizes == [8, 1, 1]
    # 10 x 2/5 = 4 twice, 10 x 1/5 = 2: no remainder, nothing moves
    assert replan_for_world(plan, ["b", "b", "c"]).batch_sizes == [4, 4, 2]


# ----------------------------------------------------------------------------- re-planned from the cluster file

PINNED3 = plan_of(batches=[6, 4, 2], micro=[2, 2, 1], shares=[1.0, 0.6, 0.4], devices=[BIG, MID, SMALL], groups=[0, 1, 1])


def test_a_cluster_file_replans_the_devices_present_from_their_profiles_and_groups():
    new, warning = replan(PINNED3, cluster_from_dict(CLUSTER3), [BIG, SMALL], 12, "layered")
    # independently: the planner on a file that lists only the two devices present
    want = plan(cluster_from_dict(BIG_AND_SMALL), 12, "layered")
    assert new.batch_sizes == want.batch_sizes and [r.state_share for r in new.ranks] == [r.state_share for r in want.ranks]
    assert [r.device for r in new.ranks] == [BIG, SMALL] and new.global_batch_size == 12
    assert new.shard_groups == want.shard_groups  # the planner's grouping for the two, not the pinned plan's
    assert new.batch_sizes != replan_for_world(PINNED3, [BIG, SMALL]).batch_sizes  # the profiles decided, not the plan
    assert "the plan is for 3 ranks but the job has 2 (an elastic restart)" in warning
    assert "from the cluster file's profiles" in warning and f"shard groups {[list(g) for g in want.shard_groups]}" in warning
    twice, _ = replan(None, cluster_from_dict(CLUSTER3), [BIG, BIG], 12, "layered")  # a device's profile serves both
    assert twice.batch_sizes == [6, 6] and [r.device for r in twice.ranks] == [BIG, BIG]


def test_a_device_the_cluster_file_does_not_profile_falls_back_to_the_plan_or_is_refused_by_name():
    cluster = cluster_from_dict(CLUSTER3)
    new, warning = replan(PINNED3, cluster, [BIG, "cpu (emulated x1.0, 9 GiB)"], 12, "layered")
    assert new.batch_sizes == replan_for_world(PINNED3, [BIG, "cpu (emulated x1.0, 9 GiB)"]).batch_sizes
    assert "from the plan's own per-device figures (['cpu (emulated x1.0, 9 GiB)'] not in the cluster file)" in warning
    assert "Device memory was not re-checked" in warning
    with pytest.raises(PlanningError, match=r"no profile of \['cpu \(emulated x1.0, 9 GiB\)'\].*CephaloCallback"):
        replan(None, cluster, [BIG, "cpu (emulated x1.0, 9 GiB)"], 12, "layered")


def test_devices_present_that_cannot_hold_the_model_are_refused_with_the_planners_reason():
    tiny = layered_cluster([layered_device(BIG, 3.0, 1.0), {**layered_device(SMALL, 1.0, 6.0), "memory_gb": 1e-6}])
    with pytest.raises(PlanningError, match=r"re-planned from the cluster file failed for the devices present"):
        replan(None, cluster_from_dict(tiny), [SMALL], 12, "layered")


def test_a_plan_beside_a_cluster_file_needs_elastic():
    with pytest.raises(ConfigurationError, match=r"elastic=True"):
        CephaloStrategy(plan=PINNED3, cluster=cluster_from_dict(CLUSTER3))
    CephaloStrategy(plan=PINNED3, cluster=cluster_from_dict(CLUSTER3), elastic=True)


def _two_of_three(rank: int, world: int, which: str):
    warnings.simplefilter("always")
    emulate = [{"slowdown": 1.0, "memory_gb": 3.0}, {"slowdown": 1.0, "memory_gb": 1.0}]
    given = {"pinned plan": {"plan": PINNED3}, "cluster only": {"global_batch_size": 12}}[which]
    strategy = CephaloStrategy(cluster=cluster_from_dict(CLUSTER3), elastic=True, emulate=emulate, seed=SEED, **given)
    t = helpers.trainer(strategy, world, 2, precision="64-true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(TinyLayered(), torch.utils.data.DataLoader(token_data(48), batch_size=12, shuffle=True))
    said = [str(w.message) for w in caught if "elastic restart" in str(w.message)]
    return {"plan": t.strategy.plan.to_dict(), "warnings": said, "step": t.global_step}


@pytest.mark.multiprocess
@pytest.mark.parametrize("which", ["pinned plan", "cluster only"])
def test_an_elastic_start_on_fewer_ranks_than_the_cluster_file_plans_for_the_devices_present(which):
    """Two ranks (a big and a small emulated device) of a three-device cluster file, with the
    3-rank plan pinned beside it or the file alone: re-planned from the two devices' profiles, with
    the warning (rank 0's), and trained."""
    results = run_distributed(_two_of_three, 2, which)
    want = plan(cluster_from_dict(BIG_AND_SMALL), 12, "layered")
    for rank, result in enumerate(results):
        got = Plan.from_dict(result["plan"])
        assert got.batch_sizes == want.batch_sizes and [r.device for r in got.ranks] == [BIG, SMALL], rank
        assert got.shard_groups == want.shard_groups and result["step"] == 2
    assert len(results[0]["warnings"]) == 1 and "from the cluster file's profiles" in results[0]["warnings"][0]
    assert results[1]["warnings"] == []  # rank 0 warns for the job
