"""Bad input is refused by name: the global batch, the device list and fields, settings, state or compute that do
not fit, unknown modes and planners."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from cephalo_lightning.planner import PlanningError, cluster_from_dict, plan
from tests.planner_cases import small_cluster


@pytest.mark.parametrize("batch, message", [(0, "whole number >= 1"), (-3, "whole number >= 1"),
                                            (2.5, "whole number >= 1"), ("8", "whole number >= 1")])
def test_bad_global_batch(batch: Any, message: str) -> None:
    with pytest.raises(PlanningError, match=message):
        plan(cluster_from_dict(small_cluster()), batch)


def test_uniform_batch_smaller_than_world() -> None:
    with pytest.raises(PlanningError, match=r"global batch 2 is smaller than the 3 ranks.*at least 3"):
        plan(cluster_from_dict(small_cluster()), 2, mode="uniform")
    assert sum(plan(cluster_from_dict(small_cluster()), 2).batch_sizes) == 2  # layered: idle ranks are fine


def test_empty_device_list() -> None:
    with pytest.raises(PlanningError, match="devices must be a non-empty list"):
        cluster_from_dict(small_cluster(devices=[]))
    cluster = cluster_from_dict(small_cluster())
    with pytest.raises(PlanningError, match="no devices"):
        plan(replace(cluster, devices=()), 8)


@pytest.mark.parametrize("field, value, message", [
    ("memory_gb", -1, r"devices\[0\].memory_gb must be > 0"),
    ("memory_gb", "lots", r"devices\[0\].memory_gb must be a number, got 'lots'"),
    ("layer_fwd_ms", [5, -9], r"devices\[0\].layer_fwd_ms\[1\] must be > 0"),
    ("compute_memory_gb", "1.5", r"devices\[0\].compute_memory_gb must be a non-empty list"),
    ("count", 0, r"devices\[0\].count must be >= 1"),
])
def test_bad_device_fields(field: str, value: Any, message: str) -> None:
    data = small_cluster()
    data["devices"][0][field] = value
    with pytest.raises(PlanningError, match=message):
        cluster_from_dict(data)


def test_negative_setting() -> None:
    with pytest.raises(PlanningError, match="settings.reserved_memory_gb must be >= 0"):
        cluster_from_dict(small_cluster(settings={"reserved_memory_gb": -1}))


def test_state_does_not_fit_says_by_how_much() -> None:
    data = small_cluster()
    data["model"]["parameters"] = 4_000_000_000  # 59.6 GiB of state
    with pytest.raises(PlanningError) as err:
        plan(cluster_from_dict(data), 8)
    text = str(err.value)
    model = cluster_from_dict(data).model  # the state and the reduce-scatter's two shards of one layer
    need = (4_000_000_000 * 16 + 2 * 4_000_000_000 / model.num_layers * 4) / 2**30
    assert f"training state and its reduction need {need:.1f} GiB" in text
    assert "4,000,000,000 parameters x 16 bytes" in text
    assert "short by" in text and "add GPUs or memory" in text


def test_state_fits_only_without_compute() -> None:
    data = small_cluster()
    # 7.5 GiB usable - 2 reserved; compute memory 2 GiB (intercept) idle, 3 GiB with one sample
    data["devices"] = [{"name": "a", "memory_gb": 10, "layer_fwd_ms": [5, 9], "layer_bwd_ms": [10, 18],
                        "compute_memory_gb": [3, 4], "count": 2}]
    # 6.5 GiB of state and reduction buffers (16 bytes a parameter, and two 4-byte shards of one of the
    # model's layers): fits idle (2 x 3.5), not with a sample (6)
    data["model"]["parameters"] = int(6.5 * 2**30 / (16 + 8 / data["model"]["num_layers"]))
    with pytest.raises(PlanningError, match="fits only while no GPU computes.*short by"):
        plan(cluster_from_dict(data), 4)


def test_no_gpu_fits_one_sample() -> None:
    data = small_cluster()
    for d in data["devices"]:  # one sample needs the whole card; the intercept (empty batch) is 0
        d["layer_fwd_ms"], d["layer_bwd_ms"] = [5, 9], [10, 18]
        d["compute_memory_gb"] = [d["memory_gb"], 2 * d["memory_gb"]]
    with pytest.raises(PlanningError, match=r"no GPU fits one sample.*rank 2 \(b\).*needs 26 GiB for one sample"):
        plan(cluster_from_dict(data), 4)


def test_small_gpu_idles_in_layered_but_blocks_uniform() -> None:
    data = small_cluster()
    data["devices"].append({"name": "tiny", "memory_gb": 4, "layer_fwd_ms": [2, 4], "layer_bwd_ms": [4, 8],
                            "compute_memory_gb": [1.5, 5.0]})  # one sample: 1.5 + 2 reserved > 3 usable
    cluster = cluster_from_dict(data)
    p = plan(cluster, 8)
    assert p.ranks[3].batch_size == 0 and p.ranks[3].state_share > 0
    with pytest.raises(PlanningError, match=r"rank 3 \(tiny\) is too small for one sample.*--mode layered"):
        plan(cluster, 8, mode="uniform")


def test_rank_that_cannot_run_at_all() -> None:
    data = small_cluster(settings={"reserved_memory_gb": 13})
    with pytest.raises(PlanningError, match=r"rank 0 \(a\) cannot run at all.*lower reserved_memory_gb"):
        plan(cluster_from_dict(data), 4)


def test_unknown_mode_and_planner() -> None:
    cluster = cluster_from_dict(small_cluster())
    with pytest.raises(PlanningError, match="mode must be one of"):
        plan(cluster, 4, mode="pipeline")
    with pytest.raises(PlanningError, match="planner must be one of"):
        plan(cluster, 4, planner="fastest")


def _misspelt(section: str, typo: str) -> dict[str, Any]:
    data = small_cluster()
    if section == "cluster file":
        data[typo] = data.pop("devices")
    elif section == "settings":
        data["settings"] = {typo: "10 Gbit/s per link"}
    elif section == "model":
        data["model"][typo] = 1
    elif section == "devices[0]":
        data["devices"][0][typo] = 1
    else:  # an emulation spec
        data["devices"][0]["emulate"] = {typo: 2}
    return data


# (section, the key as a person misspells it, the key meant): written by hand, not by the code's own list
MISSPELT = [
    ("settings", "inter_node_bandwith", "inter_node_bandwidth"),
    ("settings", "link_bandwidht", "link_bandwidth"),
    ("settings", "inter_node_bandwidth_gbp", "inter_node_bandwidth_gbps"),
    ("settings", "usable_memory_fractoin", "usable_memory_fraction"),
    ("model", "num_layer", "num_layers"),
    ("model", "paramaters", "parameters"),
    ("devices[0]", "memory_gib", "memory_gb"),
    ("devices[0]", "layer_fwd", "layer_fwd_ms"),
    ("devices[0].emulate", "slowdwn", "slowdown"),
    ("cluster file", "device", "devices"),
]


@pytest.mark.parametrize("section, typo, meant", MISSPELT, ids=[m[1] for m in MISSPELT])
def test_a_misspelt_key_names_the_key_meant(section: str, typo: str, meant: str) -> None:
    with pytest.raises(PlanningError) as err:
        cluster_from_dict(_misspelt(section, typo))
    text = str(err.value)
    assert text.startswith(f"{section}: unknown key(s) [{typo!r}] (did you mean {meant!r}?)"), text
    assert "\n" not in text


def test_a_misspelt_setting_lists_the_documented_bandwidth_keys() -> None:
    """docs/cluster.md writes links as ``inter_node_bandwidth: 10 Gbit/s per link``: the list of
    allowed settings names those keys, not only the numeric ``*_gbps`` ones the profiler writes."""
    with pytest.raises(PlanningError) as err:
        cluster_from_dict(small_cluster(settings={"bandwidth": "10 Gbit/s per link"}))
    allowed = str(err.value).split("allowed: ", 1)[1]
    for key in ("'inter_node_bandwidth'", "'link_bandwidth'", "'inter_node_bandwidth_gbps'", "'link_bandwidth_gbps'"):
        assert key in allowed, allowed


def test_two_misspelt_keys_get_a_match_each_and_a_stranger_none() -> None:
    data = small_cluster()
    data["model"].update(num_layer=2, paramaters=10, colour=1)
    with pytest.raises(PlanningError) as err:
        cluster_from_dict(data)
    assert ("model: unknown key(s) ['colour', 'num_layer', 'paramaters'] (did you mean 'num_layers' for "
            "'num_layer', 'parameters' for 'paramaters'?); allowed: ") in str(err.value)
