"""The shipped example clusters plan within memory, heterogeneity pays, the upper bound is above every plan, and
collectives are priced from bandwidth and the uneven shares."""

from __future__ import annotations

import random

import pytest

from cephalo_lightning.planner import PlanningError, cluster_from_dict, load_cluster, plan
from tests.planner_cases import CLUSTERS, check_plan, random_cluster, yaml_dict


@pytest.mark.parametrize("name", ["t4-example.yaml", "l4-a6000-p40.yaml", "a100x2-v100x2.yaml", "hetero-64.yaml"])
@pytest.mark.parametrize("batch", [1, 64, 1000])
def test_example_clusters_plan_within_memory(name: str, batch: int) -> None:
    cluster = load_cluster(CLUSTERS / name)
    p = plan(cluster, batch)
    check_plan(cluster, p, batch)
    assert p.optimality_gap <= 0.005
    assert p.upper_bound_samples_per_s >= p.predicted_samples_per_s * (1 - 1e-9)
    for base in p.baselines.values():  # baselines are feasible layered plans: never better
        if base.feasible:
            assert p.predicted_samples_per_s >= base.predicted_samples_per_s * (1 - 1e-3)
        else:
            assert base.reason


def test_heterogeneity_is_exploited() -> None:
    """The brief's cluster: the fast big A6000 gets most samples and state, the slow P40 mostly state."""
    cluster = load_cluster(CLUSTERS / "l4-a6000-p40.yaml")
    p = plan(cluster, 256)
    by = {r.device: r for r in p.ranks}
    assert by["a6000"].batch_size > by["l4"].batch_size > by["p40"].batch_size
    assert by["p40"].state_share > 1 / p.world_size  # state where the memory is idle
    assert p.predicted_samples_per_s > 5 * p.baselines["even"].predicted_samples_per_s
    assert p.predicted_samples_per_s > p.baselines["proportional"].predicted_samples_per_s


def test_upper_bound_above_every_plan() -> None:
    rng = random.Random(5)
    for _ in range(25):
        cluster = random_cluster(rng, rng.randint(1, 5))
        batch = rng.randint(1, 40)
        try:
            p = plan(cluster, batch)
        except PlanningError:
            continue
        assert p.upper_bound_samples_per_s >= p.predicted_samples_per_s * (1 - 1e-9)
        assert 0 < p.fraction_of_upper_bound <= 1 + 1e-9


def test_collectives_priced_from_bandwidth_and_uneven_shares() -> None:
    """Slow links push toward even shares; the certified gap stays within the tolerance."""
    data = yaml_dict("l4-a6000-p40.yaml")
    data["settings"]["link_bandwidth"] = "0.5 GB/s per rank"
    slow = cluster_from_dict(data)
    p = plan(slow, 32)
    check_plan(slow, p, 32)
    assert p.optimality_gap <= 0.005
    fast = plan(load_cluster(CLUSTERS / "l4-a6000-p40.yaml"), 32)
    assert max(p.state_shares) <= max(fast.state_shares) + 1e-9
    assert p.predicted_step_s > fast.predicted_step_s
