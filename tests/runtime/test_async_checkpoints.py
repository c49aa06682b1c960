"""Checkpoints that do not stop training (``async_checkpoint=True``): the background writer's
checkpoints are those a synchronous save writes, top-k deletions wait for the newer save, a failed
background save is reported, and kills landing in the background write never leave a checkpoint
that looks whole but is not."""

from __future__ import annotations

import warnings

import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from cephalo_lightning import CephaloStrategy
from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning.runtime import checkpoint
from cephalo_lightning.runtime.checkpoint import CheckpointError
from cephalo_lightning.runtime.checkpoint.async_save import THREAD_NAME
from tests import helpers
from tests.helpers import max_error
from tests.plans import plan_of
from tests.sgd_run import GLOBAL, SEED, SGDModule, data_loader, reference

PLAN1 = plan_of(batches=[GLOBAL], micro=[2], shares=[1.0])
TOLERANCE = 1e-7  # fp64 SGD: [Note: fp64 SGD] in tests/sgd_run.py


class LogStep(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        module.log("step", float(trainer.global_step))


def test_background_saves_write_the_synchronous_checkpoints_and_report_a_failure(tmp_path):
    warnings.simplefilter("ignore")
    saver = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1, save_top_k=2, monitor="step",
                            mode="max", save_last=True, filename="{step}")
    t = helpers.trainer(CephaloStrategy(plan=PLAN1, seed=SEED, async_checkpoint=True), 1, 6, precision="64-true",
                        default_root_dir=str(tmp_path), enable_checkpointing=True, callbacks=[LogStep(), saver])
    t.fit(SGDModule(), data_loader(True))
    writer = t.strategy.fit_runtime.checkpoints.writer
    assert len(writer.times) == 12 and not writer.in_flight  # 6 steps x (step=K, last), all published by the end
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name != "cephalo-run.lock")
    assert names == ["last.ckpt", "step=5.ckpt", "step=6.ckpt"]  # top-k kept 2; nothing hidden left over
    for name, step in (("last.ckpt", 6), ("step=5.ckpt", 5), ("step=6.ckpt", 6)):
        path = tmp_path / "ckpt" / name
        assert checkpoint.read_meta(path)["global_step"] == step
        assert max_error(checkpoint.load_full_state_dict(path), reference(step, True)) <= TOLERANCE, name
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match="a background checkpoint save failed: NotADirectoryError"):
        t.save_checkpoint(blocker / "x.ckpt")  # after the fit: written (here: failed) when the call returns
    t.save_checkpoint(tmp_path / "after.ckpt")  # the writer goes on after a reported failure
    assert checkpoint.read_meta(tmp_path / "after.ckpt")["global_step"] == 6


def test_async_checkpoint_needs_sharded_checkpoints():
    with pytest.raises(ConfigurationError, match="state_dict_type='sharded'"):
        CephaloStrategy(async_checkpoint=True, state_dict_type="full")


@pytest.mark.multiprocess
def test_kills_during_background_saves_never_leave_a_checkpoint_that_looks_whole(tmp_path):
    """A few of scenarios/kill_points.py's points, with the saves and deletions on the background
    writer's thread (benchmarks/bench_checkpoint.py runs every point)."""
    from scenarios import kill_points

    points = ["save: complete, before it is published", "delete: renamed away, nothing deleted yet"]
    seen = kill_points.kill_loop(tmp_path, points, background=True)
    assert seen.threads == (THREAD_NAME,) * len(points)  # every kill landed in the background write
    assert seen.interrupted == len(points) and seen.complete_seen >= len(points)
