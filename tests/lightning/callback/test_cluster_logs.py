"""What a log that is not a terminal shows (torchrun, SLURM): plain progress lines, and no warning
caused by the strategy's own ``self.log`` calls. One-rank fits in this process (pytest's captured
stdout is not a terminal)."""

from __future__ import annotations

import re
import warnings

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger

from cephalo_lightning import CephaloStrategy
from cephalo_lightning.lightning.callback.plain_progress import ProgressLines
from tests.helpers import NUM_SAMPLES, reference, trainer
from tests.lightning_models import TinyLayered, TinyUniform, loader, token_data

STEP_LINE = re.compile(r"^Epoch (\d+) \| step (\d+)/(\d+) \| (.*) \| ([0-9.e+-]+) s/step, ([0-9.e+-]+) samples/s$")
# fp32 losses of order 3, averaged over a few steps: far above their rounding (1e-7 relative)
LOSS_TOL = 1e-5


def _fit_with_progress(module: pl.LightningModule, steps: int, logger=False, log_every_n_steps: int = 50,
                       **options) -> pl.Trainer:
    """A one-rank fit on token samples in batches of 12 with the progress display on (what these tests read)."""
    t = trainer(CephaloStrategy(**options), 1, steps, logger=logger, log_every_n_steps=log_every_n_steps,
                enable_progress_bar=True)
    t.fit(module, loader(token_data(NUM_SAMPLES), 12))
    return t


def _step_lines(out: str) -> list[re.Match]:
    return [m for m in map(STEP_LINE.match, out.splitlines()) if m]


def test_a_fit_whose_stdout_is_not_a_terminal_prints_a_plain_line_every_n_steps(capsys, caplog):
    caplog.set_level("INFO")
    t = _fit_with_progress(TinyLayered(), 6, progress_every=3)
    out = capsys.readouterr().out
    lines = _step_lines(out)
    assert [int(m[2]) for m in lines] == [3, 6], out  # each once: one bar, no duplicates
    assert all(m[3] == "6" and "train_loss_step=" in m[4] and float(m[6]) > 0 for m in lines), lines
    assert "Epoch 0 done | step 4/6 | " in out  # an epoch is 4 batches of 12
    assert [type(c) for c in t.callbacks if isinstance(c, (ProgressLines, RichProgressBar, TQDMProgressBar))] == [ProgressLines]
    assert "stdout is not a terminal" in caplog.text and "progress_every=0" in caplog.text


class _UnsyncedEpochLoss(TinyUniform):
    """Logs its loss per epoch without ``sync_dist``: the strategy makes it global itself."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.model.loss(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, batch_size=x.size(0))
        return loss


def test_a_fit_raises_no_warning_about_the_values_the_strategy_logs(tmp_path, capsys):
    """The strategy logs values that are global already (the step's all-reduce): Lightning must not
    ask for ``sync_dist=True`` at the epoch's end, and the epoch's value is still the mean of the
    steps' global losses (single-process reference). The layered fit has no logger (the strategy's
    ``train_loss`` then goes to the progress bar only); the user's own logs need one. Also: unset,
    ``progress_every`` is the Trainer's ``log_every_n_steps``; 0 keeps Lightning's bar."""
    _, want = reference(3, 12)
    fits = ((TinyLayered(), {"log_every_n_steps": 1}), (_UnsyncedEpochLoss(), {"logger": CSVLogger(tmp_path), "progress_every": 0}))
    for module, options in fits:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = _fit_with_progress(module, 3, **options)
        about_logging = [str(w.message) for w in caught if "sync_dist" in str(w.message) or "train_loss" in str(w.message)]
        assert not about_logging, about_logging
        assert abs(float(t.callback_metrics["train_loss_epoch"]) - sum(want) / 3) <= LOSS_TOL
        if options.get("progress_every") == 0:
            assert isinstance(t.progress_bar_callback, (RichProgressBar, TQDMProgressBar))
        else:
            assert [int(m[2]) for m in _step_lines(capsys.readouterr().out)] == [1, 2, 3]
