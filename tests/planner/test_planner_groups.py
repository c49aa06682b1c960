"""Shard groups in the planner: the cluster file's topology, the cost of groups, and choosing them."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cephalo_lightning.planner import PlanningError, cluster_from_dict, evaluate, load_cluster, plan, save_cluster
from cephalo_lightning.planner.cost.prices import Prices
from tests.planner_cases import random_grouped_cluster
from tests.planner_reference import brute_force_groups, candidate_groupings, group_rank_times, memory_ok

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = ROOT / "configs" / "clusters"
MODEL = {"name": "tiny", "num_layers": 4, "parameters": 100_000_000}


def measured(name: str, memory_gb: float = 16.0, fwd: float = 1.0, count: int = 1, **extra: Any) -> dict[str, Any]:
    return {"name": name, "count": count, "memory_gb": memory_gb, "layer_fwd_ms": [fwd, 2 * fwd],
            "layer_bwd_ms": [2 * fwd, 4 * fwd], "compute_memory_gb": [0.5, 1.0], **extra}


# ----------------------------------------------------------------------------- topology in the cluster file


def test_node_per_entry_and_nodes_form_read_the_same() -> None:
    per_entry = cluster_from_dict({"model": MODEL, "devices": [measured("a", count=2, node=0),
                                                               measured("b", count=2, node=1)]})
    grouped = cluster_from_dict({"model": MODEL, "nodes": [{"devices": [measured("a", count=2)]},
                                                           {"devices": [measured("b", count=2)]}]})
    assert per_entry == grouped
    assert per_entry.nodes == (0, 0, 1, 1) and per_entry.num_nodes == 2


def test_no_node_is_one_node_and_old_files_read_as_before() -> None:
    cluster = load_cluster(CLUSTERS / "a100x2-v100x2.yaml")
    assert all(d.node is None for d in cluster.devices)
    assert cluster.nodes == (0, 0, 0, 0) and cluster.num_nodes == 1
    assert cluster.settings.inter_node_bandwidth_gbps is None and cluster.settings.inter_node_latency_ms == 0.0


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_topology_round_trips(tmp_path: Path, suffix: str) -> None:
    cluster = load_cluster(CLUSTERS / "two-nodes.yaml")
    assert cluster.nodes == (0, 0, 1, 1)
    # 25 Gbit/s per link = 3.125 GB/s, shared by the node's 2 ranks
    assert cluster.settings.inter_node_bandwidth_gbps == 3.125 / 2 and cluster.settings.inter_node_latency_ms == 0.05
    path = tmp_path / f"cluster{suffix}"
    save_cluster(cluster, path)
    assert load_cluster(path) == cluster


def test_a_file_without_topology_writes_no_topology(tmp_path: Path) -> None:
    cluster = load_cluster(CLUSTERS / "a100x2-v100x2.yaml")
    save_cluster(cluster, tmp_path / "c.yaml")
    text = (tmp_path / "c.yaml").read_text()
    assert "node" not in text and "inter_node" not in text


@pytest.mark.parametrize("change, message", [
    (lambda d: d["devices"][0].update(node=-1), r"devices\[0\]\.node must be >= 0, got -1"),
    (lambda d: d["devices"][0].update(node=0.5), r"devices\[0\]\.node must be a whole number, got 0\.5"),
    (lambda d: d["devices"][0].update(node="a"), r"devices\[0\]\.node must be a whole number, got 'a'"),
    (lambda d: d["devices"][0].update(node=0), r"devices\[0\] name a node but devices\[1\] do not: give every "
                                               r"entry a node"),
    (lambda d: d.update(nodes=[{"devices": [measured("a")]}]), r"both 'devices:' and 'nodes:'; keep one"),
    (lambda d: d["settings"].update(inter_node_bandwidth_gbps=0), r"settings\.inter_node_bandwidth_gbps must be > 0"),
    (lambda d: d["settings"].update(inter_node_latency_ms=-1), r"settings\.inter_node_latency_ms must be >= 0"),
])
def test_bad_topology_names_the_field_and_the_fix(change, message: str) -> None:
    data = {"model": MODEL, "settings": {}, "devices": [measured("a"), measured("b")]}
    change(data)
    with pytest.raises(PlanningError, match=message):
        cluster_from_dict(data)


@pytest.mark.parametrize("nodes, message", [
    ([], r"nodes must be a non-empty list, one entry per node"),
    ([{"devices": []}], r"nodes\[0\]\.devices must be a non-empty list of device entries"),
    ([{"gpus": [measured("a")]}], r"nodes\[0\]: unknown key\(s\) \['gpus'\]"),
    ([{"devices": [measured("a")]}, {"devices": [measured("b", node=0)]}],
     r"nodes\[1\]\.devices\[0\]\.node is 0 inside nodes\[1\]: under nodes: a device's node is its position"),
])
def test_bad_nodes_form(nodes: list, message: str) -> None:
    with pytest.raises(PlanningError, match=message):
        cluster_from_dict({"model": MODEL, "nodes": copy.deepcopy(nodes)})


# ----------------------------------------------------------------------------- the cost of shard groups

LAYER = MODEL["parameters"] / MODEL["num_layers"]


def two_nodes(intra: float = 100.0, inter: float | None = 5.0, latency: float = 0.0, **settings: Any):
    return cluster_from_dict({
        "model": MODEL,
        "settings": {"link_bandwidth_gbps": intra, "inter_node_bandwidth_gbps": inter,
                     "inter_node_latency_ms": latency, "overlap": 0.0, "micro_batch_overhead_ms": 0.0, **settings},
        "nodes": [{"devices": [measured("a", count=2)]}, {"devices": [measured("b", fwd=2.0, count=2)]}]})


def ms(parameters: float, bytes_per_param: float, gbps: float) -> float:
    return parameters * bytes_per_param / (gbps * 1e9) * 1e3


def per_layer_comm(cluster, groups: list[int], shares: list[float]) -> list[float]:
    """What the cost model adds per layer beyond compute, with overlap 0: step / L - compute."""
    from cephalo_lightning.planner.cost.device_cost import DeviceCost

    out = []
    for rank, rc in enumerate(evaluate(cluster, [2] * 4, [1] * 4, shares, shard_groups=groups)):
        fwd, bwd = DeviceCost(cluster.devices[rank], cluster).compute_ms(2, 1)
        out.append(rc.step_s * 1e3 / MODEL["num_layers"] - fwd - bwd)
    return out


def test_one_group_prices_as_the_world_collective() -> None:
    from cephalo_lightning.planner.cost.collective_prices import communication, link_prices

    for cluster in (two_nodes(latency=0.2), load_cluster(CLUSTERS / "a100x2-v100x2.yaml")):
        comm, prices = communication(cluster), link_prices(cluster)
        for rho in (0.25, 0.4, 1.0):
            assert prices.group(cluster.world_size, cluster.num_nodes > 1, rho, 1) == (
                Prices(comm.allgather(rho), comm.reduce_scatter(rho)), 0.0)
    # one group of four across the nodes: the slow link, three quarters of a layer, plus the latency
    cluster = two_nodes(latency=0.2)
    comm = communication(cluster)
    assert comm.allgather_ms == pytest.approx(ms(0.75 * LAYER, 2, 5.0) + 0.2, rel=1e-12)
    got = per_layer_comm(cluster, [0, 0, 0, 0], [0.25] * 4)
    assert got == pytest.approx([2 * comm.allgather_ms + comm.reduce_scatter_ms] * 4, rel=1e-9)


def test_per_node_groups_gather_inside_and_reduce_across() -> None:
    cluster = two_nodes(latency=0.2)
    shares = [0.5, 0.5, 0.7, 0.3]  # node 1 splits unevenly: its collectives cost more
    got = per_layer_comm(cluster, [0, 0, 1, 1], shares)
    slope = 0.97  # UNEVEN_SLOPE["padded"]
    for rank, rho in ((0, 0.5), (2, 0.7)):
        factor = 1 + slope * (2 * rho - 1)
        ag = ms(0.5 * LAYER, 2, 100.0) * factor
        rs = ms(0.5 * LAYER, 4, 100.0) * factor
        cross = 2 * (2 - 1) / 2 * rho * ms(LAYER, 4, 5.0) + 0.2
        assert got[rank] == pytest.approx(2 * ag + rs + cross, rel=1e-9)
        assert got[rank + 1] == pytest.approx(got[rank], rel=1e-12)


def test_groups_of_one_rank_are_data_parallel() -> None:
    cluster = two_nodes(latency=0.2)
    got = per_layer_comm(cluster, [0, 1, 2, 3], [1.0] * 4)
    # no all-gathers: one all-reduce of the gradient M; each rank sends 2M/4 to each of its 3 peers, two
    # of them on the other node (M over the slow link) while M/2 goes to its node's peer (at once)
    all_reduce = max(ms(LAYER, 4, 5.0) + 0.2, ms(LAYER / 2, 4, 100.0))
    assert got == pytest.approx([all_reduce] * 4, rel=1e-9)
    one_node = cluster_from_dict({"model": MODEL, "settings": {"link_bandwidth_gbps": 100.0, "overlap": 0.0},
                                  "devices": [measured("a", count=4)]})
    got = per_layer_comm(one_node, [0, 1, 2, 3], [1.0] * 4)
    assert got == pytest.approx([2 * 3 / 4 * ms(LAYER, 4, 100.0)] * 4, rel=1e-9)


@pytest.mark.parametrize("measured", [False, True])
@pytest.mark.parametrize("groups", [[0, 0, 1, 1], [0, 1, 2, 3]])
def test_the_cross_group_reduction_is_priced_as_the_emulated_links_charge_it(groups: list[int], measured: bool) -> None:
    """Replicas cut alike sum a range with one all-reduce over the ranks holding it (rank i of every
    group), 2M/k to each of its k - 1 peers; the emulated links charge what crosses nodes. With the
    world's collectives measured on those links (as the profiler does: each rank sends a quarter of
    the layer to each peer, half of it across), the price must not depend on how they were measured."""
    from cephalo_lightning.planner.cost.collective_prices import link_prices
    from cephalo_lightning.runtime.emulation.links import EmulatedLinks

    links = EmulatedLinks((0, 0, 1, 1), inter_node_gbps=5.0)
    quarter = int(LAYER / 4) * 4  # bytes of a quarter layer of fp32 gradients
    world_ms = 1e3 * links.seconds(0, {1: quarter, 2: quarter, 3: quarter})
    cluster = two_nodes(intra=1e6, inter=5.0,  # the intra-node link costs next to nothing
                        **({"allgather_ms": world_ms / 2, "reduce_scatter_ms": world_ms} if measured else {}))
    G = len(set(groups))
    share = G / 4  # equal shares inside equal groups: every group cuts the layer alike
    prices = link_prices(cluster)
    per_rank, exposed = prices.ranks(np.array(groups), np.array(cluster.nodes), np.full(4, share))
    with_sum = per_rank.rs + exposed
    in_group = prices.group(4 // G, False, share, 1)[0].rs if 4 // G > 1 else 0.0
    M = int(share * LAYER * cluster.model.grad_bytes_per_param)
    for rank in range(4):
        replicas = [r for r in range(4) if r % (4 // G) == rank % (4 // G)]
        sends = {peer: 2 * M // len(replicas) for peer in replicas if peer != rank}
        assert with_sum[rank] - in_group == pytest.approx(1e3 * links.seconds(rank, sends), rel=1e-6)


def test_the_part_sent_to_other_nodes_against_a_loop_over_ranks_and_groups() -> None:
    from cephalo_lightning.planner.cost.collective_prices import far_fraction
    from tests.planner_reference import far_part

    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(200):
        world = int(rng.integers(2, 9))
        nodes, groups = rng.integers(0, 3, world), np.unique(rng.integers(0, world, world), return_inverse=True)[1]
        if groups.max() > 0:
            assert far_fraction(groups, nodes) == pytest.approx(far_part(list(groups), list(nodes)), abs=1e-12)
            checked += 1
    assert checked > 150
    assert far_fraction(np.array([0, 0, 1, 1]), np.array([0, 0, 1, 1])) == 1.0  # a group per node: all crosses
    assert far_fraction(np.arange(4), np.array([0, 0, 1, 1])) == pytest.approx(2 / 3)


@pytest.mark.parametrize("layer_numel", [1_000, 144_512, 300_000, 7_000_000])
def test_the_planner_cuts_the_gradient_buckets_as_the_runtime_does(layer_numel: int) -> None:
    import torch

    from cephalo_lightning.planner.cost.collective_prices import bucket_layers
    from cephalo_lightning.runtime.sharding.replicas import gradient_buckets

    layers = 12
    runtime = gradient_buckets([layer_numel] * layers, [torch.float32] * layers, [f"u{i}" for i in range(layers)])
    assert bucket_layers(layers, layer_numel * 4) == [len(b.units) for b in runtime]


def test_data_parallel_leaves_its_last_bucket_after_the_backward() -> None:
    """Six layers of 0.58 MB: buckets of 2 (past 1 MiB) and 4 layers, in reduction order. The last
    bucket's all-reduce starts when the backward ends: beyond the one layer every schedule reduces
    then, 3 of 6 layers' all-reduce is not hidden by compute, however much overlap there is."""
    model = {"name": "small", "num_layers": 6, "parameters": 6 * 144_512}
    cluster = cluster_from_dict({"model": model, "settings": {"link_bandwidth_gbps": 1.0, "overlap": 1.0},
                                 "devices": [measured("a", fwd=5.0, count=4)]})
    from cephalo_lightning.planner.cost.device_cost import DeviceCost

    all_reduce = 2 * 3 / 4 * ms(144_512, 4, 1.0)  # per layer; far below the layer's compute
    for rank, rc in enumerate(evaluate(cluster, [2] * 4, [1] * 4, [1.0] * 4, shard_groups=[0, 1, 2, 3])):
        fwd, bwd = DeviceCost(cluster.devices[rank], cluster).compute_ms(2, 1)
        assert rc.step_s * 1e3 / 6 - fwd - bwd == pytest.approx(3 / 6 * all_reduce, rel=1e-9)


