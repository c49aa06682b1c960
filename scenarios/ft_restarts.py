"""Whole-job restarts under ``CephaloStrategy(fault_tolerance=True)`` (tests/lightning/fit/test_fault_tolerance.py).

Two groups of one rank (the plan of :mod:`scenarios.ft_worker`: 8 and 4 of every global batch of
12), ``Trainer.fit`` of TinyLayered in fp64 on a **shuffled** loader of 36 samples (3 global batches a
data epoch, so :data:`TOTAL` steps cross two epoch boundaries), seed :data:`SEED`, a checkpoint every
2 steps in each group's own folder, a lighthouse process (``torchft_lighthouse``) on a fixed port.
:func:`run_restarts` runs the phases one after the other, each life a process:

* **both lost**: both groups SIGKILL themselves in step :data:`KILL_STEP` after the backward (two
  groups lost in one step: nothing live is left); the checkpoint of step :data:`RESUME_AT` is on disk;
* **started over**: both started again without ``ckpt_path``: refused at the first quorum (every
  group at step 0 while the run has checkpoints), exit 1;
* **resumed**: both started from group 0's checkpoint of step :data:`RESUME_AT` (``ckpt_path``); after
  group 0 commits step :data:`LIGHTHOUSE_AT` it writes ``lighthouse-kill`` and waits for
  ``lighthouse-down``; the runner kills the lighthouse, writes that, and starts it again on the same
  port :data:`LIGHTHOUSE_BACK_S` later; both train to :data:`TOTAL` (the lighthouse of this phase
  asks for both groups in every quorum, so neither trains a step without the other);
* **other seeds**: a fresh run (its own folder) whose groups are given seeds ``SEED`` and ``SEED + 1``
  (a lighthouse of ``--min_replicas 2``, so the first quorum holds both): refused at that quorum.

Every life logs its metrics (every step) to ``metrics-PHASE-G-PID.jsonl`` and, when it trains to the
end, its parameters to ``final-PHASE-G-PID.pt``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from scenarios.ft_worker import FIT_PLAN, GLOBAL, ROOT, metric_lines, wait_for

SAMPLES, TOTAL, SEED = 36, 8, 5
KILL_STEP, RESUME_AT, LIGHTHOUSE_AT = 5, 4, 6
LIGHTHOUSE_BACK_S = 2.0  # the lighthouse is down this long (far within the quorum timeout)
PHASES = ("both-lost", "started-over", "resumed", "other-seeds")


def life(work: Path, phase: str, group: int) -> None:
    """One life of ``group`` in ``phase`` (see the module notes)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from cephalo_lightning import CephaloStrategy
    from tests import helpers
    from tests.lightning_models import TinyLayered, loader, token_data

    torch.set_num_threads(1)
    pid = os.getpid()

    class Unlogged(TinyLayered):  # the strategy logs the step's train_loss itself (step and epoch)
        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.model.loss(self(x), y)

    class Instrumented(pl.Callback):
        def on_train_start(self, trainer, module):
            (work / f"ready-{phase}-{group}").write_text(str(pid))
            wait_for(lambda: all((work / f"ready-{phase}-{g}").exists() for g in (0, 1)), "both groups")

        def on_after_backward(self, trainer, module):
            if phase == "both-lost" and trainer.global_step == KILL_STEP:
                os.kill(pid, signal.SIGKILL)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if phase == "resumed" and group == 0 and trainer.global_step == LIGHTHOUSE_AT:
                (work / "lighthouse-kill").write_text(str(time.time()))
                wait_for(lambda: (work / "lighthouse-down").exists(), "the lighthouse killed")

    seed = SEED + (group if phase == "other-seeds" else 0)
    folder = work / ("fresh" if phase == "other-seeds" else "run") / f"group-{group}"
    strategy = CephaloStrategy(plan=FIT_PLAN, fault_tolerance=True, replica_group=group, check_devices=False, seed=seed)
    saves = ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    trainer = helpers.trainer(strategy, 1, TOTAL, precision="64-true", callbacks=[Instrumented(), saves],
                              enable_checkpointing=True, log_every_n_steps=1,
                              logger=metric_lines(work / f"metrics-{phase}-{group}-{pid}.jsonl"))
    resume = work / "run" / "group-0" / f"step={RESUME_AT}.ckpt" if phase == "resumed" else None
    trainer.fit(Unlogged(), loader(token_data(SAMPLES), GLOBAL, shuffle=True), ckpt_path=resume)
    torch.save({name: p.detach().clone() for name, p in trainer.lightning_module.named_parameters()},
               work / f"final-{phase}-{group}-{pid}.pt")


