"""What a run leaves in its loggers and logs, read back from the files (W&B offline, CSV, stderr).

* the run's configuration (trainer, strategy, callback, the plan per rank, the cluster, emulation)
  in the W&B run config and in the CSV logger's ``hparams.yaml``; ``plan.json`` and the cluster
  file as W&B run files; checkpoint directories as W&B model artifacts, following ``log_model``;
* the profiling lines and the per-rank lines in a plain (non-terminal) log.

The offline run is read record by record: a ``.wandb`` file is a LevelDB-format log of wandb's
``Record`` protobufs (32 KiB blocks, 7-byte record headers, after a 7-byte file header), written
by wandb's service process, so it is read once the run's ``exit`` record is there.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import yaml

from cephalo_lightning import CephaloCallback, CephaloStrategy, Plan
from cephalo_lightning.lightning.fit.loggers import log_checkpoint_artifacts, rank_lines
from cephalo_lightning.planner import RankPlan
from tests.conftest import HANG_TIMEOUT_S, clean_env, failure_report

ROOT = Path(__file__).resolve().parents[3]


def wandb_records(run_dir: Path, timeout: float = HANG_TIMEOUT_S) -> list:
    """The run's records, once its ``exit`` record is written (wandb's service writes after ``finish``)."""
    deadline = time.monotonic() + timeout
    while True:
        records = _read_records(next(run_dir.glob("*.wandb")))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _read_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if not data:
        return []
    assert data[:4] == b":W&B", "not a wandb transaction log"
    block, pos, payloads, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # the service is still writing this record: read it next time
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:  # FULL
            payloads.append(chunk)
        elif kind in (2, 3):  # FIRST, MIDDLE
            pending += chunk
        elif kind == 4:  # LAST
            payloads.append(pending + chunk)
            pending = b""
    return [wandb_internal_pb2.Record.FromString(p) for p in payloads]


def test_rank_lines_name_device_batch_micro_batches_share_time_and_memory():
    plan = Plan(12, "layered", (
        RankPlan(rank=0, device="a100", batch_size=9, num_micro_batches=2, micro_batch_size=5, state_share=0.25,
                 predicted_step_s=0.5, predicted_memory_gb=11.04, memory_limit_gb=30.0),
        RankPlan(rank=1, device="cpu (emulated x3.0, 0.5 GiB)", batch_size=3, num_micro_batches=1, micro_batch_size=3,
                 state_share=0.5, predicted_step_s=0.25, predicted_memory_gb=0.2, source="emulated"),
        RankPlan(rank=2, device="p40", batch_size=0, num_micro_batches=1, micro_batch_size=0, state_share=0.25),
    ))
    assert rank_lines(plan) == [
        "Cephalo rank 0: a100: batch 9 in 2 micro-batches of 4-5, state share 25.0%, "
        "predicted 0.5 s/step and 11 GiB of 30 usable",
        "Cephalo rank 1: cpu (emulated x3.0, 0.5 GiB): batch 3 in 1 micro-batch of 3, state share 50.0%, "
        "predicted 0.25 s/step and 0.2 GiB, emulated",
        "Cephalo rank 2: p40: no samples (stores state only), state share 25.0%, "
        "not priced (a plan given as it is, without a cluster file to predict it from)",
    ]


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    """Two steps on one emulated rank with W&B (offline, log_model="all") and CSV loggers."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    from cephalo_lightning.demo import GPTModule, TextDataModule

    root = tmp_path_factory.mktemp("wandb")
    env = {"WANDB_MODE": "offline", "WANDB_DATA_DIR": root / "data", "WANDB_CACHE_DIR": root / "cache",
           "WANDB_CONFIG_DIR": root / "config", "WANDB_SILENT": "true"}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, str(value))
        warnings.simplefilter("ignore")
        wandb_logger = WandbLogger(save_dir=root, project="cephalo-test", log_model="all")
        csv = CSVLogger(root, name="csv")
        checkpoints = ModelCheckpoint(dirpath=root / "checkpoints", save_last=True)
        trainer = pl.Trainer(
            strategy=CephaloStrategy(emulate=[{"slowdown": 1.0, "memory_gb": 0.5}]), accelerator="cpu", devices=1,
            max_steps=2, logger=[wandb_logger, csv], enable_progress_bar=False, enable_model_summary=False,
            callbacks=[CephaloCallback(cache_dir=root / "profiles", max_micro_batch=2, print_plan=False, quiet=True),
                       checkpoints],
            val_check_interval=2, check_val_every_n_epoch=None, limit_val_batches=1, num_sanity_val_steps=0,
        )
        trainer.fit(GPTModule(preset="tiny", seq_len=32),
                    TextDataModule(seq_len=32, batch_size=8, max_train_samples=64, max_val_samples=16))
        run = wandb_logger.experiment
        # the strategy uploaded each checkpoint directory as it was published; nothing is left to upload
        uploads = {"all, again": log_checkpoint_artifacts(trainer)}
        for log_model in (False, True):  # the same run, through loggers with other log_model settings
            trainer.loggers = [WandbLogger(log_model=log_model, experiment=run)]
            uploads[f"{log_model}"] = log_checkpoint_artifacts(trainer)
            uploads[f"{log_model}, final"] = log_checkpoint_artifacts(trainer, final=True)
        run_id, files = run.id, Path(run.dir)
        run.finish()
    (run_dir,) = (root / "wandb").glob("offline-run-*")
    return trainer, checkpoints, uploads, run_id, files, wandb_records(run_dir), root


