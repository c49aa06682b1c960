"""Preemption that saves: a stop signal on any subset of ranks stops every rank at one step
boundary with a loadable checkpoint, the documented exit status, SLURM's requeue, and a resume
that equals the uninterrupted run; a second signal while the checkpoint is written, even followed
by a kill, leaves the previous checkpoint loadable."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from cephalo_lightning.lightning.fit.preemption import CHECKPOINT_NAME, EXIT_REQUEUED, EXIT_STOPPED, Preemption
from cephalo_lightning.lightning.steps.step_state import StepReport
from cephalo_lightning.runtime import checkpoint
from tests.conftest import HANG_TIMEOUT_S, clean_env, failure_report
from tests.distributed import run_distributed
from tests.helpers import max_error
from tests.sgd_run import PLAN2, TOTAL, SGDModule, data_loader, reference, sgd_trainer

ROOT = Path(__file__).resolve().parents[3]
SIGNAL_AFTER = 2  # the signal arrives after this optimizer step's all-reduce: the next step carries it
STOPS_AFTER = SIGNAL_AFTER + 1
# fp64 SGD ([Note: fp64 SGD] in tests/sgd_run.py): a resume on wrong samples is off by ~1e-2, summation-order
# noise is ~1e-15
TOLERANCE = 1e-7
ASYNC = "SIGTERM to rank 1, checkpoints written in the background"
SINGLES = "SIGTERM to rank 1, groups of one rank"  # data parallelism: the step's all-reduce starts before the backward
SINGLES_PLAN = dataclasses.replace(PLAN2, ranks=tuple(dataclasses.replace(r, state_share=1.0, shard_group=r.rank)
                                                      for r in PLAN2.ranks))
SLURM = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train",
         "SLURM_NODEID": "0", "SLURM_NODELIST": "127.0.0.1"}


def _signal_ranks(ranks: set[int], signum: int):
    from lightning.pytorch.callbacks import Callback

    class SignalAt(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == SIGNAL_AFTER and trainer.global_rank in ranks:
                os.kill(os.getpid(), signum)

    return SignalAt()


def _scenarios(rank: int, world: int, root: str, fake_bin: str):
    """Each scenario: stop (exit code, step, checkpoint), then resume from "last" to TOTAL steps."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    warnings.simplefilter("ignore")
    out = {}
    for name, ranks, signum, env in (("SIGTERM to rank 1 only", {1}, signal.SIGTERM, {}),
                                     ("SIGTERM to every rank", {0, 1}, signal.SIGTERM, {}),
                                     ("SIGUSR1 under SLURM, rank 0 only", {0}, signal.SIGUSR1, SLURM),
                                     (ASYNC, {1}, signal.SIGTERM, {}),
                                     (SINGLES, {1}, signal.SIGTERM, {})):
        background = name == ASYNC  # last.ckpt every step, written in the background while training goes on
        folder = Path(root) / name.replace(" ", "_").replace(",", "")
        os.environ.update({**env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)} if env else {})
        if env:
            os.environ["PATH"] = f"{fake_bin}{os.pathsep}{os.environ['PATH']}"
        try:
            saver = ModelCheckpoint(dirpath=str(folder / "ckpt"), save_top_k=0, save_last=background,
                                    every_n_train_steps=1 if background else None)
            plan = SINGLES_PLAN if name == SINGLES else PLAN2
            t = sgd_trainer(plan, world, TOTAL, str(folder), {"async_checkpoint": background},
                            enable_checkpointing=True, callbacks=[saver, _signal_ranks(ranks, signum)])
            environment = type(t.strategy.cluster_environment).__name__
            code = None
            try:
                t.fit(SGDModule(), data_loader(True))
            except SystemExit as stop:
                code = stop.code
            stopped_at = t.global_step
            last = folder / "ckpt" / "last.ckpt"
            out[name] = {"code": code, "stopped_at": stopped_at, "environment": environment,
                         "last": checkpoint.read_meta(last)["global_step"] if background else None,
                         "checkpoint": str(folder / "ckpt" / CHECKPOINT_NAME)}
            if name in RESUMED:
                again = sgd_trainer(PLAN2, world, TOTAL, str(folder), enable_checkpointing=True,
                                    callbacks=[ModelCheckpoint(dirpath=str(folder / "ckpt"), save_top_k=0)])
                again.fit(SGDModule(seed=3), data_loader(True), ckpt_path="last")
                out[name].update(resumed=again.strategy.sharded.full_state_dict(), resumed_to=again.global_step)
        finally:
            for key in (*env, "SLURM_PROCID", "SLURM_LOCALID") if env else ():
                os.environ.pop(key, None)
            if env:
                os.environ["PATH"] = os.environ["PATH"].split(os.pathsep, 1)[1]
    return out


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    root = tmp_path_factory.mktemp("preemption")
    fake_bin = root / "bin"
    fake_bin.mkdir()
    scontrol = fake_bin / "scontrol"  # records how it was called
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {root / 'scontrol.log'}\n")
    scontrol.chmod(0o755)
    results = run_distributed(_scenarios, 2, str(root), str(fake_bin))
    return results, root


