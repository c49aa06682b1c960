"""Files in and out: plan files with bad fields, unequal profile series, the release converter."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from cephalo_lightning.planner import ModelSummary, Plan, PlanningError, cluster_from_dict, load_cluster, plan
from cephalo_lightning.planner.command import main as cli_main
from cephalo_lightning.planner.cost.device_cost import DeviceCost
from cephalo_lightning.planner.schema.convert import convert_release, latency_series, memory_series, release_cluster

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = ROOT / "configs" / "clusters"


# ----------------------------------------------------------------------------- plan files


def plan_data() -> dict[str, Any]:
    return plan(load_cluster(CLUSTERS / "t4-example.yaml"), 48).to_dict()


def write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data, allow_nan=True))
    return path


@pytest.mark.parametrize("change, message", [
    (lambda d: d["ranks"][1].update(batch_size="12"),
     r"ranks\[1\]\.batch_size \(rank 1\) must be a whole number >= 0, got '12' \(a string\); write it as a JSON "
     r"number, e\.g\. 12"),
    (lambda d: d["ranks"][0].update(state_share=float("nan")),
     r"ranks\[0\]\.state_share \(rank 0\) must be a finite number >= 0, got nan"),
    (lambda d: d["ranks"][2].update(state_share=float("inf")),
     r"ranks\[2\]\.state_share \(rank 2\) must be a finite number >= 0, got inf"),
    (lambda d: d["ranks"][0].update(num_micro_batches=0), r"ranks\[0\]\.num_micro_batches \(rank 0\) must be a whole number >= 1"),
    (lambda d: d["ranks"][0].update(recompute="no"), r"ranks\[0\]\.recompute \(rank 0\) must be true or false"),
    (lambda d: d["ranks"][1].update(device=123),
     r"ranks\[1\]\.device \(rank 1\) must be a non-empty JSON string \(e\.g\. \"a100-40gb\"\), got 123 \(int\); "
     r"quote it in the file"),
    (lambda d: d["ranks"][0].update(source=["catalog"]), r"ranks\[0\]\.source \(rank 0\) must be a non-empty JSON string \(e\.g\. \"measured\"\), got \['catalog'\]"),
    (lambda d: d["ranks"][0].update(batchsize=3), r"ranks\[0\]: unknown field\(s\) \['batchsize'\]"),
    (lambda d: d.update(global_batch_size=None), r"global_batch_size must be a whole number >= 1, got None"),
    (lambda d: d.update(ranks={}), r"'ranks' must be a non-empty list"),
    (lambda d: d.pop("ranks"), r"the field 'ranks' is missing"),
    (lambda d: d.update(format_version=99), r"format_version 99 is not one this version reads"),
    (lambda d: d.update(model=["m"]), r"'model' must be an object, got \['m'\]"),
    (lambda d: d["model"].update(params=7), r"model: unknown field\(s\) \['params'\]"),
    (lambda d: d["model"].update(parameters="7e9"), r"model\.parameters must be a whole number >= 0, got '7e9'"),
    (lambda d: d["model"].update(name=3), r"model\.name must be a string, got 3"),
])
def test_bad_plan_fields_name_the_field_rank_and_fix(tmp_path: Path, change, message: str) -> None:
    data = plan_data()
    change(data)
    with pytest.raises(PlanningError, match=message) as err:
        Plan.load(write(tmp_path, data))
    text = str(err.value)
    assert str(tmp_path / "plan.json") in text and "\n" not in text
    assert "python -m cephalo_lightning plan" in text  # the fix


def test_the_model_a_plan_was_made_for_round_trips_as_its_record(tmp_path: Path) -> None:
    cluster = load_cluster(CLUSTERS / "t4-example.yaml")
    made = plan(cluster, 48)
    m = cluster.model
    assert made.model == ModelSummary(m.name, m.parameters, m.trainable, m.num_layers, m.state_bytes_per_param,
                                      m.weight_bytes_per_param)
    assert Plan.load(write(tmp_path, made.to_dict())).model == made.model
    assert Plan.from_dict({**made.to_dict(), "model": {}}).model == ModelSummary()  # a hand-written plan may omit it


def test_a_list_is_not_a_plan(tmp_path: Path) -> None:
    with pytest.raises(PlanningError, match=r"a plan must be a JSON object .* got a list; re-make the plan"):
        Plan.load(write(tmp_path, [plan_data()]))


def test_nan_share_built_in_python_is_refused() -> None:
    data = plan_data()
    data["ranks"][0]["state_share"] = float("nan")
    with pytest.raises(PlanningError, match="finite"):
        Plan.from_dict(data)


@pytest.mark.parametrize("version", [1, 2, 3, None, "4", True])
def test_a_plan_file_of_another_format_version_is_refused_with_the_fix(tmp_path: Path, version) -> None:
    data = plan_data()
    if version is None:
        data.pop("format_version")
    else:
        data["format_version"] = version
    with pytest.raises(PlanningError, match=rf"format_version {re.escape(repr(version))} is not one this version "
                                            r"reads \(4, 5\); re-make the plan"):
        Plan.load(write(tmp_path, data))


def _grouped(groups: list[int], shares: list[float]) -> dict[str, Any]:
    data = Plan.even(len(groups), 4 * len(groups)).to_dict()
    for r, g, s in zip(data["ranks"], groups, shares):
        r.update(shard_group=g, state_share=s)
    return data


def test_shard_groups_round_trip_with_shares_summing_to_one_in_each(tmp_path: Path) -> None:
    data = _grouped([0, 0, 1, 1], [0.7, 0.3, 0.25, 0.75])
    loaded = Plan.load(write(tmp_path, data))
    assert loaded.shard_groups == ((0, 1), (2, 3)) and loaded.num_shard_groups == 2
    assert loaded.group_shares(2) == [0.25, 0.75]
    loaded.save(tmp_path / "again.json")
    assert Plan.load(tmp_path / "again.json") == loaded
    ddp = Plan.load(write(tmp_path, _grouped([0, 1, 2, 3], [1.0] * 4)))
    assert ddp.shard_groups == ((0,), (1,), (2,), (3,))


@pytest.mark.parametrize("groups, shares, message", [
    ([0, 0, 1, 1], [0.5, 0.5, 0.5, 0.4],
     r"the state shares of shard group 1 \(ranks \[2, 3\]\) sum to 0\.900000, not 1 \(each group holds one whole "
     r"replica of the state\); re-make the plan"),
    ([1, 1, 0, 0], [0.5] * 4, r"rank 0: shard_group 1 where 0 was expected: groups are numbered 0, 1, 2, \.\.\. in "
                              r"the order of their first rank"),
    ([0, 2, 1, 1], [1.0, 1.0, 0.5, 0.5], r"rank 1: shard_group 2 where 1 was expected"),
    ([0, 0, 1, 1], [0.5, 0.5, 0.5, 0.5], None),
])
def test_bad_shard_groups_are_refused_by_name(tmp_path: Path, groups, shares, message) -> None:
    data = _grouped(groups, shares)
    if message is None:
        assert Plan.load(write(tmp_path, data)).num_shard_groups == 2
        return
    with pytest.raises(PlanningError, match=message):
        Plan.load(write(tmp_path, data))
    data["ranks"][0]["shard_group"] = -1
    with pytest.raises(PlanningError, match=r"ranks\[0\]\.shard_group \(rank 0\) must be a whole number >= 0"):
        Plan.load(write(tmp_path, data))


def test_the_planners_name_is_read_only_from_planner(tmp_path: Path) -> None:
    data = plan_data()
    data["strategy"] = data.pop("planner")
    with pytest.raises(PlanningError, match=r"unknown field\(s\) \['strategy'\]; the fields are .*'planner'"):
        Plan.load(write(tmp_path, data))


def test_recompute_false_round_trips_and_needs_one_micro_batch(tmp_path: Path) -> None:
    cluster = cluster_from_dict({"model": {"name": "m", "num_layers": 4, "parameters": 50_000_000},
                                 "settings": {"reserved_memory_gb": 0, "free_links": True},
                                 "devices": [{"name": "a", "memory_gb": 24, "layer_fwd_ms": [5, 9],
                                              "layer_bwd_ms": [10, 18], "compute_memory_gb": [1, 1.5],
                                              "activation_memory_gb": [0.5, 1.0], "count": 2}]})
    p = plan(cluster, 4)
    assert [r.recompute for r in p.ranks] == [False, False]  # memory allows, and F + B beats 2F + B
    assert p.predicted_step_s == pytest.approx(4 * (9 + 18) / 1e3)
    p.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == p
    data = p.to_dict()
    data["ranks"][0].update(num_micro_batches=2, micro_batch_size=1)
    with pytest.raises(PlanningError, match="recompute = false needs the layered mode and exactly one micro-batch"):
        Plan.from_dict(data)


def test_no_recompute_never_chosen_without_graph_memory() -> None:
    data = {"model": {"name": "m", "num_layers": 4, "parameters": 50_000_000}, "settings": {"reserved_memory_gb": 0, "free_links": True},
            "devices": [{"name": "a", "memory_gb": 24, "layer_fwd_ms": [5, 9], "layer_bwd_ms": [10, 18],
                         "compute_memory_gb": [1, 1.5], "count": 2}]}
    p = plan(cluster_from_dict(data), 4)
    assert all(r.recompute for r in p.ranks)
    assert p.predicted_step_s == pytest.approx(4 * (2 * 9 + 18) / 1e3)


def test_no_recompute_declined_when_the_graph_does_not_fit() -> None:
    data = {"model": {"name": "m", "num_layers": 4, "parameters": 50_000_000}, "settings": {"reserved_memory_gb": 0, "free_links": True},
            "devices": [{"name": "a", "memory_gb": 4, "layer_fwd_ms": [5, 9], "layer_bwd_ms": [10, 18],
                         "compute_memory_gb": [1, 1.5], "activation_memory_gb": [2.0, 4.0], "count": 2}]}
    p = plan(cluster_from_dict(data), 4)  # 3 GiB usable: 1.5 + 4 for the graph of 2 does not fit
    assert all(r.recompute for r in p.ranks)


# ----------------------------------------------------------------------------- unequal series


def test_series_of_unequal_lengths_extrapolate_on_their_own() -> None:
    """Times measured at 1..4, memory at 1..2: each series is linear beyond its own last two points."""
    cluster = cluster_from_dict({"model": {"name": "m", "num_layers": 2, "parameters": 10_000_000},
                                 "devices": [{"name": "a", "memory_gb": 40, "layer_fwd_ms": [2, 4, 6, 9],
                                              "layer_bwd_ms": [5, 9], "compute_memory_gb": [1.0, 1.25],
                                              "activation_memory_gb": [0.5]}]})
    cost = DeviceCost(cluster.devices[0], cluster)
    assert [float(cost.fwd(m)) for m in (4, 6)] == [9, 15]  # last two: slope 3
    assert [float(cost.bwd(m)) for m in (2, 4)] == [9, 17]  # slope 4
    assert [float(cost.compute_memory(m)) for m in (0, 2, 6)] == [0.75, 1.25, 2.25]  # intercept 0.75, slope 0.25
    assert [float(cost.activation_memory(m)) for m in (1, 3)] == [0.5, 1.5]  # one point: proportional
    assert plan(cluster, 16).global_batch_size == 16


# ----------------------------------------------------------------------------- the release converter

# A small hand-made pair of files in the release's format: an L4 with the full runtime form (fits and
# measured arrays), an A6000 with fits only, a P40 with a forward slope only.
LATENCIES = {"gpt_tiny": {
    "l4": {"512": {"float16": [[2.0, 1.0], [4.0, 2.0], [3.0, 5.0, 7.0], [6.0, 10.0, 14.0]]}},
    "a6000": {"512": {"float16": [[1.0, 0.5], [2.0, 1.0]]}},
    "p40": {"512": {"float16": 10.0}},
}}
MEMORY = {"paper": {"gpt_tiny": {"parameters": 120_000_000,
                                 "profiled_compute_memory": {"float16": [1.0, 1.5, 2.0, 2.5, 3.0, 3.6]},
                                 "profiled_ga_model": {"float16": [0, 0]}}}}


def test_converter_series() -> None:
    fwd, bwd = latency_series(LATENCIES["gpt_tiny"]["l4"]["512"]["float16"], "l4")
    assert fwd == [3.0, 5.0, 7.0, 9.0, 11.0] and bwd == [6.0, 10.0, 14.0, 18.0, 22.0]  # arrays, then the fit
    assert latency_series([[1.0, 0.5], [2.0, 1.0]], "a6000") == ([1.5, 2.5], [3.0, 5.0])
    assert latency_series(10.0, "p40") == ([10.0, 20.0], [20.0, 40.0])  # B = 2 F for a forward alone
    # the release's growth: mean step over the last five points, (3.6 - 1.5) / 4
    assert memory_series([1.0, 1.5, 2.0, 2.5, 3.0, 3.6]) == pytest.approx([1.0, 1.5, 2.0, 2.5, 3.0, 3.6, 4.125])


def test_release_files_convert_to_a_cluster_that_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lat, mem = tmp_path / "model_latencies.json", tmp_path / "model_memory.json"
    lat.write_text(json.dumps(LATENCIES))
    mem.write_text(json.dumps(MEMORY))
    gpus = [("l4", 2), ("a6000", 1), ("p40", 1)]
    with pytest.raises(PlanningError, match="write link_bandwidth"):  # the release's files price no link
        plan(release_cluster(lat, mem, model="gpt_tiny", num_layers=12, gpus=gpus), 64)
    cluster = release_cluster(lat, mem, model="gpt_tiny", num_layers=12, gpus=gpus,
                              settings={"link_bandwidth": "16 GB/s per rank"})
    assert cluster.world_size == 4 and [d.name for d in cluster.devices] == ["l4", "l4", "a6000", "p40"]
    assert cluster.model.parameters == 120_000_000 and cluster.model.num_layers == 12
    assert cluster.devices[2].memory_gb == pytest.approx(47.5)  # the catalog's A6000
    p = plan(cluster, 64)
    by = {r.device: r.batch_size for r in p.ranks}
    assert by["a6000"] > by["l4"] > by["p40"]
    out = tmp_path / "cluster.yaml"
    assert cli_main(["convert", str(lat), str(mem), "--model", "gpt_tiny", "--num-layers", "12",
                     "--gpus", "l4:2,a6000,p40", "--link-bandwidth", "16 GB/s per rank", "--cluster-output", str(out),
                     "-b", "64"]) == 0
    text = capsys.readouterr().out
    assert "converted from the Cephalo release" in text and "samples/s" in text
    assert load_cluster(out) == cluster


def test_converter_errors_say_what_to_give() -> None:
    with pytest.raises(PlanningError, match=r"'mi300x' is not in the catalog.*--memory-gb mi300x=GB"):
        convert_release({"m": {"mi300x": {"1": {"f": 1.0}}}}, {"c": {"m": {"parameters": 5,
                                                                           "profiled_compute_memory": {"f": [1]}}}},
                        model="m", num_layers=2, gpus=[("mi300x", 1)], memory_gb={})
    with pytest.raises(PlanningError, match=r"has several seq lens \['1', '2'\]; choose one with --seq-len"):
        convert_release({"m": {"l4": {"1": {"f": 1.0}, "2": {"f": 1.0}}}},
                        {"c": {"m": {"parameters": 5, "profiled_compute_memory": {"f": [1]}}}},
                        model="m", num_layers=2, gpus=[("l4", 1)])
    with pytest.raises(PlanningError, match="has no model 'gpt'"):
        convert_release(LATENCIES, MEMORY, model="gpt", num_layers=2, gpus=[("l4", 1)])
