"""A callback for the SLURM example's test (tests/test_slurm_example.py), named by class path in its config.

It stands in for the scheduler: with ``CEPHALO_TEST_SIGNAL_AFTER=N`` in the environment it sends this
process SIGUSR1 once ``N`` optimizer steps are done (what ``#SBATCH --signal=SIGUSR1@90`` does before
the time limit), and it appends ``start <step>`` / ``end <step>`` to ``CEPHALO_TEST_STEPS`` at every
fit's first and last training step, so the test sees where a requeued run continued.
"""

from __future__ import annotations

import os
import signal

import lightning.pytorch as pl
from typing_extensions import override


class SignalAndRecordSteps(pl.Callback):
    def _record(self, line: str) -> None:
        with open(os.environ["CEPHALO_TEST_STEPS"], "a") as out:
            out.write(line + "\n")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record(f"start {trainer.global_step}")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if str(trainer.global_step) == os.environ.get("CEPHALO_TEST_SIGNAL_AFTER"):
            os.kill(os.getpid(), signal.SIGUSR1)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record(f"end {trainer.global_step}")