SCENARIOS = ["SIGTERM to rank 1 only", "SIGTERM to every rank", "SIGUSR1 under SLURM, rank 0 only", ASYNC, SINGLES]
RESUMED = ["SIGTERM to rank 1 only", "SIGUSR1 under SLURM, rank 0 only", ASYNC]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", SCENARIOS)
def test_a_stop_signal_on_some_ranks_stops_every_rank_at_one_step_with_a_checkpoint(stopped, name):
    results, _ = stopped
    want_code = EXIT_REQUEUED if "SLURM" in name else EXIT_STOPPED
    for rank, result in enumerate(results):
        got = result[name]
        assert got["code"] == want_code, (rank, got["code"])
        assert got["stopped_at"] == STOPS_AFTER, (rank, got["stopped_at"])
    if name == ASYNC:  # the background save of the last step was published before the stop's own
        assert results[0][name]["last"] == STOPS_AFTER
    path = Path(results[0][name]["checkpoint"])
    assert checkpoint.is_complete(path)
    saved = checkpoint.load_full_state_dict(path)  # verified against its manifest first
    assert max_error({k: v for k, v in saved.items()}, reference(STOPS_AFTER, True)) <= TOLERANCE


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", RESUMED)
def test_a_resume_after_the_stop_equals_the_uninterrupted_run(stopped, name):
    """From "last" on the same 2 ranks (the every-rank stop's checkpoint is resumed on 1 rank, by the
    elastic test below)."""
    results, _ = stopped
    want = reference(TOTAL, True)
    for result in results:
        assert result[name]["resumed_to"] == TOTAL
        assert max_error(result[name]["resumed"], want) <= TOLERANCE


@pytest.mark.multiprocess
def test_the_requeue_signal_under_slurm_requeues_the_job_once(stopped):
    results, root = stopped
    assert results[0]["SIGUSR1 under SLURM, rank 0 only"]["environment"] == "SLURMEnvironment"
    assert (root / "scontrol.log").read_text().splitlines() == ["requeue 4242"]  # rank 0, once


# ----------------------------------------------------------------------------- a second signal during the save

SECOND_SIGNAL_SCRIPT = """
import fnmatch, json, os, shutil, signal, sys, warnings
from pathlib import Path
warnings.simplefilter("ignore")
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from cephalo_lightning._common import atomic_io
from tests.plans import plan_of
from tests.sgd_run import GLOBAL, SGDModule, data_loader, sgd_trainer

PLAN1 = plan_of(batches=[GLOBAL], micro=[2], shares=[1.0])
work = Path({work!r})
ckpt = work / "ckpt"
exchange = atomic_io._exchange


def run(mode, at):  # a forked child: resume from "last", SIGTERM after step `at`
    def exchange_(a, b):  # the publish of the stop's checkpoint over the previous one: a second signal
        if fnmatch.fnmatch(Path(a).name, ".last-preempted.ckpt.staging-*"):
            os.kill(os.getpid(), signal.SIGTERM)
            if mode == "kill":  # the scheduler's kill after its grace period
                os.kill(os.getpid(), signal.SIGKILL)
        return exchange(a, b)

    atomic_io._exchange = exchange_

    class SignalAt(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == at:
                os.kill(os.getpid(), signal.SIGTERM)

    t = sgd_trainer(PLAN1, 1, 8, str(work), enable_checkpointing=True,
                    callbacks=[ModelCheckpoint(dirpath=str(ckpt), save_top_k=0), SignalAt()])
    t.fit(SGDModule(), data_loader(True), ckpt_path="last")


statuses = {{}}
for mode, at in (("first", 1), ("kill", 4), ("survive", 4)):
    pid = os.fork()
    if pid == 0:
        log = os.open(work / f"{{mode}}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        code = 0
        try:
            run(mode, at)
        except SystemExit as stop:
            code = stop.code
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    statuses[mode] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if mode == "kill":  # what the killed run left, for the test to check
        (work / "after-kill.json").write_text(json.dumps(sorted(p.name for p in ckpt.iterdir())))
        shutil.copytree(ckpt / "last-preempted.ckpt", work / "after-kill.ckpt")
print(json.dumps(statuses))
"""


