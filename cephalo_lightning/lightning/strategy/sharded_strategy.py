"""What a strategy whose tensors are its own shards tells Lightning: hands off placement and state.

The strategy places every piece on its device, builds the model on meta and materialises it unit
by unit, and saves and loads the shards (and the optimizer state, by logical tensor) itself, after
setup, in any layout. Lightning's own placement, state dicts and optimizer restore are turned off
here, so that :class:`~.strategy.CephaloStrategy` reads as what Cephalo does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch
from torch.optim import Optimizer
from typing_extensions import override

from cephalo_lightning.lightning.strategy.process_group import ProcessGroupStrategy
from cephalo_lightning.runtime import checkpoint
from cephalo_lightning.runtime.sharding.construction import ConstructionRecord


class ShardedStrategy(ProcessGroupStrategy):
    """A process-group strategy that owns its sharded tensors and their checkpoints.

    ``construction`` records what a model built on meta under this strategy computed, so its
    buffers get the constructor's values when it is materialised (:mod:`~cephalo_lightning.runtime.
    sharding.construction`); the strategy starts a new record once a model is materialised."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.construction = ConstructionRecord()

    @property
    @override
    def is_distributed(self) -> bool:
        return True  # else Lightning would not sync self.log(sync_dist=True)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # shard by this run's plan, then load any layout

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # loaded with the model, by logical tensor

    @override
    def model_to_device(self) -> None:
        pass  # sharding places every piece on the device

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        with (torch.device("meta") if empty_init else contextlib.nullcontext()), self.precision_plugin.tensor_init_context(), \
                (self.construction if empty_init else contextlib.nullcontext()):
            yield  # on meta, materialised one unit at a time when the model is sharded

    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        with torch.device("meta"), self.construction:  # configure_model() builds on meta; setup() materialises per unit
            yield

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the tensors are written by save_checkpoint, each rank its own pieces

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {}

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in load_checkpoint, where the layout is known

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        if self.is_global_zero:
            checkpoint.remove(filepath)
