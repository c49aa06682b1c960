"""The README stays true: its commands exist and its cluster-file example parses and plans."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from cephalo_lightning.planner import cluster_from_dict, plan

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_two_commands_are_the_makefile_targets_and_ci_runs_the_test_one():
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_cluster_file_example_parses_and_plans():
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", README, re.S) if b.startswith("model:"))
    cluster = cluster_from_dict(yaml.safe_load(block))
    assert cluster.world_size == 3 and {d.source for d in cluster.devices} == {"measured", "catalog"}
    assert plan(cluster, 16).global_batch_size == 16
