"""What the cost model assumes where nothing was measured: a cluster whose links have no price is
refused (unless a person asks for free links, which the plan's output then names), and an
unmeasured overlap prices the collectives serial with compute, which the output names too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from cephalo_lightning.planner import PlanningError, cluster_from_dict, evaluate, plan
from cephalo_lightning.planner.command import main
from cephalo_lightning.planner.report import groups_line
from tests.planner_cases import check_plan

LLAMA_1B = {"name": "llama-1b", "num_layers": 16, "parameters": 1_235_814_400, "hidden_size": 2048, "seq_len": 2048}
LAB = [{"devices": [{"name": "a100-40gb", "count": 4}]}, {"devices": [{"name": "rtx3090", "count": 4}]}]
ONE_NODE = [{"name": "a100-40gb", "count": 2}, {"name": "rtx3090", "count": 2}]
LINKS = {"link_bandwidth": "16 GB/s per rank", "inter_node_bandwidth": "10 Gbit/s per link"}


def lab(settings: dict[str, Any] | None = None, model: dict[str, Any] = LLAMA_1B) -> dict[str, Any]:
    data: dict[str, Any] = {"model": model, "nodes": LAB}
    if settings is not None:
        data["settings"] = settings
    return data


# (the cluster, what the one-line refusal must say)
UNPRICED = [
    (lab(), r"no link bandwidth and no measured allgather_ms / reduce_scatter_ms, so the collectives would cost "
            r"0 s; give the links between its 2 nodes: write inter_node_bandwidth"),
    (lab({"usable_memory_fraction": 0.9}), r"so the collectives would cost 0 s"),
    ({"model": LLAMA_1B, "devices": ONE_NODE}, r"of one node: write link_bandwidth, e.g. 16 GB/s per rank"),
    ({"model": LLAMA_1B, "settings": {"inter_node_bandwidth": "10 Gbit/s per link"}, "devices": ONE_NODE},
     r"of one node: write link_bandwidth"),
    (lab({"link_bandwidth": "16 GB/s per rank"}),
     r"spans 2 nodes but settings give only link_bandwidth \(the link inside a node, 16 GB/s per rank\), so the "
     r"network between the nodes would be priced as fast as that; write its bandwidth"),
    (lab({"allgather_ms": 3.0}), r"settings give allgather_ms but not reduce_scatter_ms, so the reduce-scatter "
                                 r"would cost 0 s"),
]


@pytest.mark.parametrize("data, says", UNPRICED, ids=["no-settings", "settings-without-links", "one-node",
                                                      "one-node-inter-only", "two-nodes-intra-only", "allgather-only"])
def test_a_cluster_whose_links_have_no_price_is_refused(data, says):
    cluster = cluster_from_dict(data)
    with pytest.raises(PlanningError, match=says) as err:
        plan(cluster, 64)
    assert "\n" not in str(err.value)


def test_the_command_refuses_a_file_without_links_in_one_error_line(tmp_path, capsys):
    path = tmp_path / "lab.yaml"
    path.write_text(yaml.safe_dump(lab()))
    assert main([str(path), "-b", "64"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ")
    assert "inter_node_bandwidth" in err and "free_links: true" in err


@pytest.mark.parametrize("settings", [LINKS, {"allgather_ms": 3.0, "reduce_scatter_ms": 2.0}],
                         ids=["bandwidths", "measured"])
def test_a_priced_cluster_plans(settings):
    assert plan(cluster_from_dict(lab(settings)), 64).predicted_samples_per_s > 0


def test_one_rank_needs_no_link():
    cluster = cluster_from_dict({"model": LLAMA_1B, "devices": [{"name": "a100-40gb"}]})
    assert plan(cluster, 8).predicted_samples_per_s > 0


def test_free_links_plan_compute_and_memory_alone_and_the_output_says_so(tmp_path, capsys):
    """With ``free_links`` the plan is the independent reference's with collectives at 0 ms
    (tests/planner_reference.py reads no bandwidth and no measured time), and the output names it."""
    data = lab({"free_links": True})
    cluster = cluster_from_dict(data)
    p = plan(cluster, 64)
    check_plan(cluster, p, 64)
    path = tmp_path / "lab.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main([str(path), "-b", "64"]) == 0
    assert "free links (settings.free_links: true): the collectives cost 0 s" in capsys.readouterr().out


def test_free_links_beside_a_price_is_refused():
    with pytest.raises(PlanningError, match=r"free_links is true .* but settings also give link_bandwidth, "
                                            r"inter_node_bandwidth, which price them; keep one"):
        plan(cluster_from_dict(lab({**LINKS, "free_links": True})), 64)


def test_a_free_links_file_round_trips():
    from cephalo_lightning.planner import cluster_to_dict

    cluster = cluster_from_dict(lab({"free_links": True}))
    assert cluster_to_dict(cluster)["settings"]["free_links"] is True
    assert "free_links" not in cluster_to_dict(cluster_from_dict(lab(LINKS)))["settings"]


# ----------------------------------------------------------------------------- the overlap

# Two identical ranks, one group, one sample each in one micro-batch (recomputing): per layer the
# forward pass is AG beside F, the backward AG + RS beside the recomputed F and B (docs/plan.md), shares
# even so no unevenness factor, no micro-batch overhead, no optimizer.
L, F, B, AG, RS = 4, 5.0, 10.0, 3.0, 2.0
TWO = {"model": {"name": "m", "num_layers": L, "parameters": 1_000_000},
       "devices": [{"name": "x", "memory_gb": 16, "layer_fwd_ms": [F], "layer_bwd_ms": [B],
                    "compute_memory_gb": [0.1], "count": 2}]}
SERIAL_MS = L * ((AG + F) + (AG + RS + F + B))  # 112 ms: nothing hidden
HIDDEN_MS = L * (max(AG, F) + max(AG + RS, F + B))  # 80 ms: every collective behind compute


@pytest.mark.parametrize("overlap, step_ms", [(None, SERIAL_MS), (0.0, SERIAL_MS), (1.0, HIDDEN_MS)],
                         ids=["unmeasured", "zero", "one"])
def test_an_unmeasured_overlap_prices_the_collectives_serial(overlap, step_ms):
    settings: dict[str, Any] = {"allgather_ms": AG, "reduce_scatter_ms": RS, "micro_batch_overhead_ms": 0}
    if overlap is not None:
        settings["overlap"] = overlap
    cluster = cluster_from_dict({**TWO, "settings": settings})
    costs = evaluate(cluster, [1, 1], [1, 1], [0.5, 0.5])
    assert [c.step_s * 1e3 for c in costs] == pytest.approx([step_ms] * 2, rel=1e-12)


def _command_output(tmp_path: Path, data: dict[str, Any], batch: int, capsys) -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main([str(path), "-b", str(batch)]) == 0
    return capsys.readouterr().out


LORA_8B = {"name": "llama-3-8b", "num_layers": 32, "parameters": 8_030_261_248, "hidden_size": 4096,
           "seq_len": 2048, "trainable_parameters": 6_815_744}


def test_the_output_names_the_overlap_where_it_decides_the_grouping(tmp_path, capsys):
    """The lab's LoRA plan on 25 GbE at B = 512 keeps a group per node with the collectives serial and
    shards over all eight ranks with them hidden: the output names that grouping and its samples/s,
    as a plan at overlap 1 gives them."""
    links = {**LINKS, "inter_node_bandwidth": "25 Gbit/s per link"}
    hidden = plan(cluster_from_dict(lab({**links, "overlap": 1.0}, LORA_8B)), 512)
    serial = plan(cluster_from_dict(lab({**links, "overlap": 0.0}, LORA_8B)), 512)
    assert hidden.shard_groups != serial.shard_groups  # the case the line is for
    out = _command_output(tmp_path, lab(links, LORA_8B), 512, capsys)
    line = next(line for line in out.splitlines() if line.startswith("overlap not measured"))
    assert line == ("overlap not measured: priced at 0 (collectives serial with compute, so the step is an upper "
                    "bound); python -m cephalo_lightning profile measures it; it decides the grouping: at overlap 1 "
                    f"(collectives hidden) the best plan has {groups_line(hidden)} at "
                    f"{hidden.predicted_samples_per_s:.3g} samples/s")
    assert f"predicted: {serial.predicted_samples_per_s:.3g} samples/s" in out


def test_the_output_names_an_unmeasured_overlap_and_no_measured_one(tmp_path, capsys):
    unmeasured = _command_output(tmp_path, lab(LINKS), 64, capsys)  # the same grouping at overlap 0 and 1
    line = next(line for line in unmeasured.splitlines() if line.startswith("overlap not measured"))
    assert line.endswith("python -m cephalo_lightning profile measures it")
    measured = _command_output(tmp_path, lab({**LINKS, "overlap": 0.4}), 64, capsys)
    assert "overlap" not in measured
