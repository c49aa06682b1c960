"""The planner's files and command line: a cluster file round-trips to plan JSON, the CLI's table, JSON, output
and exit codes, the module entry point, and the planner imports without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cephalo_lightning.planner import Plan, load_cluster, plan, save_cluster
from cephalo_lightning.planner.command import main as cli_main
from tests.conftest import HANG_TIMEOUT_S
from tests.planner_cases import CLUSTERS, ROOT


def test_round_trip_cluster_file_to_plan_json(tmp_path: Path) -> None:
    cluster = load_cluster(CLUSTERS / "t4-example.yaml")
    saved = tmp_path / "cluster.json"
    save_cluster(cluster, saved)
    assert load_cluster(saved) == cluster
    p = plan(load_cluster(saved), 96)
    p.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == p
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["global_batch_size"] == 96 and data["ranks"][0]["device"] == "t4"
    assert {"even", "proportional"} <= set(data["baselines"]) and data["upper_bound_samples_per_s"] > 0


def test_cli_table_json_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert cli_main([str(CLUSTERS / "l4-a6000-p40.yaml"), "--global-batch-size", "64", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "a6000" in text and "samples/s" in text and "proportional" in text and "predictions" in text
    assert Plan.load(out).global_batch_size == 64
    assert cli_main([str(CLUSTERS / "a100x2-v100x2.yaml"), "-b", "64", "--json", "--mode", "uniform"]) == 0
    assert json.loads(capsys.readouterr().out)["mode"] == "uniform"


def test_cli_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main([str(tmp_path / "missing.yaml"), "-b", "8"]) == 2
    assert capsys.readouterr().err.startswith("error: cluster file")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {num_layers: 2, parameters: 10}\ndevices: []\n")
    assert cli_main([str(bad), "-b", "8"]) == 2
    assert "error: devices must be a non-empty list" in capsys.readouterr().err
    assert cli_main([str(CLUSTERS / "t4-example.yaml")]) == 2  # argparse: missing --global-batch-size


@pytest.mark.multiprocess
def test_module_entry_point(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    result = subprocess.run(
        [sys.executable, "-m", "cephalo_lightning", "plan", str(CLUSTERS / "t4-example.yaml"), "-b", "48",
         "--json", "-o", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=HANG_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == json.loads(out.read_text().strip())


@pytest.mark.multiprocess
def test_planner_imports_without_torch() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['lightning'] = None\n"
        "sys.modules['pytorch_lightning'] = None\n"
        "import cephalo_lightning.planner as planner\n"
        f"p = planner.plan(planner.load_cluster({str(CLUSTERS / 'l4-a6000-p40.yaml')!r}), 16)\n"
        "from cephalo_lightning.planner.report import render_plan\n"
        "render_plan(p)\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=HANG_TIMEOUT_S)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
