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
    cluster = cluster_from_dict({"model": {**GPT27, "parameters": 10**9}, "settings": {"link_bandwidth": "16 GB/s per rank"},
                                 "devices": [
        {"name": "a6000", "memory_gb": 40},
        {"name": "slow", "memory_gb": 24, "layer_fwd_ms": [8], "layer_bwd_ms": [16], "compute_memory_gb": [2],
         "emulate": {"slowdown": 3}}]})
    assert cluster.devices[0].memory_gb == 40 and cluster.devices[1].source == "emulated"
    p = plan(cluster, 8)
    assert p.emulated and [r.source for r in p.ranks] == ["catalog", "emulated"]
    assert "(emulated)" in render_plan(p)


# Dense tensor TFLOPS of the precision mixed-precision training runs in (bf16 inputs, fp32 accumulate;
# fp16 where the card has no bf16; fp32 where it has no tensor cores), as NVIDIA's datasheets and
# architecture whitepapers print them, and the chip that gives them: SMs, FMAs per SM per clock at
# that precision, boost clock in GHz. GeForce cards run fp32 accumulate at half their fp16-accumulate
# rate (GA102 whitepaper: RTX 3090 71 against 142; Ada whitepaper: RTX 4090 165.2 against 330.3).
DATASHEET = {
    "v100-16gb": (125.0, 80, 512, 1.530),  # Volta whitepaper: 8 tensor cores x 64 FMA per SM, SXM2
    "v100-32gb": (125.0, 80, 512, 1.530),
    "t4": (65.0, 40, 512, 1.590),  # T4 datasheet: "Mixed Precision (FP16/FP32) 65 TFLOPS"
    "l4": (121.0, 58, 512, 2.040),  # L4 datasheet: BF16 242 with sparsity
    "rtx3090": (71.0, 82, 256, 1.695),  # GA102 whitepaper: BF16 with FP32 accumulate 71/142 (dense/sparse)
    "rtx4090": (165.2, 128, 256, 2.520),  # Ada whitepaper: BF16 with FP32 accumulate 165.2/330.4
    "a6000": (154.8, 84, 512, 1.800),  # GA102 whitepaper v2: 154.8/309.7
    "l40s": (362.0, 142, 512, 2.520),  # L40S datasheet: 362.05 (733 with sparsity)
    "a100-40gb": (312.0, 108, 1024, 1.410),  # A100 datasheet
    "a100-80gb": (312.0, 108, 1024, 1.410),
    "h100": (989.0, 132, 2048, 1.830),  # H100 SXM datasheet: 1,979 with sparsity
    "h200": (989.0, 132, 2048, 1.830),
    "p40": (11.8, 30, 128, 1.531),  # no tensor cores: 3,840 fp32 lanes, 12 TFLOPS fp32
}


@pytest.mark.parametrize("key", list(DATASHEET))
def test_the_catalog_rates_each_gpu_at_its_datasheet_training_throughput(key: str) -> None:
    """The catalog's figure is the datasheet's (rounded as the catalog writes it, within 2%), the
    datasheet's is its chip's (SMs x FMAs per SM per clock x 2 x clock, within 2%: L40S's published
    figure sits 1.2% under its boost clock's), and the entry's note says which precision it is."""
    datasheet, sms, fma, ghz = DATASHEET[key]
    spec = lookup(key)
    assert spec is not None
    assert sms * fma * 2 * ghz / 1e3 == pytest.approx(datasheet, rel=0.02)
    assert spec.tflops == pytest.approx(datasheet, rel=0.02)
    assert "fp32 accumulate" in spec.note or "no tensor cores: fp32" in spec.note, spec.note


def test_every_catalog_gpu_has_a_datasheet_row_or_says_its_peak_is_unpublished() -> None:
    unlisted = [name for name in known_names() if name not in DATASHEET]
    assert unlisted == ["a10g"] and "unpublished" in lookup("a10g").note
