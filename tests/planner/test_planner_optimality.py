"""The planner is optimal: its plans against brute force over random small clusters (repeated gathers, a stash on
the device, a shared host, synced passes, layered mode), and the certified gap stays true."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from cephalo_lightning.planner import Cluster, Plan, PlanningError, cluster_from_dict, evaluate, load_cluster, plan, save_cluster
from cephalo_lightning.planner.schema.cluster import cluster_to_dict
from tests.planner_cases import FULL, check_plan, random_cluster
from tests.planner_reference import brute_force, rank_times


@pytest.mark.parametrize("seed", range(6))
def test_optimal_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    checked = 0
    for _ in range(60):
        world = rng.choice([1, 2, 2, 3, 3])
        cluster = random_cluster(rng, world)
        mode = rng.choice(["layered", "layered", "uniform"])
        batch = rng.randint(world if mode == "uniform" else 1, 9 if world == 3 else 12)
        best = brute_force(cluster, batch, mode)
        if best is None:
            with pytest.raises(PlanningError):
                plan(cluster, batch, mode, groupings=FULL)
            continue
        p = plan(cluster, batch, mode, groupings=FULL)  # one shard group: tests/planner/test_planner_groups.py weighs the others
        check_plan(cluster, p, batch)
        assert p.predicted_step_s <= best.step_s * 1.005, (cluster, batch, mode, best, p)
        assert p.predicted_step_s >= best.step_s * (1 - 1e-9)  # nothing beats the exhaustive optimum
        assert p.optimality_gap is not None and p.optimality_gap <= 0.005
        if mode == "uniform":
            assert len(set(p.num_micro_batches)) == 1 and min(p.batch_sizes) >= 1
        checked += 1
    assert checked >= 30  # most random clusters are plannable


@pytest.mark.parametrize("seed", range(2))
def test_repeated_gathers_at_a_fraction_optimal_against_brute_force(seed: int) -> None:
    """Uniform mode with a pass's later gathers of a layer at a fraction of the first (a calibrated
    cluster's ``repeated_gather_fraction``): the solver's bounds on the micro-batch count and the
    batch follow the fraction, so the plan is still the exhaustive optimum under the reference's price."""
    rng = random.Random(300 + seed)
    checked = 0
    for _ in range(40):
        world = rng.choice([2, 3])
        base = random_cluster(rng, world)
        settings = replace(base.settings, allgather_ms=rng.uniform(1, 30), reduce_scatter_ms=rng.uniform(0, 30),
                           repeated_gather_fraction=rng.choice([0.0, rng.uniform(0, 1)]), free_links=False)
        cluster = replace(base, settings=settings)
        batch = rng.randint(world, 9 if world == 3 else 12)
        best = brute_force(cluster, batch, "uniform")
        if best is None:
            continue
        p = plan(cluster, batch, "uniform", groupings=FULL)
        check_plan(cluster, p, batch)
        assert best.step_s * (1 - 1e-9) <= p.predicted_step_s <= best.step_s * 1.005, (cluster, batch, best, p)
        checked += 1
    assert checked >= 20


def test_repeated_gather_fraction_round_trips_through_a_cluster_file_and_refuses_a_bad_value(tmp_path: Path) -> None:
    data = cluster_to_dict(random_cluster(random.Random(5), 2))
    assert "repeated_gather_fraction" not in data["settings"]  # the default (1) is not written
    data["settings"]["repeated_gather_fraction"] = 0.25
    cluster = cluster_from_dict(data)
    assert cluster.settings.repeated_gather_fraction == 0.25
    save_cluster(cluster, tmp_path / "c.yaml")
    assert load_cluster(tmp_path / "c.yaml") == cluster
    data["settings"]["repeated_gather_fraction"] = 1.5
    with pytest.raises(PlanningError, match=r"settings.repeated_gather_fraction must be in \[0, 1\]"):
        cluster_from_dict(data)


