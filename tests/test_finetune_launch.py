"""``examples/finetune_hf.py`` on several nodes: every process knows its ranks from its launcher.

The launchers are simulated by their environment variables alone (no ``srun``, no ``torchrun``, no
process group): ``srun`` sets ``SLURM_PROCID`` / ``SLURM_LOCALID`` / ``SLURM_NODEID`` and no
``LOCAL_RANK``; ``torchrun`` sets ``RANK`` / ``LOCAL_RANK`` / ``GROUP_RANK`` and no ``NODE_RANK``. The
script's Trainer (2 nodes x 4 devices, CPU) is built in-process and must report the ranks the
variables name, so that only global rank 0 writes the outputs; a process on node 1 with local rank 0
is not global rank 0. Under either launcher every process starts the script at once, so the script
refuses to make the tiny default model and sample text there.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from lightning.pytorch.utilities import rank_zero_only

pytest.importorskip("transformers")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
SLURM_KEYS = ("SLURM_", "TORCHELASTIC_", "GROUP_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK",
              "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE")


def _srun(procid: int, localid: int, nodeid: int) -> dict[str, str]:
    return {"SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
            "SLURM_JOB_NAME": "cephalo-hf", "SLURM_JOB_ID": "4711", "SLURM_NODELIST": "nodea,nodeb",
            "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid)}


def _torchrun(rank: int, local_rank: int, group_rank: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": str(group_rank), "WORLD_SIZE": "8",
            "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "job1"}


# (launcher, variables, expected (global rank, node rank, local rank)): node 1's local rank 0 is rank 4
LAUNCHES = [
    ("srun", _srun(5, 1, 1), (5, 1, 1)),
    ("srun", _srun(4, 0, 1), (4, 1, 0)),
    ("srun", _srun(0, 0, 0), (0, 0, 0)),
    ("torchrun", _torchrun(4, 0, 1), (4, 1, 0)),
    ("torchrun", _torchrun(6, 2, 1), (6, 1, 2)),
    ("torchrun", _torchrun(0, 0, 0), (0, 0, 0)),
]
ENVIRONMENTS = {"srun": "SLURMEnvironment", "torchrun": "TorchElasticEnvironment"}


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("finetune_hf_example", ROOT / "examples" / "finetune_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def launched(monkeypatch):
    """Set a launcher's variables on a clean slate (every launcher variable of the test's own environment removed)."""
    for key in list(os.environ):
        if key.startswith(SLURM_KEYS):
            monkeypatch.delenv(key)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)  # restored after the test, whatever a Trainer sets

    def launch(variables: dict[str, str]) -> None:
        for key, value in variables.items():
            monkeypatch.setenv(key, value)

    return launch


@pytest.mark.parametrize(("launcher", "variables", "expected"), LAUNCHES,
                         ids=[f"{name}-rank{want[0]}" for name, _, want in LAUNCHES])
def test_the_script_takes_its_ranks_from_the_launcher(script, launched, tmp_path, launcher, variables, expected):
    launched(variables)
    args = script.parse(["--out", str(tmp_path), "--base", str(tmp_path), "--data", str(tmp_path / "train.jsonl"),
                         "--devices", "4", "--num-nodes", "2", "--accelerator", "cpu"])
    assert script.launched_externally()
    trainer = script.build_trainer(args, tmp_path, tmp_path)
    assert type(trainer.strategy.cluster_environment).__name__ == ENVIRONMENTS[launcher]
    assert (trainer.global_rank, trainer.node_rank, trainer.local_rank) == expected
    assert (trainer.world_size, trainer.num_nodes, trainer.num_devices) == (8, 2, 4)
    assert trainer.is_global_zero == (expected[0] == 0)
    assert len(trainer.strategy.emulate) == 8  # one emulated device per rank of the whole job


@pytest.mark.parametrize("variables", [_srun(0, 0, 0), _torchrun(0, 0, 0)], ids=["srun", "torchrun"])
def test_under_a_launcher_the_script_refuses_to_make_its_own_model(script, launched, tmp_path, variables, capsys):
    launched(variables)
    with pytest.raises(SystemExit, match="^error: under srun or torchrun every process starts this script at once.*"
                                         "give --base .* and --text or --data"):
        script.main(["--out", str(tmp_path), "--devices", "4", "--num-nodes", "2"])
    assert not any(tmp_path.iterdir()), "nothing may be written before the refusal"


def test_the_script_stores_the_base_in_nf4_with_quantize(script, launched, tmp_path):
    args = script.parse(["--out", str(tmp_path), "--base", str(tmp_path), "--quantize", "nf4", "--devices", "2"])
    assert str(script.build_trainer(args, tmp_path, tmp_path).strategy.config.base_storage) == "nf4"
    args = script.parse(["--out", str(tmp_path), "--base", str(tmp_path), "--devices", "2"])
    assert str(script.build_trainer(args, tmp_path, tmp_path).strategy.config.base_storage) == "compute"
    with pytest.raises(SystemExit, match="--quantize stores a frozen base, and --full freezes nothing"):
        script.main(["--out", str(tmp_path), "--full", "--quantize", "nf4"])