def test_a_smaller_group_holds_a_bigger_share() -> None:
    cluster = two_nodes()
    # a share: the state, and the reduce-scatter's two shards of a layer (4-byte gradients)
    state = MODEL["parameters"] * (16 + 8 / MODEL["num_layers"]) / 2**30
    full = evaluate(cluster, [2] * 4, [1] * 4, [0.25] * 4)
    ddp = evaluate(cluster, [2] * 4, [1] * 4, [1.0] * 4, shard_groups=[0, 1, 2, 3])
    for f, d in zip(full, ddp):
        assert d.memory_gb - f.memory_gb == pytest.approx(0.75 * state, rel=1e-12)


def test_without_an_inter_node_figure_two_nodes_are_refused() -> None:
    """Pricing the network between the nodes as the link inside one would flatter every grouping that
    crosses it (docs/cluster.md): the file must say what the network is."""
    with pytest.raises(PlanningError, match=r"spans 2 nodes but settings give only link_bandwidth \(the link inside a "
                                            r"node, 100 GB/s per rank\).*write its bandwidth"):
        per_layer_comm(two_nodes(inter=None), [0, 0, 0, 0], [0.25] * 4)


# ----------------------------------------------------------------------------- choosing the grouping


def check_grouped(cluster, p, batch: int) -> None:
    """Sums per group, every rank's memory and the recorded figures, by the reference's formulas."""
    groups = [r.shard_group for r in p.ranks]
    assert sum(p.batch_sizes) == batch
    for members in p.shard_groups:
        assert sum(p.state_shares[i] for i in members) == pytest.approx(1.0, abs=1e-9)
    assert all(memory_ok(cluster, p.batch_sizes, p.num_micro_batches, p.state_shares, None, p.mode))
    times = group_rank_times(cluster, p.batch_sizes, p.num_micro_batches, p.state_shares, groups, p.mode)
    assert p.predicted_step_s == pytest.approx(max(times), rel=1e-9)
    for r, t in zip(p.ranks, times):
        assert r.predicted_step_s == pytest.approx(t, rel=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_optimal_over_groupings_against_brute_force(seed: int) -> None:
    rng = random.Random(1000 + seed)
    checked, grouped = 0, 0
    for _ in range(25):
        world = rng.choice([2, 2, 3, 4])
        cluster = random_grouped_cluster(rng, world)
        mode = rng.choice(["layered", "layered", "uniform"])
        batch = rng.randint(world if mode == "uniform" else 1, 6 if world == 4 else 9)
        best = brute_force_groups(cluster, batch, mode)
        if best is None:
            with pytest.raises(PlanningError):
                plan(cluster, batch, mode)
            continue
        p = plan(cluster, batch, mode)
        check_grouped(cluster, p, batch)
        assert p.predicted_step_s <= best.step_s * 1.005, (cluster, batch, mode, best, p)
        assert p.predicted_step_s >= best.step_s * (1 - 1e-9)  # nothing beats the exhaustive optimum
        assert p.optimality_gap is not None and p.optimality_gap <= 0.005
        checked += 1
        grouped += p.num_shard_groups > 1
    assert checked >= 12 and grouped >= 1  # most are plannable, and groups win some


def test_the_candidate_groupings_are_the_documented_ones() -> None:
    from cephalo_lightning.planner.search.grouped import candidate_groupings as planner_groupings

    for nodes in ([0] * 3, [0] * 4, [0, 0, 1, 1], [0] * 4 + [1] * 2, [0] * 8 + [1] * 8, [1, 1, 0, 0, 0, 0]):
        cluster = cluster_from_dict({"model": MODEL, "devices": [measured("a", node=n) for n in nodes]})
        assert [tuple(g.tolist()) for _, g in planner_groupings(nodes)] == candidate_groupings(cluster)


def test_a_model_that_fits_every_gpu_on_fast_links_is_data_parallel() -> None:
    cluster = cluster_from_dict({"model": MODEL, "settings": {"link_bandwidth_gbps": 50.0},
                                 "devices": [measured("a", memory_gb=40, count=4)]})
    for mode in ("layered", "uniform"):
        p = plan(cluster, 32, mode)
        assert p.shard_groups == ((0,), (1,), (2,), (3,)) and p.state_shares == [1.0] * 4, mode
        full = plan(cluster, 32, mode, groupings=("full",))
        assert p.predicted_step_s <= full.predicted_step_s


def test_a_slow_link_between_nodes_gives_a_group_per_node() -> None:
    data = {"model": {**MODEL, "parameters": 1_000_000_000},  # 14.9 GiB of state: a node holds it, a rank does not
            "settings": {"link_bandwidth_gbps": 100.0, "inter_node_bandwidth_gbps": 1.0, "overlap": 0.5},
            "nodes": [{"devices": [measured("a", count=2)]}, {"devices": [measured("b", fwd=2.0, count=2)]}]}
    cluster = cluster_from_dict(data)
    p = plan(cluster, 32)
    assert p.shard_groups == ((0, 1), (2, 3))
    full = plan(cluster, 32, groupings=("full",))
    assert full.predicted_step_s > 1.5 * p.predicted_step_s  # the flat group pays the slow link three times a layer
    assert p.baselines["hsdp-even"].feasible and not p.baselines["ddp-even"].feasible
    assert "cannot hold the whole state" in p.baselines["ddp-even"].reason
    # the same devices on one node: no slow link, one group
    one_node = cluster_from_dict({**data, "nodes": [{"devices": [measured("a", count=2), measured("b", fwd=2.0, count=2)]}]})
    assert plan(one_node, 32).num_shard_groups == 1


def test_old_cluster_files_plan_as_before() -> None:
    """One node: the plan is the one-group solver's (per-rank groups do not fit these models)."""
    for name, batch in (("a100x2-v100x2.yaml", 64), ("t4-example.yaml", 48), ("l4-a6000-p40.yaml", 64)):
        cluster = load_cluster(CLUSTERS / name)
        p, full = plan(cluster, batch), plan(cluster, batch, groupings=("full",))
        assert p.num_shard_groups == 1
        assert p.ranks == full.ranks and p.predicted_step_s == full.predicted_step_s


def test_baseline_plans_with_groups() -> None:
    cluster = load_cluster(CLUSTERS / "two-nodes.yaml")
    for name, groups in (("ddp-even", ((0,), (1,), (2,), (3,))), ("hsdp-even", ((0, 1), (2, 3)))):
        baseline = plan(cluster, 64, planner=name)
        assert baseline.planner == name and baseline.shard_groups == groups
        assert baseline.batch_sizes == [16] * 4 and len(set(baseline.num_micro_batches)) == 1
        assert baseline.state_shares == [1 / len(groups[0])] * 4
        chosen = plan(cluster, 64)
        assert chosen.baselines[name].predicted_step_s == pytest.approx(baseline.predicted_step_s, rel=1e-12)
        assert name in chosen.to_dict()["baselines"]


def test_report_shows_the_groups() -> None:
    from cephalo_lightning.planner.report import render_plan

    text = render_plan(plan(load_cluster(CLUSTERS / "two-nodes.yaml"), 64))
    assert "shard groups: 2, ranks 0-1 | 2-3" in text and "group" in text.splitlines()[3]
    assert "hsdp-even" in text and "ddp-even" in text


def test_unknown_grouping_is_named() -> None:
    with pytest.raises(PlanningError, match=r"unknown grouping\(s\) \['nodes'\]; choose from \('full', 'per-node'"):
        plan(load_cluster(CLUSTERS / "two-nodes.yaml"), 64, groupings=("nodes",))


def test_the_docs_topology_example_is_the_example_file() -> None:
    import re

    import yaml

    page = (ROOT / "docs" / "cluster.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", page, re.S) if b.startswith("# configs/clusters/two-nodes.yaml"))
    assert cluster_from_dict(yaml.safe_load(block)) == load_cluster(CLUSTERS / "two-nodes.yaml")
    p = plan(load_cluster(CLUSTERS / "two-nodes.yaml"), 64)
    assert p.shard_groups == ((0, 1), (2, 3))
    assert f"{p.predicted_samples_per_s:.3g}" == "17.2" and f"{p.baselines['ddp-even'].predicted_samples_per_s:.3g}" == "8.47"
    assert f"{p.baselines['hsdp-even'].predicted_samples_per_s:.3g}" == "12.4"
    assert f"{plan(load_cluster(CLUSTERS / 'two-nodes.yaml'), 64, groupings=('full',)).predicted_samples_per_s:.3g}" == "9.09"