def with_extras(cluster: Cluster, rng: random.Random, stash: bool, cores: bool) -> Cluster:
    """The same cluster with a stash kept on the device (bytes per sample of the order of a sample's
    compute memory) and / or every rank on one host of a few cores, emulated slowdowns 1 to 4."""
    from cephalo_lightning.planner.schema.cluster_spec import Emulation

    settings, model, devices = cluster.settings, cluster.model, cluster.devices
    if stash:
        settings = replace(settings, stash_on_device=True)
        model = replace(model, kept_bytes_per_sample=rng.uniform(0.02, 1.0) * 2**30)
    if cores:
        settings = replace(settings, host_cores=float(rng.choice([1, 2, 3])))
        slowdown = {d: rng.choice([1.0, 1.0, 2.0, 4.0]) for d in set(devices)}
        devices = tuple(replace(d, emulate=Emulation(slowdown=slowdown[d]), source="emulated") for d in devices)
    return replace(cluster, settings=settings, model=model, devices=devices)


@pytest.mark.parametrize("seed", range(4))
def test_stash_on_the_device_optimal_against_brute_force(seed: int) -> None:
    """The stash's memory grows with the batch: the solver stays exact against the exhaustive reference."""
    rng = random.Random(100 + seed)
    checked = binding = 0
    for _ in range(40):
        world = rng.choice([1, 2, 2, 3, 3])
        base = random_cluster(rng, world)
        cluster = with_extras(base, rng, stash=True, cores=False)
        batch = rng.randint(1, 9 if world == 3 else 12)
        best = brute_force(cluster, batch, "layered")
        if best is None:
            with pytest.raises(PlanningError):
                plan(cluster, batch, groupings=FULL)
            continue
        p = plan(cluster, batch, groupings=FULL)
        check_plan(cluster, p, batch)
        assert p.predicted_step_s <= best.step_s * 1.005, (cluster, batch, best, p)
        assert p.predicted_step_s >= best.step_s * (1 - 1e-9)
        assert p.optimality_gap is not None and p.optimality_gap <= 0.005
        free = brute_force(base, batch, "layered")  # the stash's memory changes some optima
        binding += free is None or free.step_s < best.step_s * (1 - 1e-9)
        checked += 1
    assert checked >= 15 and binding >= 1


@pytest.mark.parametrize("seed", range(4))
def test_shared_host_bound_keeps_the_certified_gap_true(seed: int) -> None:
    """Ranks on one host: every plan is priced at least at the shared-host bound (as the reference
    prices it), and the certified lower bound stays below the exhaustive optimum."""
    rng = random.Random(200 + seed)
    checked = binding = 0
    for _ in range(40):
        base, batch, mode = _random_instance(rng)
        cluster = with_extras(base, rng, stash=rng.random() < 0.3, cores=True)
        p = _planned_against_brute_force(cluster, batch, mode)
        if p is None:
            continue
        binding += p.predicted_step_s > max(r.predicted_step_s for r in plan(base, batch, mode, groupings=FULL).ranks) * (1 + 1e-9)
        checked += 1
    assert checked >= 15 and binding >= 1


def _random_instance(rng: random.Random) -> tuple[Cluster, int, str]:
    """A random cluster of 2-3 ranks, a global batch and a mode small enough to enumerate."""
    world = rng.choice([2, 2, 3, 3])
    base = random_cluster(rng, world)
    mode = rng.choice(["layered", "layered", "uniform"])
    return base, rng.randint(world if mode == "uniform" else 1, 9 if world == 3 else 12), mode


