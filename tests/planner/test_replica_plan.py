"""Plans for fault tolerance (``plan(...)`` through :func:`replica_plan`, ``plan --fault-tolerance``): two or
more shard groups that cut the units alike, the fastest such grouping, or a refusal naming each grouping.

The reference is brute force over the groupings, each planned alone with the ordinary planner and
kept if the fault-tolerance check (:func:`check_groups_cut_alike`) accepts it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning._common.vocabulary import Grouping
from cephalo_lightning.planner import Plan, load_cluster, plan
from cephalo_lightning.planner.replica_groups import check_groups_cut_alike, replica_plan
from cephalo_lightning.planner.schema.planning_error import PlanningError

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = ROOT / "configs" / "clusters"


def _brute_force(cluster, batch: int) -> float | None:
    steps = []
    for name in Grouping:
        if name == Grouping.FULL:
            continue
        try:
            candidate = plan(cluster, batch, groupings=(name,))
            check_groups_cut_alike(candidate)
        except (PlanningError, ConfigurationError):
            continue
        if len(candidate.shard_groups) >= 2:
            steps.append(candidate.predicted_step_s)
    return min(steps) if steps else None


@pytest.mark.parametrize(("name", "batch"), [("a100x4-rtx3090x4-full-1b", 512), ("a100x4-rtx3090x4-full-1b", 64),
                                             ("two-nodes", 512)])
def test_the_plan_is_the_fastest_grouping_of_several_groups_cut_alike(name, batch):
    cluster = load_cluster(CLUSTERS / f"{name}.yaml")
    result = replica_plan(cluster, batch)
    assert len(result.shard_groups) >= 2 and result.global_batch_size == batch
    check_groups_cut_alike(result)  # what CephaloStrategy(fault_tolerance=True) checks at start
    assert result.predicted_step_s == pytest.approx(_brute_force(cluster, batch), rel=1e-12)


def test_one_node_is_refused_naming_every_grouping():
    cluster = load_cluster(CLUSTERS / "l4-a6000-p40.yaml")  # one node: a single group, or groups of other devices
    with pytest.raises(PlanningError) as err:
        replica_plan(cluster, 64)
    message = str(err.value)
    assert all(f"{g}:" in message for g in Grouping if g != Grouping.FULL)
    with pytest.raises(PlanningError, match="two or more shard groups"):
        replica_plan(cluster, 64, groupings=("full",))


def test_the_command_line_writes_a_plan_the_fault_tolerance_check_takes(tmp_path):
    from cephalo_lightning.planner.command import main

    out = tmp_path / "plan.json"
    assert main([str(CLUSTERS / "a100x4-rtx3090x4-full-1b.yaml"), "-b", "512", "--fault-tolerance", "-o", str(out)]) == 0
    written = Plan.load(out)
    check_groups_cut_alike(written)
    assert len(written.shard_groups) == 2 and json.loads(out.read_text())["global_batch_size"] == 512