@pytest.mark.multiprocess
def test_wandb_run_config_holds_the_resolved_configuration(wandb_run):
    trainer, _, _, _, _, records, _ = wandb_run
    updates = [json.loads(item.value_json) for r in records if r.WhichOneof("record_type") == "config"
               for item in r.config.update if item.key == "cephalo"]
    assert updates, "no cephalo entry in the W&B run config"
    config, plan = updates[-1], trainer.strategy.plan
    assert config["plan"]["ranks"]["rank0"]["batch_size"] == plan.ranks[0].batch_size == 8
    assert config["plan"]["ranks"]["rank0"]["num_micro_batches"] == plan.ranks[0].num_micro_batches
    assert config["plan"]["global_batch_size"] == 8 and config["plan"]["mode"] == "layered"
    assert config["trainer"]["max_steps"] == 2 and config["trainer"]["precision"] == "32-true"
    assert config["strategy"]["class_path"] == "cephalo_lightning.lightning.strategy.cephalo_strategy.CephaloStrategy"
    assert config["strategy"]["emulate"] == [{"slowdown": 1.0, "memory_gb": 0.5}]
    assert config["callback"]["max_micro_batch"] == 2 and config["callback"]["drift_threshold"] == 0.3
    assert config["cluster"]["devices"]["rank0"]["source"] == "emulated" and config["emulated"] is True
    assert config["cluster"]["model"]["parameters"] == sum(p.numel() for p in trainer.lightning_module.parameters())


@pytest.mark.multiprocess
def test_other_loggers_get_the_configuration_in_hparams_yaml(wandb_run):
    trainer, *_, root = wandb_run
    (hparams,) = (root / "csv").glob("version_*/hparams.yaml")

    class Loader(yaml.SafeLoader):  # Lightning writes the module's tuple hyperparameters as python/tuple
        pass

    Loader.add_constructor("tag:yaml.org,2002:python/tuple", lambda loader, node: tuple(loader.construct_sequence(node)))
    config = yaml.load(hparams.read_text(), Loader=Loader)["cephalo"]
    assert config["plan"]["ranks"]["rank0"]["state_share"] == trainer.strategy.plan.ranks[0].state_share == 1.0


@pytest.mark.multiprocess
def test_plan_and_cluster_files_are_run_files(wandb_run):
    trainer, _, _, _, files, records, _ = wandb_run
    saved = {f.path for r in records if r.WhichOneof("record_type") == "files" for f in r.files.files}
    assert {"plan.json", "cluster.yaml"} <= saved
    assert Plan.load(files / "plan.json") == trainer.strategy.plan
    from cephalo_lightning.planner import load_cluster

    assert load_cluster(files / "cluster.yaml") == trainer.strategy.cluster


