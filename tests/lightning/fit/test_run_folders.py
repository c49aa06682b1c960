"""One run per folder: a second run in a live run's folder is refused before it touches anything, a
stale lock is taken over and every lock released at the end (also after SIGTERM, which exits
non-zero), an unwritable folder is refused at setup on every rank alike, and the heartbeats of
killed runs are removed, never a live run's."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from unittest import mock

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from cephalo_lightning import Plan
from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning.runtime.checkpoint import load_full_state_dict
from cephalo_lightning.runtime.liveness import LOCK_NAME, FolderInUseError, Heartbeat
from tests.conftest import HANG_TIMEOUT_S, clean_env
from tests.distributed import run_distributed
from tests.helpers import fit
from tests.lightning_models import TinyLayered, token_data
from tests.plans import plan_of

ROOT = Path(__file__).resolve().parents[3]
ONE_RANK = plan_of(batches=[12], micro=[2], shares=[1.0])
TWO_RANKS = plan_of(batches=[6, 6], micro=[1, 2], shares=[0.5, 0.5])


def _fit_saving(plan: Plan, world: int, root: Path, ckpt: Path, steps: int = 2):
    warnings.simplefilter("ignore")
    saver = ModelCheckpoint(dirpath=str(ckpt), every_n_train_steps=1, save_last=True, save_top_k=0)
    return fit(TinyLayered(), plan, world, steps, token_data(48),
               {"enable_checkpointing": True, "callbacks": [saver], "default_root_dir": str(root)})


def _owner(pid: int, host: str | None = None) -> str:
    return json.dumps({"host": host or socket.gethostname(), "pid": pid, "started": "2026-01-01 00:00:00 UTC"})


@pytest.fixture(scope="module")
def pids():
    """A live pid (a sleeping child) and a dead one (a child that has exited and been reaped)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        yield live.pid, dead.pid
    finally:
        live.kill()
        live.wait()


@pytest.mark.multiprocess
def test_a_second_run_in_a_live_runs_folder_is_refused_before_touching_it(tmp_path, pids):
    live, _ = pids
    ckpt = tmp_path / "ckpt"
    staging = ckpt / ".last.ckpt.staging-0123456789ab"  # the first run's save in progress
    staging.mkdir(parents=True)
    (staging / "__0_0.distcp").write_bytes(b"half written")
    (ckpt / LOCK_NAME).write_text(_owner(live))
    with pytest.raises(FolderInUseError) as refused:
        _fit_saving(ONE_RANK, 1, tmp_path, ckpt)
    message = str(refused.value)
    assert str(ckpt) in message and f"pid {live}" in message and "live run" in message, message
    assert "default_root_dir" in message and "dirpath" in message and str(ckpt / LOCK_NAME) in message, message
    assert (staging / "__0_0.distcp").read_bytes() == b"half written"  # the first run's files are intact
    assert (ckpt / LOCK_NAME).read_text() == _owner(live)  # and its lock
    assert sorted(p.name for p in ckpt.iterdir()) == sorted([staging.name, LOCK_NAME])  # nothing written
    assert not (tmp_path / ".cephalo").exists()


def test_a_heartbeat_starts_when_a_rank_that_stopped_early_removed_the_empty_directory(tmp_path):
    """Rank 1 fails at once and stops (removing the run's directory while it is still empty) between
    rank 0's mkdir and its write: rank 0 makes the directory again instead of failing the fit."""
    directory = tmp_path / "heartbeat-run"
    early = Heartbeat(directory, 1, 2)
    late = Heartbeat(directory, 0, 2)
    make = Path.mkdir

    def mkdir_then_the_other_rank_stops(path: Path, *args, **kwargs) -> None:
        make(path, *args, **kwargs)
        if path == directory and not early._stop.is_set():
            early.stop()  # unlinks nothing of rank 0's, and removes the empty directory

    with mock.patch.object(Path, "mkdir", mkdir_then_the_other_rank_stops):
        late.start()
    try:
        assert json.loads((directory / "rank-0.json").read_text())["pid"] == os.getpid()
    finally:
        late.stop()
    assert not directory.exists()


def test_a_heartbeat_starts_when_the_directory_is_removed_inside_its_mkdir(tmp_path):
    """The other rank's stop can fall inside ``mkdir(exist_ok=True)``: the directory is there (so
    the call fails to create it), then gone before its own check, and it raises FileExistsError.
    Rank 0 makes the directory again instead of failing the fit (seen once in the suite)."""
    directory = tmp_path / "heartbeat-run"
    late = Heartbeat(directory, 0, 2)
    make = Path.mkdir
    raced = []

    def mkdir_racing_the_other_rank(path: Path, *args, **kwargs) -> None:
        if path == directory and not raced:
            raced.append(path)
            raise FileExistsError(17, "File exists", str(path))  # there when tried, gone when checked
        make(path, *args, **kwargs)

    with mock.patch.object(Path, "mkdir", mkdir_racing_the_other_rank):
        late.start()
    try:
        assert raced and json.loads((directory / "rank-0.json").read_text())["pid"] == os.getpid()
    finally:
        late.stop()


