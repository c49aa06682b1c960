"""Bandwidths written with units in the cluster file (planner/bandwidth.py): every accepted spelling
gives the GB/s per rank computed by hand, and what is ambiguous is refused with both readings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cephalo_lightning.planner import cluster_from_dict, load_cluster, plan
from cephalo_lightning.planner.schema.bandwidth import BandwidthError

ROOT = Path(__file__).resolve().parents[2]
MODEL = {"name": "llama-1b", "num_layers": 16, "parameters": 1_100_000_000, "hidden_size": 2048, "seq_len": 1024}
FOUR_A_NODE = [{"devices": [{"name": "a100-40gb", "count": 4}]}, {"devices": [{"name": "rtx3090", "count": 4}]}]


def cluster(**settings: Any):
    return cluster_from_dict({"model": MODEL, "settings": settings, "nodes": FOUR_A_NODE})


# (written, GB/s per rank by hand on two nodes of 4 ranks)
INTER_NODE = [
    ("10 Gbit/s per link", 10 / 8 / 4),  # 10 GbE: 1.25 GB/s per link, 4 ranks share it
    ("10Gb/s per link", 10 / 8 / 4),
    ("25 Gbps per link", 25 / 8 / 4),
    ("100 Gbit/s per rank", 100 / 8),
    ("3.1 GB/s per rank", 3.1),
    ("3.1 GB/s per link", 3.1 / 4),
    ("800 MB/s per rank", 0.8),
    ("400 Mbit/s per rank", 0.05),
    ("400 Mb/s per rank", 0.05),
    ("400 Mbps per rank", 0.05),
    ("1.25e1 GB/s per rank", 12.5),
]


@pytest.mark.parametrize("written,per_rank", INTER_NODE, ids=[w for w, _ in INTER_NODE])
def test_an_inter_node_bandwidth_with_units_is_each_ranks_gb_per_s(written, per_rank):
    got = cluster(inter_node_bandwidth=written).settings.inter_node_bandwidth_gbps
    assert got == pytest.approx(per_rank, rel=1e-12)


def test_per_link_divides_by_the_ranks_of_the_busiest_node():
    uneven = cluster_from_dict({"model": MODEL, "settings": {"inter_node_bandwidth": "10 Gbit/s per link"},
                                "nodes": [{"devices": [{"name": "a100-40gb", "count": 2}]},
                                          {"devices": [{"name": "rtx3090", "count": 5}]}]})
    assert uneven.settings.inter_node_bandwidth_gbps == pytest.approx(1.25 / 5, rel=1e-12)


def test_an_intra_node_bandwidth_with_units_is_per_rank():
    assert cluster(link_bandwidth="16 GB/s per rank").settings.link_bandwidth_gbps == 16.0
    assert cluster(link_bandwidth="200 Gbit/s per rank").settings.link_bandwidth_gbps == 25.0


def test_the_spelled_form_plans_as_the_numeric_form_it_stands_for():
    spelled = cluster(link_bandwidth="16 GB/s per rank", inter_node_bandwidth="10 Gbit/s per link")
    numeric = cluster(link_bandwidth_gbps=16, inter_node_bandwidth_gbps=0.3125)
    assert spelled == numeric
    assert plan(spelled, 64).to_dict() == plan(numeric, 64).to_dict()


@pytest.mark.parametrize("key", ["link_bandwidth", "inter_node_bandwidth"])
def test_a_bare_number_is_refused_with_both_readings(key):
    with pytest.raises(BandwidthError) as refused:
        cluster(**{key: 25})
    message = str(refused.value)
    assert "25 GB/s per rank" in message and "25 Gbit/s per link" in message and "3.125 GB/s" in message


@pytest.mark.parametrize("written,says", [
    ("25 Gbit/s", "per rank or 25 Gbit/s per link"),  # no scope
    ("25 gb/s per link", "unknown unit 'gb/s'"),  # bits or bytes? the case decides, so it must be exact
    ("25 per link", "a quantity with a unit"),
    ("fast", "a quantity with a unit"),
    ("0 GB/s per rank", "must be > 0"),
    ("25 Gbit/s per node", "per rank or per link"),
])
def test_an_ambiguous_or_malformed_inter_node_bandwidth_is_refused(written, says):
    with pytest.raises(BandwidthError, match="settings.inter_node_bandwidth") as refused:
        cluster(inter_node_bandwidth=written)
    assert says in str(refused.value)


def test_per_link_inside_a_node_is_refused():
    with pytest.raises(BandwidthError, match="link_bandwidth: 32 GB/s per rank"):
        cluster(link_bandwidth="32 GB/s per link")


def test_a_bandwidth_given_twice_is_refused():
    with pytest.raises(BandwidthError, match="both inter_node_bandwidth and inter_node_bandwidth_gbps"):
        cluster(inter_node_bandwidth="10 Gbit/s per link", inter_node_bandwidth_gbps=1.25)


def test_every_shipped_cluster_file_writes_its_bandwidths_with_units():
    for path in sorted((ROOT / "configs" / "clusters").glob("*.yaml")):
        text = path.read_text()
        assert "_gbps:" not in text, f"{path.name}: write link bandwidths with units (link_bandwidth: 16 GB/s per rank)"
        load_cluster(path)
    two_nodes = load_cluster(ROOT / "configs" / "clusters" / "two-nodes.yaml").settings
    assert two_nodes.inter_node_bandwidth_gbps == 25 / 8 / 2 and two_nodes.link_bandwidth_gbps == 100
