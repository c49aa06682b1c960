"""The profiler finds the nodes and measures the links within and between them."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from cephalo_lightning.planner.schema.cluster import cluster_to_dict
from cephalo_lightning.planner.schema.cluster_spec import Emulation, Settings
from cephalo_lightning.profiling import ClusterProfiler, ProfileOptions
from cephalo_lightning.profiling.collective_timing import CollectiveProfile
from cephalo_lightning.profiling.devices import measured_settings
from cephalo_lightning.profiling.topology import LinkProfile, NodeClue, Topology, find_nodes, node_clue
from tests.distributed import run_distributed
from tests.tiny_gpt import sample_tokens, tiny_gpt

# plumbing-cheap layer profiles; the links get a probe of 256 KiB per rank
OPTIONS = ProfileOptions(max_micro_batch=2, warmup=0, repeats=1, min_region_ms=0.0, collective_repeats=5,
                         link_probe_bytes=2**18)
EMULATED_GBPS = 0.0025  # 256 KiB to one peer on the other node: 105 ms, some 25x gloo's own time on one host
# the measured inter-node bandwidth is the emulated one, or less by what the host adds to each timed
# all-gather (the fastest of 5 repeats; on a shared 2-core host a repeat can lose a few ms to other
# processes): at most EMULATED_GBPS, at least half of it
FACTOR = 2.0


def test_node_clues_from_the_emulation_the_launcher_or_the_host() -> None:
    assert node_clue(Emulation(node=3), {"GROUP_RANK": "1"}, "h") == NodeClue(3, ("GROUP_RANK", "1"), "h")
    assert node_clue(None, {"SLURM_NODEID": "2", "NODE_RANK": "0"}, "h").launcher == ("SLURM_NODEID", "2")
    assert node_clue(None, {"RANK": "5", "LOCAL_WORLD_SIZE": "4"}, "h").launcher == ("RANK // LOCAL_WORLD_SIZE", "1")
    assert node_clue(None, {"RANK": "5", "LOCAL_WORLD_SIZE": "x"}, "h").launcher is None
    assert node_clue(None, {}, "h") == NodeClue(None, None, "h")


def test_find_nodes_prefers_emulation_then_the_launcher_then_host_names() -> None:
    emulated = [NodeClue(4, ("GROUP_RANK", "0"), "a"), NodeClue(4, None, "a"), NodeClue(1, None, "a")]
    assert find_nodes(emulated) == Topology((0, 0, 1), "emulation")  # numbered in the order of first rank
    launched = [NodeClue(None, ("GROUP_RANK", str(g)), "a") for g in (1, 1, 0, 0)]
    assert find_nodes(launched) == Topology((0, 0, 1, 1), "GROUP_RANK")
    # the launcher's variable differs between ranks: the host names decide
    mixed = [NodeClue(None, ("GROUP_RANK", "0"), "a"), NodeClue(None, ("SLURM_NODEID", "1"), "b")]
    assert find_nodes(mixed) == Topology((0, 1), "host name")
    hosts = [NodeClue(None, None, h) for h in ("x", "y", "x", "z")]
    topology = find_nodes(hosts)
    assert topology == Topology((0, 1, 0, 2), "host name")
    assert topology.node_groups() == [(0, 2), (1,), (3,)]
    assert topology.cross_groups() == [(0, 1, 3), (2,)]


def _profile_two_nodes(rank: int, world_size: int, emulate: list | None, group_ranks: list[int] | None) -> dict:
    if group_ranks is not None:  # what torchrun sets on each node
        os.environ["GROUP_RANK"] = str(group_ranks[rank])
    torch.set_num_threads(1)
    report = ClusterProfiler(tiny_gpt().layers(), sample_tokens(), emulate=emulate, options=OPTIONS, quiet=True).run()
    return {"cluster": report.cluster, "topology": report.topology, "links": report.links,
            "measured_by": report.measured_by}


@pytest.mark.multiprocess
def test_two_emulated_nodes_are_found_and_the_slow_link_is_measured() -> None:
    emulate = [{"node": 0, "inter_node_gbps": EMULATED_GBPS}, {"node": 0}, {"node": 1, "memory_gb": 0.5}, {"node": 1}]
    results = run_distributed(_profile_two_nodes, 4, emulate, None)
    cluster = results[0]["cluster"]
    assert all(r["cluster"] == cluster for r in results)  # every rank plans from the same file
    assert results[0]["topology"] == Topology((0, 0, 1, 1), "emulation")
    assert [d.node for d in cluster.devices] == [0, 0, 1, 1]
    assert [d.emulate.node for d in cluster.devices] == [0, 0, 1, 1]
    # a node changes no compute: rank 3 (node 1) uses rank 0's measurement; rank 2's memory differs
    assert results[0]["measured_by"] == (0, 0, 2, 0)
    links = results[0]["links"]
    assert links.emulated and links.probe_bytes == 2**18
    inter, intra = cluster.settings.inter_node_bandwidth_gbps, cluster.settings.link_bandwidth_gbps
    assert EMULATED_GBPS / FACTOR <= inter <= EMULATED_GBPS * 1.001, (inter, links)
    assert intra > 4 * inter, (intra, inter)  # the host's own link is far faster than the emulated one
    # the file the profiler writes carries the nodes and both link classes
    data = cluster_to_dict(cluster)
    assert [entry["node"] for entry in data["devices"] for _ in range(entry["count"])] == [0, 0, 1, 1]
    assert data["settings"]["inter_node_bandwidth_gbps"] == inter and data["settings"]["link_bandwidth_gbps"] == intra


@pytest.mark.multiprocess
def test_a_launchers_node_ranks_are_found_and_both_links_measured() -> None:
    results = run_distributed(_profile_two_nodes, 4, None, [0, 0, 1, 1])
    cluster = results[0]["cluster"]
    assert results[0]["topology"] == Topology((0, 0, 1, 1), "GROUP_RANK")
    assert [d.node for d in cluster.devices] == [0, 0, 1, 1]
    links = results[0]["links"]
    assert not links.emulated
    # one host: both classes are the same loopback, measured, positive
    assert cluster.settings.link_bandwidth_gbps > 0 and cluster.settings.inter_node_bandwidth_gbps > 0


def test_measured_links_fill_the_settings_unless_the_caller_set_them() -> None:
    comm = CollectiveProfile(numel=8, world_size=4, allgather_ms=1.0, reduce_scatter_ms=2.0)
    links = LinkProfile(intra_node_gbps=12.345678, inter_node_gbps=0.000123456, probe_bytes=4, intra_node_ms=1.0,
                        inter_node_ms=9.0, emulated=True)
    settings = measured_settings(Settings(), comm, "padded", None, links)
    # four significant figures: a very slow link keeps its figure (it is never rounded to 0)
    assert (settings.link_bandwidth_gbps, settings.inter_node_bandwidth_gbps) == (12.35, 0.0001235)
    mine = measured_settings(Settings(link_bandwidth_gbps=100.0, inter_node_bandwidth_gbps=3.0), comm, "padded",
                             None, links)
    assert (mine.link_bandwidth_gbps, mine.inter_node_bandwidth_gbps) == (100.0, 3.0)
    # nodes of one rank each: no intra-node figure, the setting stays as it was
    alone = replace(links, intra_node_gbps=None, intra_node_ms=None)
    assert measured_settings(Settings(), comm, "padded", None, alone).link_bandwidth_gbps is None
