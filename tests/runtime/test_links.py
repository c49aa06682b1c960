"""Emulated links between nodes: the spec fields, their checks over all ranks, and the price of a send."""

from __future__ import annotations

from pathlib import Path

import pytest

from cephalo_lightning.planner.schema.cluster import (
    EmulationSpecError,
    PlanningError,
    cluster_from_dict,
    load_cluster,
    save_cluster,
)
from cephalo_lightning.planner.schema.cluster_spec import Emulation
from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator, parse_emulation_specs
from cephalo_lightning.runtime.emulation.links import EmulatedLinks, links_from_emulation

TWO_BY_TWO = [{"node": 0, "inter_node_gbps": 2.0}, {"node": 0}, {"node": 1, "slowdown": 2}, {"node": 1}]


def test_seconds_is_the_crossing_bytes_over_the_bandwidth_plus_the_latency() -> None:
    links = EmulatedLinks(nodes=(0, 0, 1, 1), inter_node_gbps=2.0, latency_ms=3.0)
    # rank 0 sends 1 MB inside its node and 2 + 6 MB across: 8e6 B / 2e9 B/s = 4 ms, plus 3 ms latency
    assert links.crossing_bytes(0, {1: 1_000_000, 2: 2_000_000, 3: 6_000_000}) == 8_000_000
    assert links.seconds(0, {1: 1_000_000, 2: 2_000_000, 3: 6_000_000}) == pytest.approx(0.007, rel=1e-12)
    # rank 3's peers on node 0 are ranks 0 and 1; its own node's rank 2 costs nothing
    assert links.seconds(3, {0: 500_000, 1: 500_000, 2: 10**9}) == pytest.approx(1e6 / 2e9 + 3e-3, rel=1e-12)
    # nothing crosses: no time at all, not even the latency
    assert links.seconds(0, {1: 10**9}) == 0.0
    assert links.seconds(2, {}) == 0.0
    assert links.seconds(1, {2: 0, 3: 0, 0: 7}) == 0.0
    # the time scales with the bytes and inversely with the bandwidth
    slow = EmulatedLinks(nodes=(0, 0, 1, 1), inter_node_gbps=0.5)
    assert slow.seconds(1, {2: 3_000_000}) == pytest.approx(4 * EmulatedLinks((0, 0, 1, 1), 2.0).seconds(1, {2: 3_000_000}))
    assert slow.seconds(1, {2: 3_000_000}) == pytest.approx(3e6 / 0.5e9)


def test_links_check_their_inputs() -> None:
    with pytest.raises(EmulationSpecError, match=r"nodes\[1\] \(rank 1\) must be a node index >= 0, got -1"):
        EmulatedLinks(nodes=(0, -1), inter_node_gbps=1.0)
    with pytest.raises(EmulationSpecError, match="inter_node_gbps must be a finite number > 0, got 0"):
        EmulatedLinks(nodes=(0, 1), inter_node_gbps=0.0)
    with pytest.raises(EmulationSpecError, match="latency_ms must be a finite number >= 0"):
        EmulatedLinks(nodes=(0, 1), inter_node_gbps=1.0, latency_ms=float("nan"))
    links = EmulatedLinks(nodes=(0, 1), inter_node_gbps=1.0)
    with pytest.raises(ValueError, match=r"peer 2 is not a global rank of the emulated topology \(0..1\)"):
        links.seconds(0, {2: 10})
    with pytest.raises(ValueError, match="rank -1 is not a global rank"):
        links.seconds(-1, {1: 10})
    with pytest.raises(ValueError, match="bytes sent to peer 1 must be a whole number >= 0, got -4"):
        links.seconds(0, {1: -4})


