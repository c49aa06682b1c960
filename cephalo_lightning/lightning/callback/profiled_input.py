"""What the callback profiles: a sample batch from the training loader and the model's profiled form."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning.lightning._private import training_dataloader
from cephalo_lightning.lightning.callback.callback_config import CallbackConfig
from cephalo_lightning.lightning.fit.callback_api import CallbackAPI
from cephalo_lightning.profiling import ModelHooks
from cephalo_lightning.runtime.batching import leading_size, slice_batch


def planning_sample(trainer: pl.Trainer, strategy: CallbackAPI, config: CallbackConfig) -> tuple[Any, int]:
    """A batch of at most ``max_micro_batch`` rows to profile with, and the global batch to plan for."""
    loader = training_dataloader(trainer)
    batch_size = config.global_batch_size or strategy.global_batch_size or getattr(loader, "batch_size", None)
    if not batch_size:
        raise ConfigurationError("CephaloCallback needs the global batch: set batch_size on the training DataLoader "
                                 "or CephaloCallback(global_batch_size=B)")
    loader_batch = getattr(loader, "batch_size", None)
    if config.global_batch_size and loader_batch and strategy.global_batch_size is None and loader_batch != batch_size:
        raise ValueError(  # kept a ValueError by name: failure reports start with the type's name
            f"CephaloCallback(global_batch_size={config.global_batch_size}) but the training DataLoader's batch_size "
            f"is {loader_batch}: the DataLoader's batch is the global batch (every rank takes its slice of it), "
            "so they must agree; drop global_batch_size or set the DataLoader's batch_size to it"
        )
    batch = next(iter(loader))
    rows = leading_size(batch) or 1
    return slice_batch(batch, 0, min(rows, config.max_micro_batch)), int(batch_size)


def profiled_form(module: pl.LightningModule, strategy: CallbackAPI,
                  sample: Any) -> tuple[list[Any], Any, ModelHooks]:
    """What is measured: the layered form's layers on a sample batch, each gathered in place;
    else the whole module as one "layer" on its ``example_input_array``, every unit gathered."""
    layered = strategy.layered_form
    if layered is not None:
        return list(layered.layers), sample, ModelHooks(prepare=layered.prepare, loss=layered.loss,
                                                        unit_context=strategy.gathered_layer)
    example = getattr(module, "example_input_array", None)
    if example is None:
        raise ConfigurationError(
            f"CephaloCallback cannot profile {type(module).__name__}: it has no layered form "
            f"({strategy.why_not_layered}); set example_input_array, or give the strategy a plan / cluster file"
        )
    return [module], example, ModelHooks(unit_context=lambda i: strategy.gathered_model())
