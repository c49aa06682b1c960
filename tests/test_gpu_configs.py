"""The GPU configs on a machine without GPUs: Lightning's no-GPU refusal, before any model is built.

The configs train 1.2B-6.7B shapes; the demo module builds its GPT in ``configure_model()`` (on the
meta device under Cephalo), so constructing a run allocates nothing model-sized. Checked in one
child process building every config in turn: each fails with Lightning's own message and the
child's peak resident memory stays within half of what importing the package already took
(the 7B shape alone is ~26 GB in fp32).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HANG_TIMEOUT_S, clean_env, failure_report

ROOT = Path(__file__).resolve().parents[1]
GPU_CONFIGS = sorted((ROOT / "configs" / "gpu").glob("*.yaml"))

CHILD = """
import json, resource, sys
from lightning.fabric.utilities.exceptions import MisconfigurationException
from cephalo_lightning.lightning.cli import run_cli

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

after_import = peak()
refusals = {}
for config in sys.argv[1:]:
    try:
        run_cli(["--config", config], run=False)  # the model, data, logger, callbacks, then the Trainer
        refusals[config] = None
    except MisconfigurationException as err:
        refusals[config] = str(err)
print(json.dumps({"after_import": after_import, "peak": peak(), "refusals": refusals}))
"""


@pytest.mark.multiprocess
def test_gpu_configs_on_a_cpu_machine_fail_with_lightnings_no_gpu_message_in_bounded_memory(tmp_path):
    assert GPU_CONFIGS
    result = subprocess.run([sys.executable, "-c", CHILD, *map(str, GPU_CONFIGS)], capture_output=True, text=True,
                            cwd=tmp_path, env=clean_env(PYTHONPATH=str(ROOT)), timeout=HANG_TIMEOUT_S)
    assert result.returncode == 0, failure_report(result, tail=4000)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for config, refusal in report["refusals"].items():
        assert refusal is not None and "No supported gpu backend found" in refusal, (config, refusal)
    grown = report["peak"] - report["after_import"]
    assert grown < report["after_import"] / 2, f"building the runs took {grown / 2**20:.0f} MiB of host memory"
