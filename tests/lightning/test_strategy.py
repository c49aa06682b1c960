"""``Trainer(strategy="cephalo")`` through a real ``Trainer.fit`` on gloo ranks."""

from __future__ import annotations

import logging
import os
import signal
import warnings
from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.multiprocessing as mp

from cephalo_lightning import CephaloStrategy, Plan, PlanningError
from cephalo_lightning.planner.schema.plan import ModelSummary
from cephalo_lightning.runtime import checkpoint
from tests.distributed import run_distributed
from tests.helpers import NUM_SAMPLES, fit, max_error, reference, trainer
from tests.lightning_models import TinyLayered, TinyUniform, loader, token_data
from tests.plans import plan_of

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5

LAYERED_PLAN = plan_of(batches=[2, 6, 4], micro=[1, 3, 4], shares=[0.6, 0.3, 0.1])
UNIFORM_PLAN = plan_of(batches=[2, 6, 4], micro=[2, 2, 2], shares=[0.5, 0.2, 0.3], mode="uniform")
RESUME_PLAN = plan_of(batches=[9, 3], micro=[3, 1], shares=[0.25, 0.75])


# ----------------------------------------------------------------------------- 3 ranks


def _fit_three(rank: int, world: int, ckpt_dir: str):
    warnings.simplefilter("ignore")
    out = {}
    # layered: different b_i, n_i and shares; checkpoint every 2 steps
    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    t = trainer(CephaloStrategy(plan=LAYERED_PLAN), world, 3, callbacks=[saver], enable_checkpointing=True)
    t.fit(TinyLayered(), loader(token_data(NUM_SAMPLES), 12), loader(token_data(16, seed=5), 4))
    out["layered"] = (t.strategy.sharded.full_state_dict(), float(t.callback_metrics["train_loss_epoch"]))
    # uniform (the user's training_step), with gradient clipping and Lightning accumulation
    t = fit(TinyUniform(), UNIFORM_PLAN, world, 2, options={"gradient_clip_val": 0.05, "accumulate_grad_batches": 2})
    out["uniform"] = (t.strategy.sharded.full_state_dict(), float(t.callback_metrics["train_loss"]))
    # the layered schedule under Lightning's own accumulation: two batches per optimizer step
    t = fit(TinyLayered(), LAYERED_PLAN, world, 2, options={"accumulate_grad_batches": 2})
    out["layered_accumulate"] = t.strategy.sharded.full_state_dict()
    # a full single-file export
    t = fit(TinyLayered(), LAYERED_PLAN, world, 1, state_dict_type="full")
    t.save_checkpoint(os.path.join(ckpt_dir, "export.ckpt"))
    out["export"] = t.strategy.sharded.full_state_dict()
    return out


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpts")
    return run_distributed(_fit_three, 3, str(ckpt)), ckpt


@pytest.mark.multiprocess
def test_layered_fit_matches_single_process_and_logs_the_global_loss(three):
    results, _ = three
    want, losses = reference(3, 12)
    for params, logged in (r["layered"] for r in results):
        assert max_error(params, want) <= TOL
        assert logged == pytest.approx(sum(losses) / len(losses), abs=1e-5)


@pytest.mark.multiprocess
def test_uniform_fit_with_clipping_and_accumulation_matches_single_process(three):
    results, _ = three
    want, losses = reference(2, 12, clip=0.05, accumulate=2)
    params, logged = results[0]["uniform"]
    assert max_error(params, want) <= TOL
    assert logged == pytest.approx(sum(losses) / len(losses), abs=1e-5)  # on_epoch, weighted by batch_size


@pytest.mark.multiprocess
def test_layered_fit_with_lightning_accumulation_matches_single_process(three):
    results, _ = three
    want, _ = reference(2, 12, accumulate=2)
    assert max_error(results[0]["layered_accumulate"], want) <= TOL


@pytest.mark.multiprocess
def test_full_export_loads_with_plain_load_from_checkpoint(three):
    results, ckpt = three
    restored = TinyLayered.load_from_checkpoint(ckpt / "export.ckpt")
    for name, value in restored.state_dict().items():
        assert torch.equal(value, results[0]["export"][name]), name


def _resume(rank: int, world: int, ckpt: str, plan_dict: dict, steps: int):
    warnings.simplefilter("ignore")
    t = fit(TinyLayered(seed=7), Plan.from_dict(plan_dict), world, steps, ckpt_path=ckpt)
    return t.strategy.sharded.full_state_dict(), t.global_step


@pytest.mark.multiprocess
def test_resume_on_another_world_size_and_plan_continues_exactly(three):
    results, ckpt = three
    path = ckpt / "step=2.ckpt"
    assert checkpoint.is_checkpoint(path)
    resumed = run_distributed(_resume, 2, str(path), RESUME_PLAN.to_dict(), 3)
    params, step = resumed[0]
    assert step == 3
    want, _ = reference(3, 12)
    assert max_error(params, want) <= TOL
    assert max_error(params, results[0]["layered"][0]) <= TOL  # = the uninterrupted run


# ----------------------------------------------------------------------------- crash safety


