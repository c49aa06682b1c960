"""Preemption that saves: SIGTERM, and SLURM's requeue signal, stop every rank at one step boundary.

A signal may reach any subset of the ranks (a scheduler that signals one node, ``kill`` on one
process). The handler only records it: no collective, no save, no I/O runs inside a signal handler,
where one rank could enter a collective the others never reach. Each rank adds the signal it
received to the all-reduce that every training step already makes (its slot in
:class:`~.step_sync.StepSync`'s vector), so after the first step whose all-reduce carries a signal
every rank knows the same thing at the same point. At that step's end (the optimizer step done,
its callbacks run) the fit stops on every rank; the strategy saves a checkpoint (collective,
:meth:`Preemption.checkpoint_path`), asks SLURM to requeue the job (rank 0, ``scontrol requeue``,
as Lightning does) when the requeue signal was among them, and exits with the status below.

Exit statuses (the process's):

* :data:`EXIT_STOPPED` (143 = 128 + SIGTERM): stopped by SIGTERM, a checkpoint saved, not requeued;
* :data:`EXIT_REQUEUED` (138 = 128 + SIGUSR1, or 128 + the environment's requeue signal): the
  requeue signal under SLURM: a checkpoint saved, ``scontrol requeue`` run;
* 1: the save failed (its error is raised; the previous checkpoint is untouched).

A further signal while the checkpoint is written is recorded and logged, not acted on: the save
completes (or, if the process is killed meanwhile, the checkpoint publish is atomic and the
previous checkpoint stays the newest loadable one).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint

log = logging.getLogger(__name__)

EXIT_STOPPED = 128 + signal.SIGTERM
EXIT_REQUEUED = 128 + signal.SIGUSR1  # with SLURMEnvironment(requeue_signal=S): 128 + S
CHECKPOINT_NAME = "last-preempted.ckpt"  # "last...": found by fit(ckpt_path="last") beside ModelCheckpoint's


@dataclass(frozen=True)
class StopDecision:
    """What every rank agreed on at a step boundary."""

    step: int  # optimizer steps done when the fit stops
    signals: tuple[tuple[int, int], ...]  # (rank, signal number) of the ranks that were signalled
    requeue: bool  # the requeue signal was among them and SLURM requeueing is on
    exit_code: int  # the process's exit status (see the module docstring)

    def describe(self) -> str:
        names = ", ".join(f"rank {r}: {signal.Signals(s).name}" for r, s in self.signals)
        return f"{names}; stopped after {self.step} steps"


class Preemption:
    """The handlers of one fit, and the decision the ranks reach (see the module docstring)."""

    def __init__(self, rank: int, requeue_signal: int | None, forward: Callable[[int], None] | None = None) -> None:
        self.rank = rank
        self.requeue_signal = requeue_signal  # None: not under SLURM with requeueing
        self.forward = forward  # passes the first signal on to child processes this one launched
        self.received = 0  # the signal this rank received (the requeue signal wins over SIGTERM)
        self.during_save: list[int] = []
        self.saving = False
        self.decision: StopDecision | None = None
        self._previous: dict[int, Any] = {}

    @classmethod
    def for_trainer(cls, trainer: pl.Trainer, environment: Any) -> Preemption:
        requeue = None
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            requeue = int(environment.requeue_signal or signal.SIGUSR1)
        launcher = trainer.strategy.launcher
        forward = launcher.kill if launcher is not None and getattr(launcher, "procs", None) else None
        return cls(trainer.global_rank, requeue, forward)

    @property
    def signals(self) -> tuple[int, ...]:
        return (signal.SIGTERM,) + ((self.requeue_signal,) if self.requeue_signal else ())

    def install(self) -> None:
        """Replace the process's handlers of :attr:`signals` (Lightning's among them: its SIGTERM
        handler broadcasts, its requeue handler saves, both inside the handler) until :meth:`uninstall`."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("Cephalo: the fit does not run on the main thread: signals cannot be handled; a SIGTERM "
                        "will not save a checkpoint")
            return
        for signum in self.signals:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)
        log.info(f"Cephalo: rank {self.rank} handles {', '.join(signal.Signals(s).name for s in self.signals)} "
                 "while training: all ranks stop at the next step boundary and save a checkpoint")

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.saving or self.decision is not None:
            self.during_save.append(signum)
            return
        first = not self.received
        if first or signum == self.requeue_signal:
            self.received = signum
        if first and self.forward is not None:
            self.forward(signum)

    def pending(self) -> signal.Signals | None:
        """This rank's contribution to the step's all-reduce: the signal it received, None if none
        (a :data:`~.step_state.StopSignalProbe`)."""
        return signal.Signals(self.received) if self.received else None

    def agree(self, signals: tuple[tuple[int, int], ...], sync: bool, step: int) -> StopDecision | None:
        """The step's all-reduce carried ``signals`` (the same on every rank). Decided only where an
        optimizer step follows (``sync``): under gradient accumulation the window completes first."""
        if self.decision is not None or not signals or not sync:
            return None
        requeue = self.requeue_signal is not None and any(s == self.requeue_signal for _, s in signals)
        code = 128 + self.requeue_signal if requeue else EXIT_STOPPED
        self.decision = StopDecision(step + 1, signals, requeue, code)
        return self.decision

    def checkpoint_path(self, trainer: pl.Trainer) -> Path:
        """Where the stop's checkpoint goes: the first ``ModelCheckpoint``'s folder (so that
        ``fit(ckpt_path="last")`` finds it), else ``Trainer(default_root_dir)``."""
        folders = [c.dirpath for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
        return Path(folders[0] if folders else trainer.default_root_dir) / CHECKPOINT_NAME

    def save_and_stop(self, trainer: pl.Trainer, exit_: SystemExit, wait: Callable[[], None]) -> None:
        """Collective, on every rank at the agreed step (Lightning's ``SIGTERMException`` is being
        handled): save the checkpoint (``wait``: until a background write of it is published),
        requeue (rank 0), and set the exit status on ``exit_``."""
        decision = self.decision
        assert decision is not None
        path = self.checkpoint_path(trainer)
        self.saving = True
        try:
            trainer.save_checkpoint(path)
            wait()
        finally:
            self.saving = False
        what = "not requeued"
        if decision.requeue:
            what = "rank 0 requeues the job" if not trainer.is_global_zero else (
                "the job was requeued" if requeue_job() else "requeueing FAILED (see above)")
        exit_.code = decision.exit_code
        log.error(f"Cephalo (rank {self.rank}): stop signal ({decision.describe()}); saved {path}, {what}; exiting "
                  f"with status {exit_.code}{self.late_signals()}. Resume with trainer.fit(..., "
                  f"ckpt_path={str(path)!r}) or ckpt_path=\"last\".")

    def late_signals(self) -> str:
        if not self.during_save:
            return ""
        names = ", ".join(signal.Signals(s).name for s in self.during_save)
        return f" ({names} arrived while stopping; the save was completed first)"


def requeue_job(environ: dict[str, str] | None = None) -> bool:
    """``scontrol requeue <job>`` for this SLURM job (an array task's own id); True if it succeeded."""
    env = os.environ if environ is None else environ
    array_job = env.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{env['SLURM_ARRAY_TASK_ID']}" if array_job is not None else env.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        log.error(f"Cephalo: cannot requeue: SLURM_JOB_ID is {job!r}, not a job id")
        return False
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.error(f"Cephalo: `scontrol requeue {job}` failed to run ({err}); requeue the job by hand")
        return False
    if done.returncode != 0:
        log.error(f"Cephalo: `scontrol requeue {job}` exited with {done.returncode}: {done.stderr.strip()[:300]}; "
                  "requeue the job by hand")
        return False
    log.info(f"Cephalo: requeued SLURM job {job}")
    return True