def test_links_from_the_ranks_specs() -> None:
    specs = parse_emulation_specs(TWO_BY_TWO, 4)
    assert specs[2] == Emulation(slowdown=2.0, node=1)
    assert specs[0] == Emulation(node=0, inter_node_gbps=2.0)
    links = links_from_emulation(specs)
    assert links == EmulatedLinks(nodes=(0, 0, 1, 1), inter_node_gbps=2.0)
    assert links.num_nodes == 2 and links.world_size == 4
    text = links.describe()
    assert "emulated" in text and "node 0: ranks [0, 1]" in text and "node 1: ranks [2, 3]" in text and "2 GB/s" in text
    # no node named, or a single node: nothing to slow down
    assert links_from_emulation(parse_emulation_specs([{"slowdown": 2}, None], 2)) is None
    assert links_from_emulation(parse_emulation_specs([{"node": 3}, {"node": 3, "inter_node_gbps": 1}], 2)) is None
    assert links_from_emulation([]) is None
    # nodes need not be numbered from 0 nor be contiguous in rank order
    odd = links_from_emulation([Emulation(node=5, inter_node_gbps=1.0), Emulation(node=2), Emulation(node=5)])
    assert odd is not None and odd.nodes == (5, 2, 5)
    assert odd.seconds(0, {1: 10**9, 2: 10**9}) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("specs", "fragments"),
    [
        ([{"node": -1}, {"node": 0}], ["emulate[0] (rank 0).node", "whole number >= 0", "-1"]),
        ([{"node": 0}, {"node": 1.0}], ["emulate[1] (rank 1).node", "whole number >= 0", "1.0"]),
        ([{"node": True}, {"node": 0}], ["emulate[0] (rank 0).node", "True"]),
        ([{"node": "a"}, {"node": 0}], ["emulate[0] (rank 0).node", "'a'"]),
        ([{"node": 0, "inter_node_gbps": 0}, {"node": 1}], ["emulate[0] (rank 0).inter_node_gbps", "> 0 GB/s"]),
        ([{"node": 0, "inter_node_gbps": "fast"}, {"node": 1}], ["rank 0", "inter_node_gbps", "finite number"]),
        ([{"node": 0}, {"node": 1}], ["2 nodes [0, 1]", "no inter_node_gbps", "inter_node_gbps: 1.25"]),
        ([{"node": 0, "inter_node_gbps": 1}, {"node": 1, "inter_node_gbps": 2}],
         ["different inter_node_gbps", "rank 0: 1, rank 1: 2", "one bandwidth"]),
        ([{"node": 0, "inter_node_gbps": 1}, {"slowdown": 2}], ["node of rank(s) [0] but not of rank(s) [1]"]),
        ([{"node": 0, "inter_node_gbps": 1}, None], ["not of rank(s) [1]"]),
        ([{"inter_node_gbps": 1}, {}], ["emulate[0] (rank 0) gives inter_node_gbps but no rank names its node"]),
        ([{"nodes": 1}, {}], ["rank 0", "unknown key", "'node' (an int >= 0)"]),
    ],
)
def test_bad_link_specs_say_what_to_change(specs: list, fragments: list[str]) -> None:
    with pytest.raises(EmulationSpecError) as err:
        parse_emulation_specs(specs, len(specs))
    assert isinstance(err.value, ValueError) and isinstance(err.value, PlanningError)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_emulator_records_the_node_and_says_the_links_are_emulated() -> None:
    emulator = DeviceEmulator.from_spec({"slowdown": 2, "node": 1, "inter_node_gbps": 1.5})
    assert emulator.spec == Emulation(2.0, None, 1, 1.5)
    assert (emulator.node, emulator.inter_node_gbps) == (1, 1.5)
    assert "emulated node 1" in emulator.describe() and "1.5 GB/s" in emulator.describe()
    assert "links are emulated" in emulator.describe()
    # a node alone marks the rank as emulated (its links are)
    assert DeviceEmulator(node=0).is_emulated
    # the device name stays the device's kind: the node is a field of its own, not part of the name
    assert emulator.name_suffix() == " (emulated x2.0)"
    with pytest.raises(EmulationSpecError, match=r"DeviceEmulator.node must be a whole number >= 0"):
        DeviceEmulator(node=-2)


def test_cluster_file_carries_the_link_fields(tmp_path: Path) -> None:
    model = {"num_layers": 2, "parameters": 1000}
    device = {"name": "x", "memory_gb": 1, "layer_fwd_ms": [1.0], "layer_bwd_ms": [2.0], "compute_memory_gb": [0.1]}
    cluster = cluster_from_dict({"model": model, "devices": [
        {**device, "emulate": {"slowdown": 1, "node": 0, "inter_node_gbps": 1.25}},
        {**device, "emulate": {"slowdown": 3, "node": 1, "inter_node_gbps": 1.25}}]})
    assert [d.emulate for d in cluster.devices] == [Emulation(1.0, None, 0, 1.25), Emulation(3.0, None, 1, 1.25)]
    save_cluster(cluster, tmp_path / "c.yaml")
    assert load_cluster(tmp_path / "c.yaml") == cluster
    assert links_from_emulation([d.emulate for d in cluster.devices]) == EmulatedLinks((0, 1), 1.25)
    with pytest.raises(PlanningError, match=r"devices\[0\].emulate.node must be a whole number >= 0"):
        cluster_from_dict({"model": model, "devices": [{**device, "emulate": {"node": -1}}]})


def test_a_device_whose_emulated_node_is_not_its_node_is_refused_by_name() -> None:
    model = {"num_layers": 4, "parameters": 1_000_000}
    entry = {"name": "cpu", "memory_gb": 1, "layer_fwd_ms": [1.0], "layer_bwd_ms": [2.0], "compute_memory_gb": [0.1]}
    agree = {"model": model, "nodes": [{"devices": [{**entry, "emulate": {"node": 0, "inter_node_gbps": 1.0}}]},
                                       {"devices": [{**entry, "emulate": {"node": 1}}]}]}
    assert cluster_from_dict(agree).nodes == (0, 1)
    crossed = {"model": model, "nodes": [{"devices": [{**entry, "emulate": {"node": 1, "inter_node_gbps": 1.0}}]},
                                         {"devices": [{**entry, "emulate": {"node": 0}}]}]}
    with pytest.raises(PlanningError, match=r"nodes\[0\]\.devices\[0\] \(cpu\) is in node 0 but its emulate\.node is 1"):
        cluster_from_dict(crossed)
