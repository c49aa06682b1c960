"""Shard groups in the planner: the cluster file's topology, the cost of groups, and choosing them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from cephalo_lightning.planner import PlanningError, cluster_from_dict, load_cluster, save_cluster

ROOT = Path(__file__).resolve().parents[1]
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
    assert cluster.settings.inter_node_bandwidth_gbps == 3.1 and cluster.settings.inter_node_latency_ms == 0.05
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
