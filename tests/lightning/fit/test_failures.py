"""Failures and bad input: non-finite steps skipped together, a plan for other devices refused,
every listed bad input a clear error before any training, a dead peer named."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from cephalo_lightning import CephaloCallback, CephaloStrategy, Plan
from cephalo_lightning.lightning.fit.nonfinite import NonFiniteLossError
from cephalo_lightning.planner import PlanningError
from tests.conftest import HANG_TIMEOUT_S, clean_env
from tests.distributed import run_distributed
from tests.helpers import fit, max_error
from tests.lightning_models import TinyLayered, TinyUniform, loader, token_data
from tests.plans import plan_of
from tests.reference import sliced, tiny_loss, train_steps, whole

ROOT = Path(__file__).resolve().parents[3]
POISON = 22  # sample 22: at step 1, in rank 1's slice of the plan below
PLAN = plan_of(batches=[9, 3], micro=[3, 2], shares=[0.4, 0.6])


def poisoned_data(n: int = 48) -> TensorDataset:
    data = token_data(n, vocab=16)
    x, y = data.tensors
    x[POISON] = 16  # a token no other sample has
    return TensorDataset(x, y)


class NaNOnPoison(TinyLayered):
    def cephalo_loss(self, output, batch):
        loss = super().cephalo_loss(output, batch)
        return loss * float("nan") if (batch[0] == 16).any() else loss


def _nan(rank: int, world: int):
    warnings.simplefilter("ignore")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(NaNOnPoison(), PLAN, world, 3, poisoned_data())
    skipped = [str(w.message) for w in caught if "non-finite" in str(w.message)]
    out = {"params": trainer.strategy.sharded.full_state_dict(), "warnings": skipped,
           "skipped": trainer.strategy.fit_runtime.guard.skipped}
    all_bad = TensorDataset(torch.full((48, 5), 16), torch.zeros(48, 5, dtype=torch.long))
    try:
        fit(NaNOnPoison(), PLAN, world, 20, all_bad, max_nonfinite_skips=3)
    except NonFiniteLossError as err:
        out["stopped"] = str(err)
    return out


@pytest.fixture(scope="module")
def nan_run():
    return run_distributed(_nan, 2)


def _skipping_step_1() -> dict[str, torch.Tensor]:
    """Single-process training on the same 3 global batches, step 1 skipped (no update at all)."""
    model = NaNOnPoison()
    unpoisoned = [batch for step, batch in enumerate(sliced(poisoned_data(), 3, 12)) if step != 1]  # as Cephalo skips it
    train_steps(model.configure_optimizers(), tiny_loss(model.model), whole(unpoisoned))
    return {f"model.{k}": v for k, v in model.model.state_dict().items()}


@pytest.mark.multiprocess
def test_a_nan_micro_batch_on_one_rank_skips_the_step_on_every_rank(nan_run):
    want = _skipping_step_1()
    for result in nan_run:
        assert result["skipped"] == 1
        assert max_error(result["params"], want) <= 1e-5
    warning = nan_run[0]["warnings"][0]
    assert "non-finite loss on rank(s) [1]" in warning and "step 1" in warning, warning


@pytest.mark.multiprocess
def test_too_many_non_finite_steps_in_a_row_stop_training_clearly(nan_run):
    message = nan_run[0]["stopped"]
    assert "3 optimizer steps in a row" in message and "resume from the last checkpoint" in message


# Groups of one rank (data parallelism): every rank holds the whole reduced gradient, the step's
# all-reduce is started before the backward and each rank checks the gradient itself (step_sync.StepSync).
SINGLES = Plan(12, "layered", tuple(dataclasses.replace(r, state_share=1.0, shard_group=r.rank) for r in PLAN.ranks))
SINGLES_UNIFORM = plan_of(batches=[9, 3], micro=[2, 2], shares=[1.0, 1.0], mode="uniform", groups=[0, 1])


def _nan_gradient(output: torch.Tensor) -> torch.Tensor:
    """0 * sqrt(0 * sum): adds 0 to the loss, and nan to every gradient (the sqrt's slope at 0 is inf)."""
    return 0.0 * torch.sqrt(output.sum() * 0.0)


class NaNGradientOnPoison(TinyLayered):
    def cephalo_loss(self, output, batch):
        loss = super().cephalo_loss(output, batch)
        return loss + _nan_gradient(output) if (batch[0] == 16).any() else loss


class NaNGradientOnPoisonUniform(TinyUniform):
    def training_step(self, batch, batch_idx):
        x, y = batch
        output = self(x)
        loss = self.model.loss(output, y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=x.size(0))
        return loss + _nan_gradient(output) if (x == 16).any() else loss


def _nan_singles(rank: int, world: int):
    warnings.simplefilter("ignore")
    out = {}
    for name, module, plan in (("loss", NaNOnPoison(), SINGLES),
                               ("gradient", NaNGradientOnPoison(), SINGLES),
                               ("uniform gradient", NaNGradientOnPoisonUniform(), SINGLES_UNIFORM)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = fit(module, plan, world, 3, poisoned_data())
        assert trainer.strategy.sharded.replicated_grads
        out[name] = {"params": trainer.strategy.sharded.full_state_dict(),
                     "warnings": [str(w.message) for w in caught if "non-finite" in str(w.message)],
                     "skipped": trainer.strategy.fit_runtime.guard.skipped,
                     "loss": float(trainer.callback_metrics["train_loss_epoch" if "uniform" not in name else "train_loss"])}
    return out


@pytest.fixture(scope="module")
def nan_singles():
    return run_distributed(_nan_singles, 2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,origin", [("loss", "loss on rank(s) [1]"), ("gradient", "gradient on rank(s) [0, 1]"),
                                         ("uniform gradient", "gradient on rank(s) [0, 1]")])
def test_under_groups_of_one_rank_a_non_finite_loss_or_gradient_skips_the_step_on_every_rank(nan_singles, name, origin):
    """A nan loss names its rank; a nan gradient behind a finite loss reaches every replica through
    the all-reduce, and each rank's own check names every rank, as the exchanged flags did."""
    want = _skipping_step_1()
    for result in nan_singles:
        got = result[name]
        assert got["skipped"] == 1
        assert max_error(got["params"], want) <= 1e-5
        assert got["params"].keys() == nan_singles[0][name]["params"].keys()
        for key, value in got["params"].items():
            assert torch.equal(value, nan_singles[0][name]["params"][key]), key  # replicas identical
    warning = nan_singles[0][name]["warnings"][0]
    assert f"non-finite {origin}" in warning and "step 1" in warning, warning
    assert len(nan_singles[0][name]["warnings"]) == 1
    assert all(r[name]["loss"] == nan_singles[0][name]["loss"] for r in nan_singles)  # the same global loss


# ----------------------------------------------------------------------------- devices


def _swapped(rank: int, world: int):
    warnings.simplefilter("ignore")
    plan = plan_of(batches=[8, 4], micro=[2, 1], shares=[0.8, 0.2],
                   devices=["cpu (emulated x1.0, 0.5 GiB)", "cpu (emulated x3.0, 0.25 GiB)"],
                   memory_capacity_gb=[0.5, 0.25], source=["emulated"] * 2)
    swapped = [{"slowdown": 3.0, "memory_gb": 0.25}, {"slowdown": 1.0, "memory_gb": 0.5}]
    out = {}
    try:
        fit(TinyLayered(), plan, world, 1, emulate=swapped)
    except PlanningError as err:
        out["refused"] = str(err)
    trainer = fit(TinyLayered(), plan, world, 1, emulate=swapped, check_devices=False)
    out["overridden"] = trainer.global_step
    return out


@pytest.mark.multiprocess
def test_ranks_launched_on_other_devices_than_the_plan_are_refused_before_training():
    results = run_distributed(_swapped, 2)
    message = results[0]["refused"]
    assert "rank 0: the plan expects 'cpu (emulated x1.0, 0.5 GiB)'" in message
    assert "rank 1:" in message and "check_devices=False" in message and "plan's device order" in message
    assert results[1]["refused"] == message  # every rank refuses alike
    assert results[0]["overridden"] == 1


# ----------------------------------------------------------------------------- bad input, one test each


def test_callback_global_batch_of_zero_is_refused():
    with pytest.raises(ValueError, match="global_batch_size"):
        CephaloCallback(global_batch_size=0)


def test_memory_check_interval_below_one_is_refused():
    with pytest.raises(ValueError, match=r"memory_check_every_n_steps=0\) must be an integer >= 1"):
        CephaloStrategy(memory_check_every_n_steps=0)


def test_an_iterable_dataset_is_refused_with_the_fix():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from token_data(24)

    trainer = pl.Trainer(strategy=CephaloStrategy(global_batch_size=4), accelerator="cpu", devices=1, max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(TypeError, match="map-style Dataset"):
        trainer.fit(TinyLayered(), DataLoader(Stream(), batch_size=4))


def test_the_dropped_partial_last_batch_is_announced():
    with pytest.warns(UserWarning, match="partial last batch is dropped"):
        fit(TinyLayered(), plan_of(batches=[12], micro=[1], shares=[1.0]), 1, 1, token_data(50))


def _tiny_global_batch(rank: int, world: int):
    warnings.simplefilter("ignore")
    trainer = pl.Trainer(strategy=CephaloStrategy(), accelerator="cpu", devices=world, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         callbacks=[CephaloCallback(global_batch_size=1, quiet=True, print_plan=False, cache_dir=None)])
    try:
        trainer.fit(TinyLayered(), loader(token_data(24), 4))
    except Exception as err:  # noqa: BLE001 - the message is what is tested
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.multiprocess
def test_a_callback_global_batch_that_disagrees_with_the_loader_names_both():
    message = run_distributed(_tiny_global_batch, 2)[0]
    assert message.startswith("ValueError: CephaloCallback(global_batch_size=1)") and "batch_size is 4" in message


# ----------------------------------------------------------------------------- a peer dies


PEER_SCRIPT = """
import logging, os, signal, sys, warnings
warnings.simplefilter("ignore")
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from cephalo_lightning import CephaloStrategy
from tests.lightning_models import TinyLayered, TinyUniform, loader, token_data
from tests.plans import plan_of

class Die(pl.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 3 and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

rank = int(os.environ["RANK"])
logging.getLogger("cephalo_lightning").addHandler(logging.FileHandler(f"{ckpt}/rank{{rank}}.log"))
plan = plan_of(batches=[6, 6], micro=[1, 2], shares=[0.5, 0.5])
saver = ModelCheckpoint(dirpath={ckpt!r}, every_n_train_steps=1, save_last=True, save_top_k=0)
t = pl.Trainer(strategy=CephaloStrategy(plan=plan), accelerator="cpu", devices=2, max_steps=10, logger=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=[saver, Die()],
               default_root_dir={ckpt!r})
t.fit(TinyLayered(), loader(token_data(240), 12))
"""


@pytest.mark.multiprocess
def test_a_dead_peer_is_named_with_the_checkpoint_to_resume_from(tmp_path):
    from tests.distributed import free_port

    script = tmp_path / "peer.py"
    script.write_text(PEER_SCRIPT.format(ckpt=str(tmp_path)))
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL,
                              env=clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), WORLD_SIZE="2",
                                            LOCAL_RANK=str(r), NODE_RANK="0", PYTHONPATH=str(ROOT)))
             for r in range(2)]  # launched as torchrun or SLURM would: no supervisor kills the survivor
    for proc in ranks:
        proc.wait(timeout=HANG_TIMEOUT_S)
    survivor = (tmp_path / "rank0.log").read_text()
    assert "a collective failed" in survivor, survivor
    assert "rank 1" in survivor and ("process is gone" in survivor or "no heartbeat" in survivor), survivor
    assert "ckpt_path=" in survivor and "last.ckpt" in survivor, survivor