@pytest.mark.multiprocess
def test_checkpoint_directories_become_model_artifacts_as_log_model_says(wandb_run):
    _, checkpoints, uploads, run_id, _, records, _ = wandb_run
    best, last = checkpoints.best_model_path, checkpoints.last_model_path
    assert Path(best).is_dir() and Path(last).is_dir() and best != last
    assert uploads["all, again"] == []  # each once, already during training
    assert uploads["False"] == uploads["False, final"] == []
    assert uploads["True"] == [] and sorted(uploads["True, final"]) == sorted([best, last])  # only at the end
    artifacts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact" and r.artifact.type == "model"]
    assert len(artifacts) == 4 and {a.name for a in artifacts} == {f"model-{run_id}"}
    by_files = sorted((sorted(a.aliases), sorted(e.path for e in a.manifest.contents)) for a in artifacts)
    expected = sorted(f"model.ckpt/{p.relative_to(best).as_posix()}" for p in Path(best).rglob("*") if p.is_file())
    assert expected and ("meta.pt" in " ".join(expected))
    assert by_files.count((["best", "latest"], expected)) == 2  # the best checkpoint, both times
    assert sum(aliases == ["latest"] for aliases, _ in by_files) == 2  # last.ckpt, both times


@pytest.mark.multiprocess
def test_profiling_progress_and_rank_lines_reach_a_plain_log(tmp_path):
    script = f"""
import warnings; warnings.simplefilter("ignore")
import lightning.pytorch as pl
from cephalo_lightning import CephaloCallback, CephaloStrategy
from cephalo_lightning.demo import GPTModule, TextDataModule
from cephalo_lightning.lightning.fit.loggers import log_rank_lines
for _ in range(2):  # the second run reuses the cached profile
    trainer = pl.Trainer(strategy=CephaloStrategy(emulate=[{{"slowdown": 1.0}}]), accelerator="cpu", devices=1,
                         max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0,
                         callbacks=[CephaloCallback(cache_dir={str(tmp_path / "profiles")!r}, max_micro_batch=2,
                                                    print_plan=False)])
    trainer.fit(GPTModule(preset="tiny", seq_len=32), TextDataModule(seq_len=32, batch_size=4, max_train_samples=16))
log_rank_lines(trainer.strategy.plan)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                            env=clean_env(), timeout=HANG_TIMEOUT_S)  # pipes: not a terminal, as under torchrun or SLURM
    assert result.returncode == 0, failure_report(result)
    log = result.stderr
    assert "Cephalo: profiling 1 device(s)" in log
    assert "Cephalo: profiled 1 rank(s) (1 measurement(s)) in" in log
    assert "Cephalo: reusing the device profile" in log
    assert "Cephalo rank 0: cpu (emulated x1.0): batch 4 in" in log


def test_profiling_shows_a_bar_on_a_terminal_and_lines_elsewhere():
    import io

    from rich.console import Console

    from cephalo_lightning.profiling.progress import ProfileProgress

    screen = io.StringIO()
    with ProfileProgress(True, 2, console=Console(file=screen, force_terminal=True, width=80)) as bar:
        bar.phase("profiling 2 device(s)")
        bar.rounds(1, 4)
        bar.phase_done()
    assert bar._progress is not None and not bar._plain and "profiling 2 device(s)" in screen.getvalue()
    plain = ProfileProgress(True, 2, console=Console(file=io.StringIO()))
    assert plain._progress is None and plain._plain
    assert not ProfileProgress(False, 2)._plain  # other ranks and quiet: nothing at all


@pytest.mark.multiprocess
def test_the_plan_picture_is_logged_to_the_run(wandb_run):
    *_, records, _ = wandb_run
    logged = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
              for r in records if r.WhichOneof("record_type") == "history" for item in r.history.item}
    assert logged["cephalo/plan/picture/_type"] == "image-file" and logged["cephalo/plan/picture/format"] == "png"
    assert logged["cephalo/plan/picture/width"] > 500 and logged["cephalo/plan/picture/height"] > 500