def _planned_against_brute_force(cluster: Cluster, batch: int, mode: str) -> Plan | None:
    """The plan of one group of every rank (None where nothing fits), checked against the exhaustive
    optimum under the same price: priced as the reference prices it, nothing beats the optimum, and
    the certified lower bound stays below it."""
    best = brute_force(cluster, batch, mode)
    if best is None:
        return None
    p = plan(cluster, batch, mode, groupings=FULL)
    check_plan(cluster, p, batch)
    assert p.optimality_gap is not None
    assert p.predicted_step_s / (1 + p.optimality_gap) <= best.step_s * (1 + 1e-9), (cluster, batch, mode, best, p)
    assert p.predicted_step_s >= best.step_s * (1 - 1e-9)  # nothing beats the exhaustive optimum
    return p


def _moved_step(cluster: Cluster, p, mode: str, i: int, j: int) -> float:
    """The plan's step with one sample moved from rank i to rank j (inf where a rank no longer fits)."""
    b = list(p.batch_sizes)
    b[i] -= 1
    b[j] += 1
    n = [1 if size == 0 else r.num_micro_batches for size, r in zip(b, p.ranks)]
    recompute = [r.recompute or size == 0 for size, r in zip(b, p.ranks)]
    costs = evaluate(cluster, b, n, p.state_shares, recompute, mode, [r.shard_group for r in p.ranks])
    return max(c.step_s for c in costs) if all(c.fits for c in costs) else float("inf")


@pytest.mark.parametrize("seed", range(2))
def test_where_the_shared_host_bound_binds_no_single_sample_moved_gives_a_faster_plan(seed: int) -> None:
    """The solve leaves the shared-host bound out; the plan is then refined on the exact price: no
    sample moved from one rank to another (same shares and micro-batch counts) is faster. (The solve
    alone left such moves in 16 of 124 random clusters more than 0.5% above the exhaustive optimum,
    the worst 2.5x; refined, 10, the worst 1.5x.)"""
    rng = random.Random(200 + seed)
    moved = 0
    for _ in range(40):
        world = rng.choice([2, 2, 3, 3])
        cluster = with_extras(random_cluster(rng, world), rng, stash=rng.random() < 0.3, cores=True)
        mode = rng.choice(["layered", "layered", "uniform"])
        batch = rng.randint(world if mode == "uniform" else 1, 9 if world == 3 else 12)
        try:
            p = plan(cluster, batch, mode, groupings=FULL)
        except PlanningError:
            continue
        least = 1 if mode == "uniform" else 0
        for i in range(world):
            if p.batch_sizes[i] <= least or (p.batch_sizes[i] - 1 < p.ranks[i].num_micro_batches
                                             and not (mode == "layered" and p.batch_sizes[i] == 1)):
                continue
            for j in range(world):
                if j != i:
                    assert _moved_step(cluster, p, mode, i, j) >= p.predicted_step_s * (1 - 1e-9), (cluster, p, i, j)
                    moved += 1
    assert moved >= 50


def test_synced_passes_keep_the_certified_gap_true() -> None:
    """Ranks of one group ending every pass together (settings.sync_passes): every plan is priced as
    the reference prices it (slowest forward + slowest backward), nothing beats the exhaustive
    optimum under that price, and the certified lower bound stays below it."""
    rng = random.Random(300)
    checked = binding = 0
    for _ in range(160):
        base, batch, mode = _random_instance(rng)
        p = _planned_against_brute_force(replace(base, settings=replace(base.settings, sync_passes=True)), batch, mode)
        if p is None:
            continue
        summed = rank_times(base, p.batch_sizes, p.num_micro_batches, p.state_shares,
                            [not r.recompute for r in p.ranks], p.mode)
        binding += p.predicted_step_s > max(summed) * (1 + 1e-9)
        checked += 1
    assert checked >= 60 and binding >= 5  # where the sync binds, the solve's own price is below the plan's


