"""Calibration: the cluster file's measured terms, how the planner prices them, and the fit that finds them."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from cephalo_lightning.planner import PlanningError, cluster_from_dict, load_cluster, plan, save_cluster
from cephalo_lightning.planner.cost.calibration import with_calibration
from cephalo_lightning.planner.cost.calibration_fit import StepObservation, fit_calibration, predicted, predicted_collective_s
from cephalo_lightning.planner.schema.calibration_terms import Calibration
from cephalo_lightning.planner.schema.cluster import cluster_to_dict
from cephalo_lightning.planner.schema.plan import Plan
from cephalo_lightning.planner.search.assemble import rank_plans
from tests.planner_cases import INJECTED, calibration_cluster, calibration_device, random_cluster, random_grouped_cluster
from tests.planner_reference import brute_force, calibrated_by_hand, rank_times

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = [ROOT / "configs" / "clusters" / name for name in ("a100x2-v100x2.yaml", "t4-example.yaml", "l4-a6000-p40.yaml")]
# the fit's own convergence on exact data (its prior weighs 1e-6): well under a 1e-9 float floor times
# the conditioning of the terms, far under any change the terms make
FIT_TOL = 1e-5

FULL = ("full",)  # one shard group of every rank, which the one-group references enumerate


PLANS = ((12, "layered"), (24, "layered"), (6, "uniform"), (18, "uniform"), (3, "layered"))


@pytest.fixture(scope="module")
def plans() -> list[Any]:
    """Plans of the profile alone that differ in batch, micro-batch counts, shares and mode (planned once)."""
    cluster = cluster_from_dict(calibration_cluster())
    return [plan(cluster, b, mode, groupings=FULL) for b, mode in PLANS]


def _observe(truth, plans) -> list[StepObservation]:
    """Spans the cost model with the injected terms produces (what a run measuring them exactly would)."""
    out = []
    for p in plans:
        step, busy = predicted(truth, p)
        contention = truth.calibration.host_contention  # the compute regions' wall time per busy second
        out.append(StepObservation(p, step, tuple(busy), tuple(b * contention for b in busy)))
    return out


@pytest.mark.parametrize("sync_passes", [False, True])
def test_fit_recovers_injected_terms_exactly(plans: list[Any], sync_passes: bool) -> None:
    data = calibration_cluster()
    data["settings"]["sync_passes"] = sync_passes
    cluster = cluster_from_dict(data)
    assert any(max(r.num_micro_batches for r in p.ranks) > 1 for p in plans)  # the overhead shows
    truth = with_calibration(cluster, INJECTED)
    if sync_passes:  # with a plan whose passes the sync prices above its slowest rank's sum: the fastest
        # device's forward is the slowest, and four micro-batches' overheads make another's backward the slowest
        ranks, step = rank_plans(cluster, [11, 3, 5], [1, 1, 4], [0.34, 0.33, 0.33])
        plans = [*plans, Plan(19, "layered", ranks, step, 19 / step)]
        summed = with_calibration(cluster_from_dict(calibration_cluster()), INJECTED)
        assert predicted(truth, plans[-1])[0] > predicted(summed, plans[-1])[0] * 1.01
    fitted = fit_calibration(cluster, _observe(truth, plans))
    for name in ("step_overhead_ms", "micro_batch_overhead_ms", "allgather_ms", "reduce_scatter_ms", "overlap",
                 "host_contention"):
        assert getattr(fitted, name) == pytest.approx(getattr(INJECTED, name), rel=FIT_TOL), name
    assert fitted.compute_scale == pytest.approx(INJECTED.compute_scale, rel=FIT_TOL)
    assert fitted.steps == len(plans) and fitted.source == "measured"


def test_fit_on_one_plan_predicts_it_and_keeps_the_profile_where_it_cannot_tell(plans: list[Any]) -> None:
    cluster = cluster_from_dict(calibration_cluster())
    truth = with_calibration(cluster, INJECTED)
    one = plans[0]
    fitted = fit_calibration(cluster, _observe(truth, [one]) * 3)
    calibrated = with_calibration(cluster, fitted)
    step, busy = predicted(calibrated, one)
    true_step, true_busy = predicted(truth, one)
    assert step == pytest.approx(true_step, rel=FIT_TOL) and busy == pytest.approx(true_busy, rel=FIT_TOL)
    assert fitted.compute_scale == pytest.approx(INJECTED.compute_scale, rel=FIT_TOL)  # busy spans tell each rank
    # every rank runs one micro-batch here: nothing measures the overhead, the profile's value stays
    assert fitted.micro_batch_overhead_ms == pytest.approx(1.0, rel=FIT_TOL)


def test_measured_collectives_tell_them_from_a_fixed_cost_on_one_plan(plans: list[Any]) -> None:
    """One plan's steps fix the step overhead plus the exposed collectives, not the two apart; the
    time inside the collectives (the rank that waits least) does, so a plan whose compute hides less
    of them (one sample per rank) is predicted too."""
    cluster = cluster_from_dict(calibration_cluster())
    # the profile's overlap and micro-batch overhead: one plan of one micro-batch per rank cannot tell them
    truth = with_calibration(cluster, replace(INJECTED, overlap=0.6, micro_batch_overhead_ms=1.0))
    one, more = plans[2], plan(cluster, 3, "uniform", groupings=FULL)
    assert one.mode == "uniform" and max(r.num_micro_batches for r in one.ranks) == 1
    assert list(more.batch_sizes) == [1, 1, 1]  # a layer's compute shorter than its collectives
    observed = [replace(o, collective_s=predicted_collective_s(truth, one)) for o in _observe(truth, [one])] * 3
    fitted = fit_calibration(cluster, observed)
    assert fitted.allgather_ms == pytest.approx(INJECTED.allgather_ms, rel=FIT_TOL)
    assert fitted.reduce_scatter_ms == pytest.approx(INJECTED.reduce_scatter_ms, rel=FIT_TOL)
    assert fitted.step_overhead_ms == pytest.approx(INJECTED.step_overhead_ms, rel=FIT_TOL)
    assert predicted(with_calibration(cluster, fitted), more)[0] == pytest.approx(predicted(truth, more)[0], rel=FIT_TOL)
    # without the collectives' spans the same steps charge them to the fixed cost, which no compute
    # hides: the other plan is mispredicted
    blind = fit_calibration(cluster, [replace(o, collective_s=None) for o in observed])
    assert abs(predicted(with_calibration(cluster, blind), more)[0] / predicted(truth, more)[0] - 1) > 0.01


def test_a_calibration_of_either_mode_prices_the_other_with_a_passs_later_gathers_as_profiled(
        plans: list[Any]) -> None:
    """What a layer's first gather in a pass costs beyond the profiled transfer (the ranks' wait for
    each other) comes once per pass in both modes: a calibration fitted on either mode's steps prices
    the other's plans, a uniform pass's later gathers at the profiled gather. Priced by the reference
    on the cluster written out by hand, and apart from pricing every gather at the fitted figure."""
    data = calibration_cluster()
    cluster = cluster_from_dict(data)
    layered, uniform = plans[0], plan(cluster, 24, "uniform", groupings=FULL)
    assert min(r.num_micro_batches for r in uniform.ranks) > 1  # later gathers to price
    truth = with_calibration(cluster, replace(INJECTED, overlap=0.6, micro_batch_overhead_ms=1.0))
    for fitted_on, other in ((layered, uniform), (uniform, layered)):
        observed = [replace(o, collective_s=predicted_collective_s(truth, fitted_on)) for o in _observe(truth, [fitted_on])]
        fitted = fit_calibration(cluster, observed * 3)
        assert fitted.mode == fitted_on.mode and fitted.allgather_ms == pytest.approx(9.0, rel=FIT_TOL)
        calibrated = with_calibration(cluster, fitted)
        by_hand = calibrated_by_hand(data, fitted.as_dict())
        assert by_hand.settings.repeated_gather_fraction == pytest.approx(6.0 / 9.0, rel=FIT_TOL)
        for p in (fitted_on, other):
            keep = [not r.recompute for r in p.ranks]
            expected = max(rank_times(by_hand, p.batch_sizes, p.num_micro_batches, p.state_shares, keep, p.mode))
            assert predicted(calibrated, p)[0] == pytest.approx(expected, rel=1e-9)
    every_gather = replace(by_hand, settings=replace(by_hand.settings, repeated_gather_fraction=1.0))
    keep = [not r.recompute for r in uniform.ranks]
    assert max(rank_times(every_gather, uniform.batch_sizes, uniform.num_micro_batches, uniform.state_shares, keep,
                          "uniform")) > predicted(calibrated, uniform)[0] * 1.01


def test_old_cluster_files_price_as_before(plans: list[Any]) -> None:
    for path in CLUSTERS:
        cluster = load_cluster(path)
        assert cluster.calibration is None
        data = cluster_to_dict(cluster)
        assert "calibration" not in data and "step_overhead_ms" not in data["settings"]
        assert cluster_from_dict(data) == cluster
    # a calibration that restates the profile changes no prediction
    cluster = cluster_from_dict(calibration_cluster())
    same = Calibration(0.0, 1.0, 6.0, 6.0, 0.6, (1.0, 1.0, 1.0))
    for p in plans:
        (step, busy), (step0, busy0) = predicted(with_calibration(cluster, same), p), predicted(cluster, p)
        assert step == pytest.approx(step0, rel=1e-12) and busy == pytest.approx(busy0, rel=1e-12)
    assert plan(with_calibration(cluster, same), 12, groupings=FULL).to_dict() == plans[0].to_dict()


def test_collective_prices_refuse_a_cluster_still_carrying_its_calibration() -> None:
    """Collective prices read a cluster's settings as they stand: a cluster whose calibration is not
    folded in yet is refused (the profile's figures would price it silently), the folded one is priced
    with the fitted terms."""
    from cephalo_lightning.planner.cost.calibration import calibrated
    from cephalo_lightning.planner.cost.collective_prices import communication, link_prices

    cluster = with_calibration(cluster_from_dict(calibration_cluster()), INJECTED)
    for price in (communication, link_prices):
        with pytest.raises(PlanningError, match="still carries its calibration"):
            price(cluster)
    folded = communication(calibrated(cluster))  # one node: the fitted figures as they are
    assert (folded.allgather_ms, folded.reduce_scatter_ms, folded.overlap) == (9.0, 9.0, 0.3)


def test_calibration_block_round_trips_and_plans_the_same(tmp_path: Path) -> None:
    cluster = with_calibration(cluster_from_dict(calibration_cluster()),
                               replace(INJECTED, steps=8, fitted_on="B=12 layered", mode="layered",
                                       shard_groups=(0, 0, 0)))
    path = tmp_path / "calibrated.yaml"
    save_cluster(cluster, path)
    assert "calibration:" in path.read_text() and "source: measured" in path.read_text()
    loaded = load_cluster(path)
    assert loaded == cluster
    assert plan(loaded, 12).to_dict() == plan(cluster, 12).to_dict()


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(compute_scale=[1.0, 1.0]), r"calibration.compute_scale has 2 entries but the cluster has 3"),
    (lambda c: c.pop("overlap"), r"calibration is missing \['overlap'\]"),
    (lambda c: c.update(overlap=1.5), r"calibration.overlap must be in \[0, 1\]"),
    (lambda c: c.update(step_overhead_ms=-1), r"calibration.step_overhead_ms must be >= 0"),
    (lambda c: c.update(source="guessed"), r"calibration.source must be one of"),
    (lambda c: c.update(host_contention=0.5), r"calibration.host_contention must be >= 1"),
    (lambda c: c.update(scale=2), r"calibration: unknown key\(s\) \['scale'\]"),
    (lambda c: c.update(mode="both"), r"calibration.mode must be one of \('layered', 'uniform'\)"),
    (lambda c: c.update(shard_groups=[0, 1]), r"calibration.shard_groups must list every rank's group \(3 entries"),
    (lambda c: c.update(shard_groups=[0, -1, 1]), r"calibration.shard_groups\[1\] must be"),
])
def test_bad_calibration_block_names_the_field(change, message: str) -> None:
    data = calibration_cluster()
    block = INJECTED.as_dict()
    change(block)
    data["calibration"] = block
    with pytest.raises(PlanningError, match=message):
        cluster_from_dict(data)


@pytest.mark.parametrize("seed", range(1))
def test_calibrated_plans_optimal_against_brute_force(seed: int) -> None:
    """The solver on a calibrated cluster against enumeration on the same terms written out by hand;
    the certified gap stays a true bound."""
    rng = random.Random(100 + seed)
    checked = 0
    for _ in range(30):
        world = rng.choice([2, 2, 3])
        data = cluster_to_dict(random_cluster(rng, world))
        block = {"step_overhead_ms": rng.choice([0.0, 5.0, 80.0]), "micro_batch_overhead_ms": rng.choice([0.0, 3.0]),
                 "allgather_ms": rng.uniform(0, 20), "reduce_scatter_ms": rng.uniform(0, 20),
                 "overlap": rng.choice([0.0, 0.5, 1.0]), "compute_scale": [rng.uniform(0.5, 3) for _ in range(world)],
                 "host_contention": rng.choice([1.0, 2.5])}
        fitted_mode = rng.choice([None, "layered", "uniform"])  # recorded only: the collectives price both modes
        if fitted_mode is not None:
            block["mode"] = fitted_mode
        mode = rng.choice(["layered", "layered", "uniform"])
        batch = rng.randint(world if mode == "uniform" else 1, 9 if world == 3 else 11)
        cluster = cluster_from_dict({**data, "calibration": block})
        by_hand = calibrated_by_hand(data, block)
        best = brute_force(by_hand, batch, mode)
        if best is None:
            with pytest.raises(PlanningError):
                plan(cluster, batch, mode, groupings=FULL)
            continue
        p = plan(cluster, batch, mode, groupings=FULL)
        keep = [not r.recompute for r in p.ranks]
        times = rank_times(by_hand, p.batch_sizes, p.num_micro_batches, p.state_shares, keep, p.mode)
        assert p.predicted_step_s == pytest.approx(max(times), rel=1e-9)
        assert best.step_s * (1 - 1e-9) <= p.predicted_step_s <= best.step_s * 1.005
        assert p.optimality_gap is not None and p.optimality_gap <= 0.005
        assert p.predicted_step_s / (1 + p.optimality_gap) <= best.step_s * (1 + 1e-9)  # the bound holds
        checked += 1
    assert checked >= 15


def test_a_calibration_of_one_grouping_plans_optimally_over_groupings_against_brute_force() -> None:
    """A calibration fitted on one grouping's steps prices that grouping's collectives; the planner,
    weighing every grouping, prices each as the calibration does (the others by the profile's
    collectives) and finds the optimum of enumeration over the groupings, each written out by hand."""
    from tests.planner_reference import brute_force_groups, candidate_groupings

    rng = random.Random(7)
    checked = distinct = 0
    for _ in range(40):
        world = rng.choice([2, 3, 4])
        cluster = random_grouped_cluster(rng, world)
        if cluster.num_nodes > 1:  # across nodes the fold also rescales both bandwidths (tested below)
            continue
        data = cluster_to_dict(cluster)
        groupings = candidate_groupings(cluster)
        fitted_groups = rng.choice(groupings)
        block = {"step_overhead_ms": rng.choice([0.0, 20.0]), "micro_batch_overhead_ms": rng.choice([0.0, 3.0]),
                 "allgather_ms": rng.uniform(0, 40), "reduce_scatter_ms": rng.uniform(0, 40),
                 "overlap": rng.choice([0.0, 0.5, 1.0]), "compute_scale": [rng.uniform(0.5, 2) for _ in range(world)],
                 "shard_groups": list(fitted_groups)}
        mode = rng.choice(["layered", "uniform"])
        block["mode"] = rng.choice([mode, mode, "uniform" if mode == "layered" else "layered"])
        batch = rng.randint(world if mode == "uniform" else 1, 6 if world == 4 else 8)
        calibrated = cluster_from_dict({**data, "calibration": block})
        bests = []
        for groups in groupings:
            by_hand = calibrated_by_hand(data, block, groups)
            best = brute_force_groups(by_hand, batch, mode, groupings=[groups])
            if best is not None:
                bests.append(best)
        if not bests:
            with pytest.raises(PlanningError):
                plan(calibrated, batch, mode)
            continue
        best = min(bests, key=lambda b: b.step_s)
        p = plan(calibrated, batch, mode)
        assert p.predicted_step_s == pytest.approx(predicted(calibrated, p)[0], rel=1e-12)
        assert best.step_s * (1 - 1e-9) <= p.predicted_step_s <= best.step_s * 1.005, (block, batch, mode, best, p)
        assert p.optimality_gap is not None and p.predicted_step_s / (1 + p.optimality_gap) <= best.step_s * (1 + 1e-9)
        checked += 1
        distinct += len({round(b.step_s, 12) for b in bests}) > 1
    assert checked >= 10 and distinct >= 5


@pytest.mark.parametrize("groups", [[0, 0, 1, 1], [0, 1, 2, 3], [0, 0, 0, 0]])
def test_a_calibration_across_nodes_keeps_each_group_on_its_own_link(groups: list[int]) -> None:
    """The fitted collectives are the world's figures. On a cluster of two nodes a group inside a node
    still moves its bytes over the intra-node link: a calibration that fits the profile's own figures
    prices every grouping as the profile does, one that fits them twice as slow every grouping at twice
    the price (a fitted 0 stays 0 and is not derived from a bandwidth)."""
    from cephalo_lightning.planner.cost.cluster_cost import collective_ms

    data = calibration_cluster()
    data["devices"].append(calibration_device("c", 3.0, 2.0))
    for device, node in zip(data["devices"], (0, 0, 1, 1)):
        device["node"] = node
    data["settings"].update(link_bandwidth_gbps=100.0, inter_node_bandwidth_gbps=5.0)
    cluster = cluster_from_dict(data)
    shares = [1.0 / groups.count(g) for g in groups]
    same = Calibration(step_overhead_ms=0.0, micro_batch_overhead_ms=1.0, allgather_ms=6.0, reduce_scatter_ms=6.0,
                       overlap=0.6, compute_scale=(1.0,) * 4)
    def figures(priced: Any) -> list[Any]:  # every rank's all-gather, reduce-scatter, exposed
        prices, exposed = collective_ms(priced, shares, groups)
        return [prices.ag, prices.rs, exposed]

    profile = figures(cluster)
    again = figures(with_calibration(cluster, same))
    for a, b in zip(profile, again):
        assert a.tolist() == pytest.approx(b.tolist(), rel=1e-12)
    # collectives that ran twice as slow as profiled: every grouping's collectives twice the price, the
    # cross-group reduction over the inter-node link included
    slower = figures(with_calibration(cluster, replace(same, allgather_ms=12.0, reduce_scatter_ms=12.0)))
    for a, b in zip(profile, slower):
        assert (2 * a).tolist() == pytest.approx(b.tolist(), rel=1e-12)
    nothing = figures(with_calibration(cluster, replace(same, allgather_ms=0.0, reduce_scatter_ms=0.0)))
    if len(set(groups)) == 1:
        assert max(part.max() for part in nothing) < 1e-5


def test_a_data_parallel_plan_measures_its_all_reduce_not_the_gathers_of_one_group() -> None:
    """Groups of one rank gather nothing: their collective is the gradient's all-reduce across the
    replicas, 2 (G - 1) / G of a layer's gradient per rank and layer over the world's link (here 2 x
    the reduce-scatter's per-layer time of the world as one group, whose ranks each move 2/3 of a
    layer), started in the backward pass, which hides ``overlap`` of it (it is shorter than every
    rank's backward compute here) except for the last bucket's, which follows the backward: the host
    is blocked for the rest. Fitted from such steps, the collectives keep their injected size, so
    another data-parallel plan is predicted as the truth prices it; a plan that shards (one group)
    issues other collectives, which no step measured: the profile's price them."""
    cluster = cluster_from_dict(calibration_cluster())
    # the profile's overlap and micro-batch overhead: one plan of one micro-batch per rank cannot tell them
    truth = with_calibration(cluster, replace(INJECTED, overlap=0.6, micro_batch_overhead_ms=1.0))
    replicas = plan(cluster, 12, "layered", groupings=("per-rank",))
    assert replicas.num_shard_groups == 3
    layers, world = cluster.model.num_layers, cluster.world_size
    all_reduce_ms = 2 * (world - 1) / world * INJECTED.reduce_scatter_ms / ((world - 1) / world)  # per layer, rho = 1
    # buckets of 4 layers of 10 MB in reduction order: 1 (past 1 MiB), then 3 (past 25 MiB), the last
    # closing with the backward: 2 layers' all-reduce beyond the one every schedule leaves is exposed
    exposed = 2 / 4
    inside = INJECTED.host_contention * layers * ((1 - 0.6) * (1 - exposed) + exposed) * all_reduce_ms / 1e3
    assert predicted_collective_s(truth, replicas) == pytest.approx(inside, rel=1e-12)
    observed = [replace(o, collective_s=inside) for o in _observe(truth, [replicas])] * 3
    fitted = fit_calibration(cluster, observed)
    assert fitted.reduce_scatter_ms == pytest.approx(INJECTED.reduce_scatter_ms, rel=FIT_TOL)
    assert fitted.shard_groups == (0, 1, 2)
    calibrated = with_calibration(cluster, fitted)
    more = plan(cluster, 24, "layered", groupings=("per-rank",))
    assert predicted(calibrated, more)[0] == pytest.approx(predicted(truth, more)[0], rel=FIT_TOL)
    sharded = plan(cluster, 12, "layered", groupings=FULL)
    as_profiled = replace(fitted, allgather_ms=6.0, reduce_scatter_ms=6.0, overlap=0.6, shard_groups=None)
    assert predicted(calibrated, sharded)[0] == pytest.approx(predicted(with_calibration(cluster, as_profiled), sharded)[0],
                                                              rel=1e-12)
    from cephalo_lightning.planner.cost.cluster_cost import collective_ms

    (got, got_exposed), (want, want_exposed) = (collective_ms(c, sharded.state_shares)
                                                for c in (calibrated, with_calibration(cluster, as_profiled)))
    for got_part, want_part in ((got.ag, want.ag), (got.rs, want.rs), (got_exposed, want_exposed)):
        assert got_part == pytest.approx(want_part, rel=1e-12)  # asked for one group's prices, a fit on another is not used


def test_the_host_is_blocked_in_an_asynchronous_collective_at_its_issue_and_its_wait(clock) -> None:
    """What the calibration fits the collectives to: the time a rank is blocked in them. An
    asynchronous collective blocks it twice, when it is issued and when it is waited for (the part
    compute did not hide, and an emulated link's remainder); the compute in between is not counted."""
    from cephalo_lightning.lightning.callback.cephalo_callback import CollectiveTime
    from cephalo_lightning.runtime.collectives import PendingGather, PendingWork, WaitReport
    from cephalo_lightning.runtime.observers import Observers

    class Work:  # a collective that completes ``left`` seconds after its wait begins
        def __init__(self, left: float) -> None:
            self.left = left

        def wait(self) -> None:
            clock.work(self.left)

    observers, blocked = Observers(), CollectiveTime()
    assert WaitReport.of(observers, "all_reduce", "u", 8) is None  # nobody listens: nothing is timed
    observers.attach(blocked)
    with observers.collective("all_reduce", "u", 8):  # the issue
        clock.work(0.001)
        pending = PendingWork(Work(0.020), report=WaitReport.of(observers, "all_reduce", "u", 8))
    clock.work(0.500)  # compute the collective overlaps
    pending.wait()
    pending.wait()  # done: a second wait blocks for nothing
    gather = PendingGather(torch.empty(0), Work(0.004), report=WaitReport.of(observers, "all_gather", "g", 8))
    gather.wait()
    assert blocked.seconds == pytest.approx(0.001 + 0.020 + 0.004, abs=1e-12)
    # without a report (the collective was issued with no observers) the wait is not heard
    PendingWork(Work(0.300)).wait()
    assert blocked.seconds == pytest.approx(0.025, abs=1e-12)
