"""Whatever a plan, cluster or profile-cache file holds, and wherever an output goes, the answer is one
``error:`` line naming the file, the problem and the fix: never a traceback.

All in-process: the commands' ``main`` functions are called as the console entry points call them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from cephalo_lightning.__main__ import main as module_main
from cephalo_lightning.lightning.cli import main as train_main
from cephalo_lightning.planner.schema.cluster import cluster_from_dict, load_cluster
from cephalo_lightning.planner.schema.plan import Plan
from cephalo_lightning.planner.schema.planning_error import PlanningError
from cephalo_lightning.profiling.cache import read_cached

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-cli.yaml"
GARBAGE = bytes(range(128, 256)) * 3  # no UTF-8 text starts with a continuation byte
DEEP = "[" * 100_000 + "]" * 100_000
HUGE = 10**400
MODEL = {"num_layers": 2, "parameters": 1_000_000, "hidden_size": 256, "seq_len": 128}


def _cluster(model: dict | None = None, **device) -> str:
    return json.dumps({"model": {**MODEL, **(model or {})}, "devices": [{"name": "a100", **device}]})


def _one_error_line(capsys, code: int, want: int = 2) -> str:
    captured = capsys.readouterr()
    assert code == want, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err  # one line, no traceback
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


# name, file name, content, what the message must say (the file, the problem, the fix)
CLUSTER_FILES = [
    ("binary-yaml", "cluster.yaml", GARBAGE, ["cluster.yaml", "not a text file", "write one"]),
    ("binary-json", "cluster.json", GARBAGE, ["cluster.json", "not a text file", "profile"]),
    ("deep-json", "cluster.json", DEEP, ["cluster.json", "nested too deeply", "write one"]),
    ("deep-yaml", "cluster.yaml", DEEP, ["cluster.yaml", "nested too deeply", "write one"]),
    ("huge-integer", "cluster.json", _cluster({"parameters": HUGE}),
     ["model.parameters must be at most 9,007,199,254,740,992", "401 digits", "fix it in the cluster file"]),
    ("huge-number", "cluster.json", _cluster(memory_gb=HUGE),
     ["devices[0].memory_gb must be a number of at most", "fix it in the cluster file"]),
    # a count far past the rank limit is refused before the list of ranks is built (which would not fit)
    ("huge-count", "cluster.json", _cluster(count=10**12),
     ["add up to 1,000,000,000,000 ranks", "10,000,000x the planner's limit of 100,000",
      "divided by 10,000,000"]),
    ("huge-count-integer", "cluster.json", _cluster(count=HUGE), ["devices[0].count must be at most"]),
    ("number-keys", "cluster.yaml", "{1: 2, model: {num_layers: 2}}",
     ["unknown key(s) ['1']", "Fix or remove them"]),
    ("a-directory", "cluster.d", None, ["is a directory", "give the file's path"]),
]


@pytest.mark.parametrize(("name", "content", "says"), [c[1:] for c in CLUSTER_FILES], ids=[c[0] for c in CLUSTER_FILES])
def test_a_bad_cluster_file_is_one_error_line(tmp_path, capsys, name, content, says):
    path = tmp_path / name
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    line = _one_error_line(capsys, module_main(["plan", str(path), "-b", "8"]))
    for words in says:
        assert words in line, line


def _plan_with(**fields) -> str:
    data = Plan.even(2, 8).to_dict()
    data.update(fields)
    return json.dumps(data)


PLAN_FILES = [
    ("binary", GARBAGE, ["plan.json", "not a text file", "UTF-8 JSON", "-o plan.json"]),
    ("deep", DEEP, ["plan.json", "nested too deeply", "-o plan.json"]),
    ("huge-batch", _plan_with(global_batch_size=HUGE), ["global_batch_size must be a whole number", "401 digits",
                                                       "re-make the plan"]),
    ("huge-share", _plan_with(predicted_step_s=HUGE), ["predicted_step_s must be a finite number", "re-make the plan"]),
]


@pytest.mark.parametrize(("content", "says"), [c[1:] for c in PLAN_FILES], ids=[c[0] for c in PLAN_FILES])
def test_a_bad_plan_file_is_a_planning_error(tmp_path, content, says):
    path = tmp_path / "plan.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(PlanningError) as err:
        Plan.load(path)
    for words in says:
        assert words in str(err.value), err.value


def test_a_garbage_profile_cache_is_profiled_again_with_a_warning(tmp_path, caplog):
    path = tmp_path / "cluster-0123.yaml"
    path.write_bytes(GARBAGE)
    with caplog.at_level(logging.WARNING):
        assert read_cached(path, world_size=2) is None
    assert f"ignoring the profile cache {path}" in caplog.text and "not a text file" in caplog.text
    assert "profiling again" in caplog.text


@pytest.mark.parametrize("output", [".", "..", "{tmp}"], ids=["dot", "dotdot", "existing-directory"])
def test_plan_output_to_a_directory_is_refused_before_planning(tmp_path, capsys, monkeypatch, output):
    monkeypatch.chdir(tmp_path)
    cluster = tmp_path / "cluster.json"
    cluster.write_text(_cluster(count=2))
    output = output.format(tmp=tmp_path)
    line = _one_error_line(capsys, module_main(["plan", str(cluster), "-b", "8", "-o", output]))
    assert f"-o {output!r} is a directory; give a file name, e.g. -o " in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.json"]  # nothing written


def test_plan_output_that_cannot_be_written_names_the_file_and_the_fix(tmp_path, capsys):
    cluster = tmp_path / "cluster.json"
    cluster.write_text(_cluster(count=2))
    (tmp_path / "blocker").write_text("a file where a directory should be")
    output = tmp_path / "blocker" / "plan.json"
    line = _one_error_line(capsys, module_main(["plan", str(cluster), "-b", "8", "-o", str(output)]))
    assert line == f"error: -o '{output}': '{tmp_path / 'blocker'}' is a file, not a folder; choose another -o", line


def test_profile_output_to_a_directory_is_refused_before_profiling(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a run that did not refuse would write its config.yaml
    line = _one_error_line(capsys, module_main(["profile", "--config", str(TINY), "-o", str(tmp_path)]))
    assert "is a directory; give a file name" in line, line


@pytest.mark.parametrize("entry", [module_main, train_main], ids=["python-m", "cephalo-train"])
def test_a_refusal_inside_the_lightning_cli_is_one_line_naming_the_fix(tmp_path, capsys, monkeypatch, entry):
    monkeypatch.chdir(tmp_path)
    plan = tmp_path / "plan.json"
    plan.write_bytes(GARBAGE)
    line = _one_error_line(capsys, entry(["fit", "--config", str(TINY), f"--trainer.strategy.init_args.plan={plan}"]))
    assert line.startswith(f"error: {plan}: not a text file") and "-o plan.json" in line, line


def test_a_refusal_exits_2_for_bad_input_and_1_otherwise(capsys):
    from cephalo_lightning.__main__ import refused
    from cephalo_lightning.runtime.checkpoint import CheckpointError

    assert refused(PlanningError("bad\n  input")) == 2
    assert refused(CheckpointError("a state that cannot go on")) == 1
    assert capsys.readouterr().err.splitlines() == ["error: bad input", "error: a state that cannot go on"]


def test_load_cluster_of_garbage_raises_planning_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(GARBAGE)
    with pytest.raises(PlanningError, match="not a text file"):
        load_cluster(path)


def _plan_dict(**rank0) -> dict:
    data = Plan.even(2, 8).to_dict()
    data["ranks"][0].update(rank0)
    return data


# messages that named the problem and now also say what to change
FIXES = [
    ("no-devices", lambda: cluster_from_dict({"model": MODEL}), "add one in rank order, e.g. devices:"),
    ("no-model", lambda: cluster_from_dict({"devices": []}), "add one, e.g. model: {num_layers"),
    ("model-key", lambda: cluster_from_dict({"model": {"num_layers": 2}, "devices": [{"name": "a100"}]}),
     "add it to the cluster file's model: section"),
    ("empty-devices", lambda: cluster_from_dict({"model": MODEL, "devices": []}), "list at least one, e.g."),
    ("no-name", lambda: cluster_from_dict({"model": MODEL, "devices": [{"count": 2}]}), "name a catalog GPU"),
    ("not-a-mapping", lambda: cluster_from_dict({"model": [1], "devices": []}), "write it as key: value pairs"),
    ("negative", lambda: cluster_from_dict({"model": MODEL, "devices": [{"name": "a100", "memory_gb": -1}]}),
     "set it to a number > 0 in the cluster file"),
    ("measured-without-memory", lambda: cluster_from_dict({"model": MODEL, "devices": [
        {"name": "x", "layer_fwd_ms": [1], "layer_bwd_ms": [2], "compute_memory_gb": [0.1]}]}),
     "add the device's memory in GiB"),
    ("slowdown", lambda: cluster_from_dict({"model": MODEL, "devices": [{"name": "a100", "emulate": {"slowdown": 0.5}}]}),
     "set 1 for full speed"),
    ("plan-shares", lambda: Plan.from_dict(_plan_dict(state_share=0.9)), "not 1; re-make the plan"),
    ("plan-micro-batch-size", lambda: Plan.from_dict(_plan_dict(micro_batch_size=3)), "set it to 4 or re-make"),
    ("plan-too-many-micro-batches", lambda: Plan.from_dict(_plan_dict(num_micro_batches=5, micro_batch_size=1, recompute=True)),
     "give it at most 4 micro-batches"),
]


@pytest.mark.parametrize(("make", "fix"), [c[1:] for c in FIXES], ids=[c[0] for c in FIXES])
def test_a_planner_message_says_what_to_change(make, fix):
    with pytest.raises(PlanningError) as err:
        make()
    assert fix in str(err.value), err.value
