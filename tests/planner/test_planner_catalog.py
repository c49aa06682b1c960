"""The GPU catalog: aliases, the estimate formulas, errors that say what to add, a memory override and the
emulation source."""

from __future__ import annotations

import pytest

from cephalo_lightning.planner import PlanningError, cluster_from_dict, load_cluster, plan
from cephalo_lightning.planner.report import render_plan
from cephalo_lightning.planner.schema.catalog import known_names, lookup
from tests.planner_cases import CLUSTERS

GPT27 = {"name": "gpt-2.7b", "num_layers": 32, "parameters": 2770621440, "hidden_size": 2560, "seq_len": 2048}


@pytest.mark.parametrize("alias, key", [("A100-80GB", "a100-80gb"), ("a100_80g", "a100-80gb"),
                                        ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("a100", "a100-40gb"),
                                        ("Tesla T4", "t4"), ("NVIDIA RTX A6000", "a6000"), ("A10G", "a10g"),
                                        ("GeForce RTX 4090", "rtx4090"), ("v100-32gb", "v100-32gb"),
                                        ("H200", "h200"), ("Tesla P40", "p40"), ("L40S", "l40s")])
def test_catalog_aliases(alias: str, key: str) -> None:
    spec = lookup(alias)
    assert spec is not None and spec.key == key


def test_catalog_estimate_formulas() -> None:
    cluster = load_cluster(CLUSTERS / "l4-a6000-p40.yaml")
    l4, a6000, p40 = cluster.devices[0], cluster.devices[2], cluster.devices[3]
    assert l4.source == "catalog" and len(l4.layer_fwd_ms) == 8
    flops = 24 * 2048 * 2560**2 + 4 * 2048**2 * 2560
    assert l4.layer_fwd_ms[0] == pytest.approx(flops / (121e12 * 0.4) * 1e3 + 0.1)
    assert l4.layer_bwd_ms[3] == pytest.approx(2 * l4.layer_fwd_ms[3])
    assert a6000.layer_fwd_ms[0] < l4.layer_fwd_ms[0] < p40.layer_fwd_ms[0] / 5
    per_sample = (34 * 2048 * 2560 + 5 * 40 * 2048**2) / 2**30
    assert l4.compute_memory_gb[1] - l4.compute_memory_gb[0] == pytest.approx(per_sample)
    assert a6000.memory_gb > 2 * l4.memory_gb


def test_catalog_errors_say_what_to_add() -> None:
    with pytest.raises(PlanningError) as err:
        cluster_from_dict({"model": GPT27, "devices": [{"name": "mi300x"}]})
    assert "'mi300x' is not in the GPU catalog" in str(err.value)
    assert all(name in str(err.value) for name in known_names())
    model = {k: v for k, v in GPT27.items() if k != "seq_len"}
    with pytest.raises(PlanningError, match=r"devices\[0\] \(l4\).*add model.seq_len"):
        cluster_from_dict({"model": model, "devices": [{"name": "l4"}]})


def test_catalog_memory_override_and_emulation_source() -> None:
    cluster = cluster_from_dict({"model": {**GPT27, "parameters": 10**9}, "devices": [
        {"name": "a6000", "memory_gb": 40},
        {"name": "slow", "memory_gb": 24, "layer_fwd_ms": [8], "layer_bwd_ms": [16], "compute_memory_gb": [2],
         "emulate": {"slowdown": 3}}]})
    assert cluster.devices[0].memory_gb == 40 and cluster.devices[1].source == "emulated"
    p = plan(cluster, 8)
    assert p.emulated and [r.source for r in p.ranks] == ["catalog", "emulated"]
    assert "(emulated)" in render_plan(p)
