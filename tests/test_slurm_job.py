"""The SLURM job scripts refuse an environment that cannot train on GPUs and launch with the settings
a multi-node job needs.

Both ``examples/*.sbatch`` run as SLURM would start them, with ``srun``, ``scontrol``, ``nvidia-smi``
and ``ip`` as stubs on ``PATH`` that record their calls, and the variables of a 2-node, 8-task job:

* without ``CEPHALO_VENV``, or ``NCCL_SOCKET_IFNAME``, the job stops with one ``error:`` line naming
  the variable, before any ``srun``;
* with the CPU build of torch (this machine's) it stops with exit 2, saying so, before any ``srun``;
* with an environment whose ``python`` reports CUDA (a stub), ``srun`` starts the fit with
  ``--kill-on-bad-exit=1`` on the job's nodes and tasks, the named config, ``--ckpt_path=last`` and
  the script's arguments, under NCCL settings for Ethernet (InfiniBand off, the interface named,
  gloo on the same one, a collective that times out aborts its process); ``NCCL_IB_DISABLE=0``
  (InfiniBand) and ``PLAN`` (a pinned plan) pass through.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import HANG_TIMEOUT_S, clean_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"hf-two-nodes": "configs/hf/lora-a100x4-rtx3090x4.yaml", "slurm": "configs/gpu/a100x4-l4x4.yaml"}
RECORDED = ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "GLOO_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            "CUDA_DEVICE_ORDER")
STUBS = {
    # srun: record the call and the environment the tasks get; run the node listing's bash -c
    "srun": ('echo "srun $*" >> "$CALLS"\n'
             + "".join(f'echo "  {k}=${{{k}:-}}" >> "$CALLS"\n' for k in RECORDED)
             + 'while [[ "${1:-}" == --* ]]; do shift; done\n'
             + 'if [[ "${1:-}" == bash ]]; then exec "$@"; fi\n'),
    "scontrol": 'echo nodea; echo nodeb\n',
    "nvidia-smi": 'echo "0, NVIDIA stand-in, 0 MiB"\n',
    "ip": 'echo "eno1 UP 10.0.0.1/24"\n',
}


def _executables(folder: Path, bodies: dict[str, str]) -> Path:
    folder.mkdir(parents=True)
    for name, body in bodies.items():
        path = folder / name
        path.write_text("#!/usr/bin/env bash\nset -euo pipefail\n" + body)
        path.chmod(0o755)
    return folder


def _cuda_venv(folder: Path) -> Path:
    """A stand-in environment: its python says CUDA torch is there, and is never asked more."""
    bin_dir = _executables(folder / "bin", {"python": 'if [[ "$1" == -c ]]; then echo 2.13.0+cu128; exit 0; fi\n'
                                                      'echo "python $*" >> "$CALLS"\n'})
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    return folder


def _submit(script: str, tmp_path: Path, *args: str, **variables: str) -> tuple[subprocess.CompletedProcess, str]:
    calls = tmp_path / "calls.log"
    calls.write_text("")
    stubs = _executables(tmp_path / "stubs", STUBS) if not (tmp_path / "stubs").exists() else tmp_path / "stubs"
    env = {k: v for k, v in clean_env().items() if not k.startswith(("SLURM_", "NCCL_", "GLOO_", "CEPHALO_", "TORCH_NCCL"))}
    env.update(PATH=f"{stubs}:/usr/bin:/bin", CALLS=str(calls), SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_ID="4711",
               SLURM_JOB_NUM_NODES="2", SLURM_NTASKS_PER_NODE="4", SLURM_NTASKS="8", SLURM_JOB_NODELIST="node[a-b]",
               **variables)
    done = subprocess.run(["bash", str(ROOT / "examples" / f"{script}.sbatch"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    return done, calls.read_text()


@pytest.mark.multiprocess
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_job_without_its_environment_stops_with_one_error_line(script, tmp_path):
    for given, missing in (({"NCCL_SOCKET_IFNAME": "eno1"}, "CEPHALO_VENV"),
                           ({"CEPHALO_VENV": str(_cuda_venv(tmp_path / "venv"))}, "NCCL_SOCKET_IFNAME")):
        done, calls = _submit(script, tmp_path, **given)
        assert done.returncode != 0 and calls == ""
        assert f"error: set {missing} to" in done.stderr, done.stderr


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.version.cuda is not None, reason="needs this machine's CPU build of torch")
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_job_in_an_environment_with_cpu_torch_is_refused(script, tmp_path):
    done, calls = _submit(script, tmp_path, CEPHALO_VENV=sys.prefix, NCCL_SOCKET_IFNAME="eno1")
    assert done.returncode == 2 and calls == "", done.stdout + done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "cannot train on GPUs" in error[0], done.stderr
    assert "AssertionError: the CPU build of torch" in error[0]
    assert "install torch from the CUDA index into it" in error[0]


def _fit_call(calls: str) -> tuple[str, dict[str, str]]:
    blocks = calls.split("srun ")[1:]
    fits = [b for b in blocks if "cephalo_lightning fit" in b]
    assert len(fits) == 1, calls
    line, *env = fits[0].strip().splitlines()
    return line, dict(e.strip().split("=", 1) for e in env)


@pytest.mark.multiprocess
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_job_launches_every_rank_with_the_multi_node_settings(script, tmp_path):
    venv = _cuda_venv(tmp_path / "venv")
    done, calls = _submit(script, tmp_path, "--vars.out=/shared/run", CEPHALO_VENV=str(venv),
                          NCCL_SOCKET_IFNAME="eno1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nodes in rank order: nodea nodeb" in done.stdout and "eno1 10.0.0.1/24" in done.stdout
    line, env = _fit_call(calls)
    assert line == (f"--kill-on-bad-exit=1 python -m cephalo_lightning fit --config {SCRIPTS[script]} "
                    "--trainer.num_nodes=2 --trainer.devices=4 --ckpt_path=last --vars.out=/shared/run")
    assert (ROOT / SCRIPTS[script]).is_file()
    assert env == {"NCCL_SOCKET_IFNAME": "eno1", "NCCL_IB_DISABLE": "1", "GLOO_SOCKET_IFNAME": "eno1",
                   "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

    done, calls = _submit(script, tmp_path, CEPHALO_VENV=str(venv), NCCL_SOCKET_IFNAME="ib0", NCCL_IB_DISABLE="0",
                          PLAN="plans/p.json")
    assert done.returncode == 0, done.stdout + done.stderr
    line, env = _fit_call(calls)
    assert line.endswith("--ckpt_path=last --trainer.strategy.init_args.plan=plans/p.json")
    assert (env["NCCL_IB_DISABLE"], env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == ("0", "ib0", "ib0")
