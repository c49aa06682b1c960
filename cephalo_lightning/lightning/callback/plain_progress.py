"""Plain progress lines for logs that are not a terminal (torchrun, SLURM, a pipe).

In such a log Lightning's default bar redraws in place: its updates land in the file only at the
end of an epoch (and the rich bar reads "Epoch 0/-2" when only ``max_steps`` bounds the fit).
:class:`ProgressLines` is a Lightning ``ProgressBar`` that prints one self-contained line every
``every_n_steps`` optimizer steps instead, from global rank 0 only: epoch, step (of the total when
known), the progress-bar metrics (``train_loss``, ...), and the throughput since the previous line.

:func:`use_progress_lines` puts it in place of Lightning's default bar when stdout is not a
terminal, once per fit, and says so in the log. A terminal keeps Lightning's bar, and so does a bar
the user configured (another class or another ``refresh_rate``); ``enable_progress_bar=False``
shows none, as always.
"""

from __future__ import annotations

import inspect
import math
import sys
import time
from typing import Any, TextIO

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

LIGHTNING_DEFAULT_BARS = (RichProgressBar, TQDMProgressBar)  # what Trainer(enable_progress_bar=True) picks


class ProgressLines(ProgressBar):
    """One plain line every ``every_n_steps`` optimizer steps, and one per finished epoch and
    validation, on global rank 0. ``samples_per_step``: the global batch (with accumulation: the
    samples of one optimizer step), for the throughput; ``None`` prints steps per second only."""

    def __init__(self, every_n_steps: int = 50, samples_per_step: int | None = None, stream: TextIO | None = None) -> None:
        super().__init__()
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"ProgressLines(every_n_steps={every_n_steps!r}) must be an integer >= 1")
        self.every_n_steps = every_n_steps
        self.samples_per_step = samples_per_step
        self.stream = stream
        self._enabled = True
        self._mark: tuple[int, float] | None = None  # (step, time) of the previous line

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    @override
    def print(self, *args: Any, **kwargs: Any) -> None:
        if self._enabled:
            print(*args, file=self.stream or sys.stdout, flush=True, **kwargs)

    def _metrics_text(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        parts = []
        for name, value in self.get_metrics(trainer, pl_module).items():
            if name == "v_num":
                continue
            parts.append(f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}")
        return " ".join(parts)

    def _total_steps(self, trainer: pl.Trainer) -> str:
        total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        return f"/{int(total)}" if isinstance(total, (int, float)) and math.isfinite(total) else ""

    def _throughput(self, step: int) -> str:
        now = time.perf_counter()
        previous, self._mark = self._mark, (step, now)
        if previous is None or step <= previous[0] or now <= previous[1]:
            return ""
        per_step = (now - previous[1]) / (step - previous[0])
        rate = f", {self.samples_per_step / per_step:.4g} samples/s" if self.samples_per_step else ""
        return f" | {per_step:.4g} s/step{rate}"

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark = (trainer.global_step, time.perf_counter())

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every_n_steps or (self._mark is not None and self._mark[0] == step):
            return  # not a line's step, or this step's line is out already (gradient accumulation)
        speed = self._throughput(step)
        self.print(f"Epoch {trainer.current_epoch} | step {step}{self._total_steps(trainer)} | "
                   f"{self._metrics_text(trainer, pl_module)}{speed}")

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.print(f"Epoch {trainer.current_epoch} done | step {trainer.global_step}{self._total_steps(trainer)} | "
                   f"{self._metrics_text(trainer, pl_module)}")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.print(f"Validation | epoch {trainer.current_epoch} step {trainer.global_step} | "
                       f"{self._metrics_text(trainer, pl_module)}")


def is_lightning_default(bar: Any) -> bool:
    """The bar Lightning adds by itself: one of its two classes with its default refresh rate."""
    if type(bar) not in LIGHTNING_DEFAULT_BARS:
        return False
    default = inspect.signature(type(bar).__init__).parameters["refresh_rate"].default
    return bar.refresh_rate == default


def stdout_is_terminal() -> bool:
    isatty = getattr(sys.stdout, "isatty", None)
    return bool(isatty and isatty())


def use_progress_lines(trainer: pl.Trainer, every_n_steps: int | None, samples_per_step: int | None,
                       option: str = "CephaloStrategy(progress_every=0)") -> ProgressLines | None:
    """Put :class:`ProgressLines` in place of Lightning's default bar when stdout is not a terminal.

    ``every_n_steps``: ``None`` for the Trainer's ``log_every_n_steps``, 0 to keep Lightning's bar.
    ``option``: how the user switches it off, for the log line. Returns the bar put in place, if any.
    """
    bar = trainer.progress_bar_callback
    if every_n_steps == 0 or bar is None or isinstance(bar, ProgressLines) or not is_lightning_default(bar):
        return None
    if stdout_is_terminal():
        return None
    every = every_n_steps or max(1, trainer.log_every_n_steps)
    lines = ProgressLines(every, samples_per_step)
    trainer.callbacks[trainer.callbacks.index(bar)] = lines
    lines.setup(trainer, trainer.lightning_module, "fit")  # Lightning ran the setup hooks already
    rank_zero_info(f"Cephalo: stdout is not a terminal, so progress is printed as a plain line every {every} steps "
                   f"instead of Lightning's {type(bar).__name__}; {option} keeps Lightning's bar")
    return lines