def test_synced_passes_price_a_group_by_its_slowest_forward_and_backward() -> None:
    """Two ranks whose passes differ: one group pays the slowest forward plus the slowest backward
    (every rank the group's step); data parallelism (a group each) and sync_passes off pay the sums."""
    data = {"model": {"name": "m", "num_layers": 3, "parameters": 1000},
            "settings": {"reserved_memory_gb": 0, "micro_batch_overhead_ms": 0, "sync_passes": True, "free_links": True},
            "devices": [{"name": "fwd-heavy", "memory_gb": 8, "layer_fwd_ms": [6.0], "layer_bwd_ms": [4.0],
                         "compute_memory_gb": [0.1]},
                        {"name": "bwd-heavy", "memory_gb": 8, "layer_fwd_ms": [2.0], "layer_bwd_ms": [8.0],
                         "compute_memory_gb": [0.1]}]}
    synced = cluster_from_dict(data)
    summed = replace(synced, settings=replace(synced.settings, sync_passes=False))
    # one sample each, recomputing: fwd = F, bwd = F + B -> (6, 10) and (2, 10) per layer
    args = ([1, 1], [1, 1], [0.5, 0.5], [True, True], "layered")
    assert [c.step_s for c in evaluate(summed, *args)] == pytest.approx([3 * 16 / 1e3, 3 * 12 / 1e3])
    assert [c.step_s for c in evaluate(synced, *args)] == pytest.approx([3 * (6 + 10) / 1e3] * 2)
    # keeping the graph on the second rank: fwd 2, bwd 8 -> its sum 10, the group's passes 6 + 10
    kept = ([1, 1], [1, 1], [0.5, 0.5], [True, False], "layered")
    assert [c.step_s for c in evaluate(summed, *kept)] == pytest.approx([3 * 16 / 1e3, 3 * 10 / 1e3])
    assert [c.step_s for c in evaluate(synced, *kept)] == pytest.approx([3 * 16 / 1e3] * 2)
    args_fwd_heavy_keeps = ([1, 1], [1, 1], [0.5, 0.5], [False, True], "layered")  # (6, 4) and (2, 10)
    assert max(c.step_s for c in evaluate(summed, *args_fwd_heavy_keeps)) == pytest.approx(3 * 12 / 1e3)
    assert max(c.step_s for c in evaluate(synced, *args_fwd_heavy_keeps)) == pytest.approx(3 * (6 + 10) / 1e3)
    assert max(c.step_s for c in evaluate(synced, *args_fwd_heavy_keeps, shard_groups=[0, 1])) == pytest.approx(
        3 * 12 / 1e3)  # data parallelism: no per-layer collective joins the two ranks' passes
    assert cluster_to_dict(synced)["settings"]["sync_passes"] is True
    assert "sync_passes" not in cluster_to_dict(summed)["settings"]  # files written before it read the same
    with pytest.raises(PlanningError, match="sync_passes"):
        cluster_from_dict({**data, "settings": {"sync_passes": "yes"}})


def test_shared_host_bound_costs_nothing_without_a_core_count() -> None:
    """Without host_cores (one device per rank) the bound is absent: plans and prices as before."""
    rng = random.Random(7)
    for _ in range(10):
        cluster = random_cluster(rng, 3)
        emulated = with_extras(cluster, rng, stash=False, cores=True)
        no_cores = replace(emulated, settings=replace(emulated.settings, host_cores=None))
        a, b = plan(cluster, 9, groupings=FULL), plan(no_cores, 9, groupings=FULL)
        assert (a.batch_sizes, a.num_micro_batches, a.state_shares) == (b.batch_sizes, b.num_micro_batches, b.state_shares)
        assert a.predicted_step_s == b.predicted_step_s and a.optimality_gap == b.optimality_gap


def test_layered_with_four_gpus_against_brute_force() -> None:
    rng = random.Random(99)
    for _ in range(6):
        cluster = random_cluster(rng, 4)
        batch = rng.randint(1, 7)
        best = brute_force(cluster, batch)
        if best is None:
            continue
        p = plan(cluster, batch, groupings=FULL)
        check_plan(cluster, p, batch)
        assert p.predicted_step_s <= best.step_s * 1.005
