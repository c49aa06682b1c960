"""The shipped SLURM job script resumes where a preempted job stopped.

``examples/slurm.sbatch`` runs as SLURM would run it, twice, on one CPU rank: ``srun``, ``scontrol``
and ``nvidia-smi`` are stubs on ``PATH`` (``scontrol requeue`` records its call), the SLURM variables
are those of a one-task job, ``CONFIG`` points the script at a tiny CPU model, and
``CEPHALO_ALLOW_CPU=1`` lets it run on this machine's CPU torch (over the loopback interface). In the
first run SIGUSR1 arrives after step 2 (the scheduler's ``--signal``, sent by ``tests/slurm_steps.py``):
the job exits with the requeue status, having saved the preemption checkpoint and asked for the
requeue. The second run is the requeued job, the same script with the same arguments: it must start at step 3, not
0, and train to ``max_steps``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cephalo_lightning.lightning.fit.preemption import CHECKPOINT_NAME, EXIT_REQUEUED
from cephalo_lightning.runtime import checkpoint
from tests.conftest import HANG_TIMEOUT_S, clean_env, failure_report

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "slurm.sbatch"
SIGNAL_AFTER = 2
STOPS_AT = SIGNAL_AFTER + 1  # the signal is seen in the next step's all-reduce; that step completes
MAX_STEPS = 5
JOB_ID = "4711"

CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  max_steps: {max_steps}
  default_root_dir: {out}
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  limit_val_batches: 0
  strategy:
    class_path: cephalo_lightning.CephaloStrategy
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: {out}/checkpoints
        save_top_k: 0
    - class_path: tests.slurm_steps.SignalAndRecordSteps
model:
  class_path: cephalo_lightning.demo.GPTModule
  init_args:
    preset: tiny
    seq_len: 16
data:
  class_path: cephalo_lightning.demo.TextDataModule
  init_args:
    seq_len: 16
    batch_size: 4
    max_train_samples: 64
    max_val_samples: 8
"""

STUBS = {
    # srun: drop its options, run the task (one task: the job's only rank)
    "srun": 'while [[ "${1:-}" == --* ]]; do shift; done\nexec "$@"\n',
    "scontrol": 'if [[ "$1" == show ]]; then echo node01; else echo "$@" >> "$SCONTROL_LOG"; fi\n',
    "nvidia-smi": 'echo "0, CPU stand-in, 0 MiB"\n',
}


def _stubs(folder: Path) -> Path:
    folder.mkdir()
    for name, body in STUBS.items():
        path = folder / name
        path.write_text("#!/usr/bin/env bash\nset -euo pipefail\n" + body)
        path.chmod(0o755)
    return folder


def _submit(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], cwd=env["SLURM_SUBMIT_DIR"], env=env, capture_output=True, text=True,
                          timeout=HANG_TIMEOUT_S)


@pytest.mark.multiprocess
def test_the_sbatch_script_resumes_a_requeued_job_at_the_saved_step(tmp_path):
    out = tmp_path / "run"
    config = tmp_path / "cpu.yaml"
    config.write_text(CONFIG.format(max_steps=MAX_STEPS, out=out))
    steps = tmp_path / "steps.log"
    scontrol_log = tmp_path / "scontrol.log"
    bin_dir = _stubs(tmp_path / "bin")
    env = clean_env(
        PATH=f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin", PYTHONPATH=str(ROOT),
        CEPHALO_VENV=sys.prefix, CEPHALO_ALLOW_CPU="1", NCCL_SOCKET_IFNAME="lo", CONFIG=str(config),
        SLURM_SUBMIT_DIR=str(ROOT), SCONTROL_LOG=str(scontrol_log),
        CEPHALO_TEST_STEPS=str(steps), SLURM_JOB_ID=JOB_ID, SLURM_JOB_NAME="cephalo-test", SLURM_NTASKS="1",
        SLURM_NTASKS_PER_NODE="1", SLURM_JOB_NUM_NODES="1", SLURM_NODEID="0", SLURM_PROCID="0", SLURM_LOCALID="0",
        SLURM_NODELIST="127.0.0.1", SLURM_JOB_NODELIST="127.0.0.1")
    env.pop("CEPHALO_DIR", None)

    first = _submit({**env, "CEPHALO_TEST_SIGNAL_AFTER": str(SIGNAL_AFTER)})
    assert first.returncode == EXIT_REQUEUED, failure_report(first)
    assert scontrol_log.read_text().splitlines() == [f"requeue {JOB_ID}"]
    saved = out / "checkpoints" / CHECKPOINT_NAME
    assert checkpoint.is_complete(saved) and checkpoint.read_meta(saved)["global_step"] == STOPS_AT

    again = _submit({**env, "SLURM_RESTART_COUNT": "1"})  # the requeued job: same script, same arguments
    assert again.returncode == 0, failure_report(again)
    assert steps.read_text().splitlines() == ["start 0", f"start {STOPS_AT}", f"end {MAX_STEPS}"]