@pytest.mark.multiprocess
def test_a_second_signal_during_the_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    """Three runs forked from one interpreter: stopped by SIGTERM after step 2 (saved); resumed and
    stopped after step 5, with a second SIGTERM and then SIGKILL at the publish of the new save;
    resumed again, the second SIGTERM alone. The instrumented publish is the moment the kill lands."""
    script = tmp_path / "fit.py"
    script.write_text(SECOND_SIGNAL_SCRIPT.format(work=str(tmp_path)))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          env=clean_env(PYTHONPATH=str(ROOT)), timeout=HANG_TIMEOUT_S)
    assert done.returncode == 0, failure_report(done)
    statuses = json.loads(done.stdout.strip().splitlines()[-1])
    logs = {mode: (tmp_path / f"{mode}.log").read_text() for mode in statuses}
    path = tmp_path / "ckpt" / CHECKPOINT_NAME
    assert statuses["first"] == EXIT_STOPPED, logs["first"][-3000:]
    assert "stopped after 2 steps" in logs["first"] and str(path) in logs["first"], logs["first"][-3000:]
    # killed while publishing: the previous checkpoint (step 2) is the one there, complete and loadable
    assert statuses["kill"] == -signal.SIGKILL, logs["kill"][-3000:]
    left = tmp_path / "after-kill.ckpt"
    assert checkpoint.read_meta(left)["global_step"] == 2
    assert max_error(checkpoint.load_full_state_dict(left), reference(2, True)) <= TOLERANCE
    visible = [n for n in json.loads((tmp_path / "after-kill.json").read_text()) if not n.startswith(".")]
    assert sorted(visible) == sorted([CHECKPOINT_NAME, "cephalo-run.lock"])  # nothing else looks like a checkpoint
    # the second SIGTERM alone: recorded, the save completes, the status is the stop's
    assert statuses["survive"] == EXIT_STOPPED, logs["survive"][-3000:]
    assert "SIGTERM arrived while stopping" in logs["survive"], logs["survive"][-3000:]
    assert checkpoint.read_meta(path)["global_step"] == 5
    assert max_error(checkpoint.load_full_state_dict(path), reference(5, True)) <= TOLERANCE


# ----------------------------------------------------------------------------- the agreement, in process


def test_the_step_reports_the_stop_signal_a_rank_received_and_none_without_one():
    """The step's all-reduce carries each rank's stop signal: what its probe returns (a
    ``signal.Signals``), nothing where no signal arrived or the fit handles none."""
    import torch

    from cephalo_lightning.lightning.steps.step_state import no_stop_signal
    from cephalo_lightning.lightning.steps.step_sync import finish_step, start_step
    from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    sharded = ShardedModel(model, [1.0], units=[model[0], model[1]])
    preemption = Preemption(0, requeue_signal=None)
    assert preemption.pending() is None and no_stop_signal() is None
    assert start_step(torch.tensor(1.0), sharded, signal=preemption.pending).finish(False)[0].signals == ()
    preemption._handle(signal.SIGTERM, None)
    assert preemption.pending() is signal.SIGTERM
    report, _ = start_step(torch.tensor(1.0), sharded, signal=preemption.pending).finish(False)
    assert report.signals == ((0, int(signal.SIGTERM)),)
    assert finish_step(torch.tensor(1.0), sharded, False)[0].signals == ()
    assert finish_step(torch.tensor(1.0), sharded, False, signal=signal.SIGUSR1)[0].signals == ((0, int(signal.SIGUSR1)),)


def test_the_agreement_waits_for_an_optimizer_step_and_prefers_the_requeue_signal():
    preemption = Preemption(0, requeue_signal=signal.SIGUSR1)
    preemption._handle(signal.SIGTERM, None)
    preemption._handle(signal.SIGUSR1, None)
    assert preemption.pending() == signal.SIGUSR1
    report = StepReport(0.0, (), signals=((1, int(signal.SIGTERM)),))
    assert preemption.agree(report.signals, sync=False, step=4) is None  # mid-accumulation: not yet
    decision = preemption.agree(report.signals, sync=True, step=4)
    assert decision is not None and decision.step == 5 and not decision.requeue and decision.exit_code == EXIT_STOPPED
    preemption._handle(signal.SIGTERM, None)
    assert preemption.during_save == [signal.SIGTERM]
    both = Preemption(0, requeue_signal=signal.SIGUSR1).agree(((0, 15), (1, int(signal.SIGUSR1))), True, 0)
    assert both.requeue and both.exit_code == EXIT_REQUEUED
    assert both.describe() == "rank 0: SIGTERM, rank 1: SIGUSR1; stopped after 1 steps"


# ----------------------------------------------------------------------------- an elastic restart on fewer ranks


@pytest.mark.multiprocess
def test_an_elastic_restart_on_fewer_ranks_replans_the_pinned_plan_and_resumes_exactly(stopped, tmp_path):
    """The stop's checkpoint of the 2-rank run, resumed on 1 rank with the 2-rank plan still pinned:
    refused without ``elastic``; with it, re-planned with a warning and trained on to the
    uninterrupted run's parameters."""
    from cephalo_lightning.planner import PlanningError

    warnings.simplefilter("ignore")
    results, _ = stopped
    path = results[0]["SIGTERM to every rank"]["checkpoint"]
    with pytest.raises(PlanningError, match=r"elastic=True"):
        sgd_trainer(PLAN2, 1, TOTAL, str(tmp_path)).fit(SGDModule(), data_loader(True), ckpt_path=path)
    t = sgd_trainer(PLAN2, 1, TOTAL, str(tmp_path), {"elastic": True})
    with pytest.warns(UserWarning, match=r"the plan is for 2 ranks but the job has 1 \(an elastic restart\)"):
        t.fit(SGDModule(seed=3), data_loader(True), ckpt_path=path)
    assert t.strategy.plan.batch_sizes == [PLAN2.global_batch_size] and t.global_step == TOTAL
    assert max_error(t.strategy.sharded.full_state_dict(), reference(TOTAL, True)) <= TOLERANCE
