"""The examples run and every shipped config parses.

* ``examples/what_if_planning.py`` prints its comparison table, with torch made unimportable;
* every cluster file under ``configs/clusters`` loads and plans;
* every LightningCLI config parses with the CLI's own parser (``--print_config``, nothing runs):
  the CPU configs alone, each GPU config alone and combined with each model-size config; the GPU
  configs are also instantiated on CPU (Trainer, strategy, callbacks, logger, a tiny model) so that
  a wrong init argument fails here rather than on the first GPU run;
* ``examples/train_plain.py`` and ``examples/bring_your_own_model.py`` train 3 steps end to end on
  2 emulated CPU ranks (Lightning relaunches them per rank, so they run as subprocesses with a
  clean environment).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from cephalo_lightning import load_cluster, plan
from tests.cli_config import print_config
from tests.conftest import HANG_TIMEOUT_S, clean_env, failure_report

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CONFIGS = ROOT / "configs"
CLI_CONFIGS = sorted(p for p in CONFIGS.glob("*.yaml"))  # quickstart, tiny-cli*
GPU_CONFIGS = sorted((CONFIGS / "gpu").glob("*.yaml"))
MODEL_CONFIGS = sorted((CONFIGS / "model").glob("*.yaml"))
CLUSTER_FILES = sorted((CONFIGS / "clusters").glob("*.yaml"))
MODEL_SIZES = {"tiny", "small", "gpt2-124m", "gpt-1.3b", "gpt-2.7b", "llama-7b-shape"}


def _ids(paths: list[Path]) -> list[str]:
    return [p.stem for p in paths]


def test_the_config_directories_hold_what_the_docs_promise():
    assert {p.stem for p in MODEL_CONFIGS} == MODEL_SIZES
    assert {"a100x2-v100x2", "l4-a6000-p40"} <= {p.stem for p in GPU_CONFIGS}
    assert CLI_CONFIGS and CLUSTER_FILES
    for path in GPU_CONFIGS:
        assert "NOT RUN HERE" in path.read_text(), f"{path.name} must say it was not run on GPUs"


# ----------------------------------------------------------------------------- what-if planning


@pytest.mark.multiprocess
def test_what_if_planning_prints_a_table_without_torch(tmp_path):
    # torch and lightning blocked: the planner and the example must not need them
    code = (
        "import runpy, sys; sys.modules['torch'] = None; sys.modules['lightning'] = None; "
        f"sys.argv = ['what_if_planning.py', '--batches', '16', '64', '--save-clusters', {str(tmp_path)!r}]; "
        f"runpy.run_path({str(EXAMPLES / 'what_if_planning.py')!r}, run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            env=clean_env(), timeout=HANG_TIMEOUT_S)
    assert result.returncode == 0, failure_report(result)
    out = result.stdout
    assert "PREDICTED" in out and "samples/s" in out and "vs even" in out
    for label in ("4x L4", "2x L4 + A6000", "2x A100-40GB + 2x V100-16GB"):
        assert label in out
    # a 7B model's fp32 Adam state cannot fit four L4s; GPT-2.7B on a mixed cluster can
    assert any(line.startswith("4x L4") and "llama-7b-shape" in line and "infeasible" in line for line in out.splitlines())
    speedup = re.compile(r"^2x L4 \+ A6000 \+ P40\s+gpt-2\.7b\s+16\s+[\d.]+\s+[\d.]+x\s+[\d.]+x\s+\d+%")
    assert any(speedup.match(line) for line in out.splitlines()), out
    saved = sorted(tmp_path.glob("*.yaml"))
    assert saved and all(load_cluster(p).world_size >= 3 for p in saved)  # the written files load


# ----------------------------------------------------------------------------- cluster files


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=_ids(CLUSTER_FILES))
def test_cluster_file_loads_and_plans(path):
    cluster = load_cluster(path)
    result = plan(cluster, 64)
    assert result.world_size == cluster.world_size
    assert result.predicted_samples_per_s and result.predicted_samples_per_s > 0


# ----------------------------------------------------------------------------- LightningCLI configs


@pytest.mark.parametrize("path", CLI_CONFIGS, ids=_ids(CLI_CONFIGS))
def test_cpu_config_parses(path):
    config = print_config(path)
    assert config["trainer"]["accelerator"] == "cpu"
    assert config["model"]["class_path"] and config["data"]["class_path"]


def _class_names(entries: list[dict[str, Any]] | None) -> list[str]:
    return [e["class_path"].rsplit(".", 1)[-1] for e in entries or []]


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=_ids(GPU_CONFIGS))
def test_gpu_config_parses_on_its_own(path):
    config = print_config(path)
    trainer = config["trainer"]
    assert trainer["accelerator"] == "gpu" and trainer["devices"] >= 1
    assert trainer["precision"] in ("bf16-mixed", "16-mixed", "32-true")
    assert trainer["strategy"]["class_path"] == "cephalo_lightning.CephaloStrategy"
    assert trainer["logger"]["class_path"].endswith("WandbLogger") and trainer["logger"]["init_args"]["offline"]
    assert {"CephaloCallback", "ModelCheckpoint"} <= set(_class_names(trainer["callbacks"]))
    # the interpolations resolved: every output goes under the config's own directory
    out = config["vars"]["out"]
    assert trainer["default_root_dir"] == out and "${" not in yaml.safe_dump(config)


@pytest.mark.parametrize("model", MODEL_CONFIGS, ids=_ids(MODEL_CONFIGS))
@pytest.mark.parametrize("gpu", GPU_CONFIGS, ids=_ids(GPU_CONFIGS))
def test_model_config_combines_with_gpu_config(gpu, model):
    config = print_config(gpu, model)
    own = yaml.safe_load(model.read_text())
    init = config["model"]["init_args"]
    assert init["preset"] == own["model"]["init_args"]["preset"] == model.stem
    assert init["seq_len"] == config["data"]["init_args"]["seq_len"], "model and data disagree on seq_len"
    assert config["data"]["init_args"]["batch_size"] == own["data"]["init_args"]["batch_size"]
    # the hardware half is untouched by the model half
    assert config["trainer"]["accelerator"] == "gpu"
    assert config["trainer"]["precision"] == yaml.safe_load(gpu.read_text())["trainer"]["precision"]


@pytest.mark.parametrize("gpu", GPU_CONFIGS, ids=_ids(GPU_CONFIGS))
def test_gpu_config_instantiates_on_cpu(gpu, tmp_path, monkeypatch):
    """Trainer, strategy, callbacks and logger built for real (a tiny model; nothing is fitted)."""
    from cephalo_lightning import CephaloCallback, CephaloStrategy
    from cephalo_lightning.lightning.cli import CephaloCLI

    monkeypatch.chdir(tmp_path)  # the configs write under runs/ relative to the working directory
    monkeypatch.setenv("WANDB_MODE", "disabled")
    # the same parser settings as cephalo_lightning.lightning.cli, with run=False: build, do not fit
    cli = CephaloCLI(
        args=["--config", str(gpu), "--config", str(CONFIGS / "model" / "tiny.yaml"),
              "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1"],
        run=False, subclass_mode_model=True, subclass_mode_data=True, parser_kwargs={"parser_mode": "omegaconf"},
    )
    assert isinstance(cli.trainer.strategy, CephaloStrategy)
    assert cli.trainer.strategy.param_dtype is not None  # the configs gather parameters in 16 bits
    assert any(isinstance(c, CephaloCallback) for c in cli.trainer.callbacks)
    assert cli.model.config.n_layer == 2  # tiny


# ----------------------------------------------------------------------------- training examples


def _run_example(script: str, *args: str, cwd: Path, stderr: list[str] | None = None) -> str:
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                            cwd=cwd, env=clean_env(), timeout=HANG_TIMEOUT_S)
    assert result.returncode == 0, failure_report(result)
    if stderr is not None:
        stderr.append(result.stderr)
    return result.stdout


@pytest.mark.multiprocess
def test_train_plain_trains_on_two_emulated_ranks_and_resumes_with_other_steps(tmp_path):
    out = _run_example("train_plain.py", "--steps", "3", "--preset", "tiny", "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert "cephalo plan, layered mode" in out and "(emulated)" in out
    assert "Cephalo summary" in out and "trained to step 3" in out
    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert checkpoint.is_dir() and f"checkpoint: {checkpoint}" in out  # a sharded checkpoint directory
    assert (tmp_path / "run" / "plan.json").is_file() and load_cluster(tmp_path / "run" / "cluster.yaml").world_size == 2
    # another --steps: the checkpoint callback finds its own state again (same key, same last.ckpt)
    stderr: list[str] = []
    out = _run_example("train_plain.py", "--steps", "5", "--preset", "tiny", "--out", str(tmp_path / "run"),
                       "--resume", str(checkpoint), cwd=tmp_path, stderr=stderr)
    assert "trained to step 5" in out
    assert "callbacks used to create the checkpoint" not in stderr[0], stderr[0][-2000:]
    assert sorted(p.name for p in checkpoint.parent.iterdir() if p.name.startswith("last")) == ["last.ckpt"]


@pytest.mark.multiprocess
def test_bring_your_own_model_trains_both_ways(tmp_path):
    out = _run_example("bring_your_own_model.py", "--steps", "3", "--out", str(tmp_path / "byo"), cwd=tmp_path)
    assert "cephalo plan, uniform mode" in out and "cephalo plan, layered mode" in out
    assert "[uniform] after 3 steps" in out and "[layered] after 3 steps" in out
    # the same global batches and the gradient of the same mean loss, split two different ways
    difference = float(out.split("difference ")[1].split()[0])
    assert difference < 1e-3


@pytest.mark.multiprocess
def test_slurm_script_asks_for_the_requeue_signal_and_resumes_from_last():
    script = (EXAMPLES / "slurm.sbatch").read_text()
    directives = [line.split("#", 2)[1].strip() for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "SBATCH --signal=SIGUSR1@90" in directives and "SBATCH --requeue" in directives
    # the strategy's stop saves last-preempted.ckpt, which only ckpt_path="last" resumes from: the job
    # body the script sources launches with it (tests/test_slurm_example.py runs the script through the requeue)
    assert "source examples/slurm_job.sh" in script and "--ckpt_path=last" in (EXAMPLES / "slurm_job.sh").read_text()
    assert subprocess.run(["bash", "-n", str(EXAMPLES / "slurm.sbatch")]).returncode == 0