@dataclass(frozen=True)
class Restarts:
    """What the phases left: every life's exit code, logged metrics and final parameters, by (phase, group)."""

    exit_codes: dict[tuple[str, int], int]
    metrics: dict[tuple[str, int], list[dict]]
    finals: dict[tuple[str, int], dict[str, torch.Tensor]]
    checkpoints: dict[int, list[str]]  # each group's checkpoint names after the first phase
    logs: dict[tuple[str, int], str]
    lighthouse_restarted: bool  # the resumed phase's lighthouse was killed and started again


def _lighthouse(port: int, replicas: int) -> subprocess.Popen:
    command = [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", str(replicas),
               "--bind", f"127.0.0.1:{port}", "--heartbeat_timeout_ms", "2000", "--join_timeout_ms", "60000"]
    return subprocess.Popen(command, env={**os.environ, "RUST_LOG": "warn"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _start(work: Path, phase: str, group: int, lighthouse: str) -> subprocess.Popen:
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    environment.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RUST_LOG="warn", TORCHFT_LIGHTHOUSE=lighthouse)
    log = open(work / f"life-{phase}-{group}.log", "w")  # noqa: SIM115 (the child writes it)
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(work), phase, str(group)],
                            cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT)


def run_restarts(work: Path, deadline_s: float) -> Restarts:
    """The four phases in turn (see the module notes); every process is ended before this returns."""
    from cephalo_lightning.testing.local_ranks import free_port

    work.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + deadline_s
    codes: dict[tuple[str, int], int] = {}
    checkpoints: dict[int, list[str]] = {}
    port = free_port()
    address = f"http://127.0.0.1:{port}"
    processes: list[subprocess.Popen] = []
    try:
        for phase in PHASES:
            # both groups in every quorum where they start together (the phases compare whole runs)
            lighthouse = _lighthouse(port, 2 if phase in ("other-seeds", "resumed") else 1)
            processes.append(lighthouse)
            lives = [_start(work, phase, g, address) for g in (0, 1)]
            processes += lives
            while any(p.poll() is None for p in lives):
                if phase == "resumed" and (work / "lighthouse-kill").exists() and not (work / "lighthouse-down").exists():
                    lighthouse.kill()
                    lighthouse.wait()
                    (work / "lighthouse-down").write_text(str(time.time()))
                    time.sleep(LIGHTHOUSE_BACK_S)
                    lighthouse = _lighthouse(port, 2)
                    processes.append(lighthouse)
                if time.monotonic() > deadline:
                    raise AssertionError(f"phase {phase}: timed out")
                time.sleep(0.05)
            codes.update({(phase, g): p.returncode for g, p in enumerate(lives)})
            lighthouse.kill()
            lighthouse.wait()
            if phase == "both-lost":
                checkpoints = {g: sorted(p.name for p in (work / "run" / f"group-{g}").iterdir()) for g in (0, 1)}
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
    metrics, finals = {}, {}
    for path in work.glob("metrics-*.jsonl"):
        phase, group, _ = path.stem[len("metrics-"):].rsplit("-", 2)
        metrics[phase, int(group)] = [json.loads(line) for line in path.read_text().splitlines()]
    for path in work.glob("final-*.pt"):
        phase, group, _ = path.stem[len("final-"):].rsplit("-", 2)
        finals[phase, int(group)] = torch.load(path)
    logs = {(phase, g): (work / f"life-{phase}-{g}.log").read_text()[-4000:] for phase in PHASES for g in (0, 1)}
    return Restarts(codes, metrics, finals, checkpoints, logs, (work / "lighthouse-down").exists())


if __name__ == "__main__":
    life(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
