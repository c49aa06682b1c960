"""The fault-tolerant SLURM recipe (``examples/ft-two-nodes.sbatch``) runs its commands as written.

The script runs as SLURM would run it on a 2-node allocation, on this machine's CPU: ``srun``,
``scontrol`` and ``nvidia-smi`` are stand-ins on ``PATH`` (``srun`` runs its command here, as a
one-task step of the node it names, with its own rendezvous port), ``CONFIG`` is the shipped CPU
config ``configs/fault-tolerance.yaml`` and ``PLAN`` two groups of one CPU rank. So every command the
recipe runs is parsed and run by the package itself: the lighthouse through its entry point, each
group's ``fit`` with the recipe's overrides. Group 1's first step fails at once (its node lost, status
137): the recipe must start it again and still end with both groups trained to the end, the
lighthouse stopped and its address file removed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HANG_TIMEOUT_S, clean_env, failure_report
from tests.plans import plan_of

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "ft-two-nodes.sbatch"

SRUN = r'''
ntasks=1
node=""
while [[ "${1:-}" == --* ]]; do
    case "$1" in
        --ntasks=*) ntasks="${1#--ntasks=}" ;;
        --nodelist=*) node="${1#--nodelist=}" ;;
    esac
    shift
done
echo "srun on ${node:-every node}: $*" >> "$SRUN_LOG"
if [[ -n "$node" && "$node" == "${FAIL_NODE_ONCE:-}" && ! -e "$SRUN_LOG.failed" ]]; then
    touch "$SRUN_LOG.failed"
    exit 137   # the node is lost before its group starts
fi
port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export SLURM_NTASKS="$ntasks" SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0 SLURM_NODELIST=127.0.0.1 MASTER_PORT="$port"
exec "$@"
'''
STUBS = {
    "srun": SRUN,
    "scontrol": 'if [[ "$1 $2" == "show hostnames" ]]; then printf "node-a\\nnode-b\\n"; fi\n',
    "nvidia-smi": 'echo "0, CPU stand-in, 0 MiB"\n',
}


def _environment(tmp_path: Path, **extra: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        path = bin_dir / name
        path.write_text("#!/usr/bin/env bash\nset -euo pipefail\n" + body)
        path.chmod(0o755)
    plan = tmp_path / "plan.json"
    plan_of(batches=[4, 4], micro=[1, 1], shares=[1.0, 1.0], devices=["cpu", "cpu"], groups=[0, 1]).save(plan)
    env = clean_env(
        PATH=f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin", PYTHONPATH=str(ROOT), RUST_LOG="warn",
        CEPHALO_VENV=sys.prefix, CEPHALO_ALLOW_CPU="1", NCCL_SOCKET_IFNAME="lo", SLURM_SUBMIT_DIR=str(ROOT),
        SRUN_LOG=str(tmp_path / "srun.log"), LIGHTHOUSE_ADDRESS_FILE=str(tmp_path / "lighthouse.address"),
        LIGHTHOUSE_PORT="0", GROUP_RESTART_DELAY="0", PLAN=str(plan), SLURM_JOB_ID="4712",
        SLURM_JOB_NAME="cephalo-ft-test", SLURM_JOB_NUM_NODES="2", SLURM_NTASKS_PER_NODE="1",
        SLURM_JOB_NODELIST="node-a,node-b", OMP_NUM_THREADS="1", **extra)
    env.pop("CEPHALO_DIR", None)
    env.pop("TORCHFT_LIGHTHOUSE", None)
    return env


def _submit(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=HANG_TIMEOUT_S)


def test_the_script_is_valid_bash_and_refuses_to_start_without_the_plan(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    env = _environment(tmp_path)
    env.pop("PLAN")
    done = _submit(env)
    assert done.returncode == 2 and "error: set PLAN" in done.stderr, failure_report(done)
    assert not (tmp_path / "srun.log").exists()  # refused before any step or the lighthouse


@pytest.mark.multiprocess
def test_a_group_whose_node_fails_is_started_again_and_both_groups_train_to_the_end(tmp_path):
    pytest.importorskip("torchft")
    env = _environment(tmp_path, FAIL_NODE_ONCE="node-b")
    done = _submit(env, f"--vars.out={tmp_path / 'run'}", "--vars.steps=4")
    out = done.stdout + done.stderr
    assert done.returncode == 0, failure_report(done)
    steps = (tmp_path / "srun.log").read_text().splitlines()
    group_steps = [s for s in steps if "cephalo_lightning fit" in s]
    # group 0 once, group 1 twice (its first step lost): each with the recipe's overrides, on its node
    assert sorted(s.split(":")[0] for s in group_steps) == ["srun on node-a", "srun on node-b", "srun on node-b"]
    for s in group_steps:
        assert "--trainer.strategy.init_args.fault_tolerance=true" in s and f"plan={env['PLAN']}" in s
        assert "--trainer.devices=1" in s and s.endswith("--vars.steps=4")
    assert "group 1 (node-b) ended with status 137; starting it again" in out
    assert "group 0 (node-a) finished" in out and "group 1 (node-b) finished" in out
    assert "2 of 2 groups trained to the end" in out
    assert "lighthouse stopped" in out and not (tmp_path / "lighthouse.address").exists()
    assert (tmp_path / "run" / "config.yaml").exists()  # each group's resolved config under vars.out, not the cwd
