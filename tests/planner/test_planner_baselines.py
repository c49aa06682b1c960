"""Uniform mode (one micro-batch count for all, the unsharded gradient paid for) and the even and proportional
baselines, with why a baseline is infeasible."""

from __future__ import annotations

import json

import pytest

from cephalo_lightning.planner import Plan, PlanningError, cluster_from_dict, load_cluster, plan
from cephalo_lightning.planner.report import render_plan
from tests.planner_cases import CLUSTERS, check_plan, small_cluster


def test_uniform_mode_one_count_for_all() -> None:
    cluster = load_cluster(CLUSTERS / "a100x2-v100x2.yaml")
    u = plan(cluster, 64, mode="uniform")
    check_plan(cluster, u, 64)
    assert u.mode == "uniform" and len(set(u.num_micro_batches)) == 1 and min(u.batch_sizes) >= 1
    assert all(r.recompute for r in u.ranks)  # the uniform mode has no recompute to skip
    assert Plan.from_dict(json.loads(u.to_json())) == u


def test_uniform_mode_pays_for_the_unsharded_gradient() -> None:
    """With more than one micro-batch the uniform mode keeps the whole model's gradient unsharded
    (compute dtype, 2 bytes a parameter here) until the last one."""
    cluster = load_cluster(CLUSTERS / "l4-a6000-p40.yaml")
    u = plan(cluster, 64, mode="uniform")
    check_plan(cluster, u, 64)
    grads = 2 * cluster.model.parameters / 2**30
    # a share: the state, and the reduce-scatter's two shards of a layer (4-byte gradients)
    state = (16 + 8 / cluster.model.num_layers) * cluster.model.parameters / 2**30
    for r, device in zip(u.ranks, cluster.devices):
        assert r.num_micro_batches > 1
        without = device.compute_memory_gb[0] + (r.micro_batch_size - 1) * (
            device.compute_memory_gb[1] - device.compute_memory_gb[0]) + 2.0 + state * r.state_share
        assert r.predicted_memory_gb == pytest.approx(without + grads)
    one = plan(cluster, 4, mode="uniform")  # one sample each, one micro-batch: nothing accumulates
    assert one.num_micro_batches == [1, 1, 1, 1]


def test_baselines_even_and_proportional() -> None:
    cluster = load_cluster(CLUSTERS / "l4-a6000-p40.yaml")
    even = plan(cluster, 66, planner="even")
    assert even.planner == "even" and sorted(even.batch_sizes) == [16, 16, 17, 17]
    assert len(set(even.num_micro_batches)) == 1 and set(even.state_shares) == {0.25}
    check_plan(cluster, even, 66)
    prop = plan(cluster, 66, planner="proportional")
    by = {r.device: r.batch_size for r in prop.ranks}
    assert by["a6000"] > by["l4"] > by["p40"] and set(prop.state_shares) == {0.25}
    check_plan(cluster, prop, 66)
    assert plan(cluster_from_dict(small_cluster()), 66, mode="uniform", planner="even").mode == "uniform"
    with pytest.raises(PlanningError, match="no uniform form"):
        plan(cluster, 66, mode="uniform", planner="proportional")
    cephalo = plan(cluster, 66)
    assert cephalo.baselines["even"].predicted_samples_per_s == pytest.approx(even.predicted_samples_per_s)
    assert cephalo.baselines["proportional"].predicted_step_s == pytest.approx(prop.predicted_step_s)


def test_infeasible_baseline_says_why() -> None:
    cluster = load_cluster(CLUSTERS / "a100x2-v100x2.yaml")
    p = plan(cluster, 32)
    even = p.baselines["even"]
    assert not even.feasible and even.predicted_samples_per_s is None
    assert "rank 2 (v100-16gb)" in even.reason and "1/4 of the state" in even.reason
    with pytest.raises(PlanningError, match="even baseline is infeasible"):
        plan(cluster, 32, planner="even")
    assert "infeasible: rank 2" in render_plan(p)