@pytest.mark.multiprocess
def test_stale_locks_and_heartbeats_of_dead_runs_are_removed_never_a_live_runs(tmp_path, pids, caplog):
    live, dead = pids
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / LOCK_NAME).write_text(_owner(dead))
    beats = tmp_path / ".cephalo"
    runs = {"killed": [dead, dead], "half-alive": [live, dead], "elsewhere": [dead]}
    for name, owners in runs.items():
        (beats / f"heartbeat-{name}").mkdir(parents=True)
        for rank, pid in enumerate(owners):
            host = "another-host" if name == "elsewhere" else None
            (beats / f"heartbeat-{name}" / f"rank-{rank}.json").write_text(_owner(pid, host))
    with caplog.at_level(logging.INFO):
        t = _fit_saving(ONE_RANK, 1, tmp_path, ckpt)
    assert t.global_step == 2 and (ckpt / "last.ckpt").is_dir()
    assert any("took over the stale lock" in r.getMessage() and f"pid {dead}" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert not (ckpt / LOCK_NAME).exists()  # released at the end of the fit
    assert sorted(p.name for p in beats.iterdir()) == ["heartbeat-elsewhere", "heartbeat-half-alive"]


def _read_only_on_rank_1(rank: int, world: int, root: str) -> str:
    ckpt = Path(root) / "ckpt"
    real_open = os.open

    def refusing(path, *args, **kwargs):
        if rank == 1 and str(path).startswith(str(ckpt)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *args, **kwargs)

    with mock.patch("os.open", refusing):
        try:
            _fit_saving(TWO_RANKS, world, Path(root) / f"rank{rank}", ckpt)
        except ConfigurationError as err:
            return str(err)
    return "trained"


@pytest.mark.multiprocess
def test_a_folder_one_rank_cannot_write_is_refused_at_setup_on_every_rank(tmp_path):
    messages = run_distributed(_read_only_on_rank_1, 2, str(tmp_path))
    ckpt = tmp_path / "ckpt"
    assert messages[0] == messages[1], messages  # every rank fails alike
    assert f"rank 1 cannot write to {ckpt} (a checkpoint folder)" in messages[0], messages[0]
    assert "Read-only file system" in messages[0] and "dirpath" in messages[0], messages[0]
    assert sorted(p.name for p in ckpt.iterdir()) == []  # no checkpoint, and rank 0's lock released


SIGTERM_SCRIPT = """
import os, signal, sys, warnings
warnings.simplefilter("ignore")
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from cephalo_lightning import CephaloStrategy
from tests.lightning_models import TinyLayered, loader, token_data
from tests.plans import plan_of

class Terminate(pl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 2:
            os.kill(os.getpid(), signal.SIGTERM)

plan = plan_of(batches=[12], micro=[2], shares=[1.0])
saver = ModelCheckpoint(dirpath={ckpt!r}, every_n_train_steps=1, save_last=True, save_top_k=0)
t = pl.Trainer(strategy=CephaloStrategy(plan=plan), accelerator="cpu", devices=1, max_steps=10, logger=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=[Terminate(), saver],
               default_root_dir={root_dir!r})
t.fit(TinyLayered(), loader(token_data(240), 12))
"""


@pytest.mark.multiprocess
def test_sigterm_exits_non_zero_with_a_loadable_checkpoint_and_the_folder_released(tmp_path):
    ckpt = tmp_path / "ckpt"
    script = tmp_path / "fit.py"
    script.write_text(SIGTERM_SCRIPT.format(ckpt=str(ckpt), root_dir=str(tmp_path)))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          env=clean_env(PYTHONPATH=str(ROOT)), timeout=HANG_TIMEOUT_S)
    assert done.returncode == 128 + 15, (done.returncode, done.stderr[-3000:])
    # signalled after step 3's all-reduce: every rank learns of it at step 4's, and stops after it
    assert "SIGTERM; stopped after 4 steps" in done.stderr and "last-preempted.ckpt" in done.stderr, done.stderr[-3000:]
    state = load_full_state_dict(ckpt / "last-preempted.ckpt")  # verified against its manifest first
    want = TinyLayered().state_dict()
    assert {k: tuple(v.shape) for k, v in state.items() if k in want} == {k: tuple(v.shape) for k, v in want.items()}
    assert not (ckpt / LOCK_NAME).exists() and not list((tmp_path / ".cephalo").glob("heartbeat-*"))