def test_a_grouped_plan_round_trips_through_its_file(tmp_path: Path) -> None:
    from cephalo_lightning.planner import Plan

    p = plan(load_cluster(CLUSTERS / "two-nodes.yaml"), 64)
    p.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.shard_groups == p.shard_groups == ((0, 1), (2, 3)) and loaded.group_shares(2) == [0.5, 0.5]
    assert loaded.to_dict() == p.to_dict()


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_a_grouping_whose_choice_jumps_with_the_step_time_still_plans_its_batch(batch: int) -> None:
    # codellama-34b with a 4-bit base on four 24 GB cards: a group of two holds its replica at 0
    # samples, and the whole-device choice takes its first samples only past a step time that the
    # search brackets; the bisection must keep the feasible end (it once kept the infeasible one,
    # and the plan took 0 samples of the batch)
    model = {"name": "codellama-34b-lora-nf4", "num_layers": 48, "parameters": 33743970304, "hidden_size": 8192,
             "seq_len": 2048, "trainable_parameters": 19660800, "largest_reduced_parameters": 409600,
             "weight_bytes_per_param": 0.562534}
    cluster = cluster_from_dict({"model": model, "settings": {"link_bandwidth": "16 GB/s per rank"},
                                 "nodes": [{"devices": [{"name": "rtx4090", "count": 4}]}]})
    p = plan(cluster, batch)
    assert sum(r.batch_size for r in p.ranks) == batch
    assert all(r.batch_size >= 0 for r in p.ranks)