def _killed_during_training(rank: int, world: int, ckpt_dir: str):
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    class Kill(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == 3 and rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)

    warnings.simplefilter("ignore")
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_last=True, save_top_k=1, filename="{step}")
    t = trainer(CephaloStrategy(plan=Plan.from_dict(RESUME_PLAN.to_dict())), world, 10,
                callbacks=[saver, Kill()], enable_checkpointing=True)
    t.fit(TinyLayered(), loader(token_data(NUM_SAMPLES), 12))


@pytest.mark.multiprocess
def test_sigkill_during_training_leaves_the_last_checkpoint_loadable(tmp_path):
    with pytest.raises((mp.ProcessExitedException, RuntimeError)):  # rank 0 killed, rank 1 loses its peer
        run_distributed(_killed_during_training, 2, str(tmp_path))
    last = tmp_path / "last.ckpt"
    assert checkpoint.is_checkpoint(last)
    meta = checkpoint.read_meta(last)
    assert meta["global_step"] == 3
    weights = checkpoint.load_full_state_dict(last)
    model = TinyLayered()
    model.load_state_dict(weights)
    want, _ = reference(3, 12)
    assert max_error(model.state_dict(), want) <= TOL


# ----------------------------------------------------------------------------- bad input (1 rank)


def _fit_one(strategy: CephaloStrategy, module: pl.LightningModule | None = None, batch: int = 12) -> None:
    trainer(strategy, 1, 1).fit(module or TinyLayered(), loader(token_data(NUM_SAMPLES), batch))


def test_plan_for_another_world_size_is_refused_before_training():
    with pytest.raises(PlanningError, match="plan is for 3 ranks but the job has 1"):
        _fit_one(CephaloStrategy(plan=LAYERED_PLAN))


def test_plan_for_another_model_is_refused():
    plan = replace(plan_of(batches=[12], micro=[1], shares=[1.0]), model=ModelSummary("gpt-2.7b", 2_770_000_000))
    with pytest.raises(PlanningError, match="re-plan for this model"):
        _fit_one(CephaloStrategy(plan=plan))


def test_batch_that_does_not_match_the_plan_is_refused():
    plan = plan_of(batches=[12], micro=[1], shares=[1.0])
    with pytest.raises(PlanningError, match="batch_size=8 but the plan is for a global batch of 12"):
        _fit_one(CephaloStrategy(plan=plan), batch=8)


def test_model_without_units_is_refused():
    class Flat(TinyUniform):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match="found no units"):
        _fit_one(CephaloStrategy(), Flat())


def test_layered_plan_on_a_model_without_the_protocol_is_refused():
    class NoBlockList(TinyUniform):  # blocks in an nn.Sequential: no ModuleList for the discovery to find
        def __init__(self):
            super().__init__()
            self.model.blocks = torch.nn.Sequential(*self.model.blocks)

    plan = plan_of(batches=[12], micro=[3], shares=[1.0])
    with pytest.raises(TypeError, match="cephalo_layers"):
        _fit_one(CephaloStrategy(plan=plan, mode="layered"), NoBlockList())


# ----------------------------------------------------------------------------- LightningCLI


def _cli(args: list[str], where: Path, monkeypatch, capfd, caplog) -> str:
    """``python -m cephalo_lightning ARGS`` in this process (its imports are done: a fresh interpreter
    would spend seconds importing Lightning again), run from ``where``; what it printed and logged."""
    from cephalo_lightning.__main__ import main

    monkeypatch.chdir(where)
    caplog.set_level(logging.INFO)
    assert main(args) == 0
    out, err = capfd.readouterr()
    return out + err + caplog.text


@pytest.mark.parametrize("config, options", [("tiny-cli.yaml", []), ("tiny-cli-name.yaml", []),
                                             ("tiny-cli.yaml", ["--trainer.strategy=cephalo"])],
                         ids=["class_path", "name", "name_on_the_command_line"])
def test_lightning_cli_config_selects_the_strategy(config, options, tmp_path, monkeypatch, capfd, caplog):
    printed = _cli(["fit", "--config", str(ROOT / "configs" / config), *options, "--trainer.default_root_dir",
                    str(tmp_path)], tmp_path, monkeypatch, capfd, caplog)
    assert "Cephalo: layered mode" in printed
    assert "max_steps=3" in printed


def test_profile_command_writes_a_cluster_file_and_a_plan(tmp_path, monkeypatch, capfd, caplog):
    cluster_file, plan_file = tmp_path / "cluster.yaml", tmp_path / "plan.json"
    _cli(["profile", "--config", str(ROOT / "configs" / "tiny-cli.yaml"), "-o", str(cluster_file), "--plan-output",
          str(plan_file), "--trainer.default_root_dir", str(tmp_path)], tmp_path, monkeypatch, capfd, caplog)
    from cephalo_lightning.planner import load_cluster

    cluster = load_cluster(cluster_file)
    assert cluster.world_size == 1 and cluster.devices[0].source == "measured"
    assert Plan.load(plan_file).global_batch_size == 8  # the config's vars.batch
    assert not list(tmp_path.rglob("*.ckpt"))  # profiling trains and saves nothing
