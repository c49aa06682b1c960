"""Every private Lightning helper this package leans on, in one place.

They are the building blocks Lightning's own strategies use (DDP, FSDP, ModelParallel all import
them); a custom strategy has no public equivalent. If a Lightning release moves one, this is the
only file to change.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.strategies.strategy import _BackwardSyncControl as BackwardSyncControl
from lightning.fabric.utilities.distributed import _DatasetSamplerWrapper as DatasetSamplerWrapper
from lightning.fabric.utilities.distributed import _distributed_is_initialized as distributed_is_initialized
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device as default_process_group_backend,
)
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher as SubprocessScriptLauncher

__all__ = [
    "BackwardSyncControl", "LoggedValue", "SubprocessScriptLauncher", "captured_logs", "checkpoint_callback_settings",
    "default_process_group_backend", "distributed_is_initialized", "init_dist_connection", "logged_values",
    "logging_as", "module_hidden_from", "set_steps_done", "stop_at_batch_end", "sync_ddp_if_available",
    "training_dataloader", "wandb_checkpoint_name", "wandb_log_model",
    "wandb_logged_model_times",
]


@contextmanager
def module_hidden_from(strategy: pl.strategies.Strategy) -> Iterator[None]:
    """``strategy.lightning_module`` is None inside: ``Strategy.teardown`` then skips moving it to the
    host (``lightning_module`` reads ``Strategy._lightning_module``, which ``connect`` sets)."""
    module = strategy._lightning_module
    strategy._lightning_module = None
    try:
        yield
    finally:
        strategy._lightning_module = module


@contextmanager
def logging_as(module: pl.LightningModule, hook: str) -> Iterator[None]:
    """Let ``self.log`` inside ``hook`` file its values under that hook.

    Lightning records the running hook in ``LightningModule._current_fx_name``; the strategy calls
    the user's ``training_step`` for later micro-batches from inside ``backward``.
    """
    previous = module._current_fx_name
    module._current_fx_name = hook
    try:
        yield
    finally:
        module._current_fx_name = previous


def stop_at_batch_end(trainer: pl.Trainer) -> None:
    """Make the training loop raise ``SIGTERMException`` at the end of the running batch.

    Lightning's loops check the signal connector's ``received_sigterm`` after each batch (its own
    SIGTERM handler sets it, on the signalled rank only); the preemption handling sets it on every
    rank at the same step, once the ranks agreed to stop.
    """
    trainer._signal_connector.received_sigterm = True


def set_steps_done(trainer: pl.Trainer, steps: int) -> None:
    """Count ``steps`` optimizer steps as done before the fit's first batch (what a ``ckpt_path``
    resume restores into the fit loop's progress): ``trainer.global_step`` reads ``steps``, the run
    stops at ``max_steps`` counting them, and the loggers' step goes on from there. Called once the
    fit loop has reset its progress (``on_train_start``), before the first batch."""
    loop = trainer.fit_loop.epoch_loop
    optimizer = loop.automatic_optimization.optim_progress.optimizer
    for progress in (optimizer.step.total, optimizer.zero_grad.total):
        for name in ("ready", "started", "completed"):  # the trackers' fields (zero_grad's has `started`)
            if hasattr(progress, name):
                setattr(progress, name, steps)
    loop._batches_that_stepped = steps


def training_dataloader(trainer: pl.Trainer) -> Any:
    """The training dataloader as passed to ``fit`` (a loader, or from the datamodule / module).

    Before the fit loop builds its own, Lightning keeps the source in the loop's private
    ``_data_source``; it is the only way to look at a sample batch during ``setup``.
    """
    return trainer.fit_loop._data_source.dataloader()


@dataclass(frozen=True)
class LoggedValue:
    """One ``self.log`` call's value and options, as Lightning's result collection recorded it."""

    name: str
    value: Any  # a tensor (this micro-batch's value) or a torchmetrics Metric
    prog_bar: bool
    logger: bool
    on_step: bool
    on_epoch: bool
    reduction: str  # "mean" | "sum" | "max" | "min" | "custom"
    metric_attribute: str | None


@contextmanager
def captured_logs(trainer: pl.Trainer) -> Iterator[Any]:
    """``self.log`` calls inside land in a fresh result collection instead of the training loop's.

    The strategy runs the user's ``training_step`` once per micro-batch; Lightning keeps the LAST
    call's value for ``on_step``, so the strategy collects every micro-batch's values here and
    logs their weighted global combination once (see :mod:`cephalo_lightning.lightning.steps.log_relay`).
    """
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    loop = trainer.fit_loop.epoch_loop
    saved = loop._results
    capture = _ResultCollection(training=True)
    loop._results = capture
    try:
        yield capture
    finally:
        loop._results = saved


def logged_values(capture: Any) -> list[LoggedValue]:
    """What ``self.log`` recorded into a captured collection (one ``training_step`` call)."""
    out = []
    for metric in capture.values():
        meta = metric.meta
        reduction = next((r for r in ("mean", "sum", "max", "min") if getattr(meta, f"is_{r}_reduction")), "custom")
        if metric.is_tensor:
            if metric._forward_cache is not None:
                value = metric._forward_cache
            elif reduction == "mean":
                value = metric.value / metric.cumulated_batch_size
            else:
                value = metric.value
        else:
            value = metric.value
        out.append(LoggedValue(meta.name, value, meta.prog_bar, meta.logger, meta.on_step, meta.on_epoch, reduction,
                               meta.metric_attribute))
    return out


# WandbLogger keeps its checkpoint-upload settings and record private, and describes a checkpoint
# callback by some private attributes; uploading checkpoint directories the way it uploads files
# needs the same.


def wandb_log_model(logger: Any) -> bool | str:
    """``WandbLogger(log_model=...)``: False, True (at the end) or "all" (every checkpoint)."""
    return logger._log_model


def wandb_checkpoint_name(logger: Any) -> str | None:
    """``WandbLogger(checkpoint_name=...)``; None means Lightning's default ``model-<run id>``."""
    return logger._checkpoint_name


def wandb_logged_model_times(logger: Any) -> dict[str, float]:
    """The logger's own record of uploaded checkpoints (path -> mtime), updated in place."""
    return logger._logged_model_time


def checkpoint_callback_settings(callback: Any) -> dict[str, Any]:
    """What WandbLogger puts in a checkpoint artifact's metadata about the callback that wrote it."""
    keys = ("monitor", "mode", "save_last", "save_top_k", "save_weights_only", "_every_n_train_steps")
    return {k: getattr(callback, k) for k in keys if hasattr(callback, k)}


def user_sampler(sampler: Any) -> Any:
    """The sampler the user gave a DataLoader, seen through Lightning's ``DistributedSamplerWrapper``
    (which deals out a custom sampler's indices as a dataset: a private ``_DatasetSamplerWrapper``
    holding it as ``_sampler``), or ``sampler`` itself when Lightning did not wrap it."""
    dataset = getattr(sampler, "dataset", None)
    return dataset._sampler if isinstance(dataset, DatasetSamplerWrapper) else sampler
