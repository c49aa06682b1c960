"""One optimizer per sharded unit, stepped as soon as the unit's gradient is reduced: what
``LayeredSchedule(on_unit_reduced=...)`` is tested and measured with (``tests/runtime/test_layered.py``,
``tests/runtime/test_shard_groups.py``, ``benchmarks/bench_layered.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from cephalo_lightning.runtime.sharding.flat_unit import FlatUnit
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel


class UnitOptimizers:
    """One optimizer per unit, stepped as soon as the unit's gradient is reduced.

    The usual step waits for the whole backward, so every unit's local gradient is resident at
    once; stepping unit by unit frees each gradient before the next layer's backward runs, so only
    one unit's gradient is ever held. Use it as ``LayeredSchedule(..., on_unit_reduced=opts.step_unit)``
    with ``make_optimizer(params) -> Optimizer`` (the same hyperparameters for every unit). Gradient
    clipping by the global norm is not possible this way: the norm is known only at the end.
    """

    def __init__(self, sharded: ShardedModel, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.optimizers = {id(u): make_optimizer(u.local_params) for u in sharded.units if u.trainable}

    def step_unit(self, unit: FlatUnit) -> None:
        optimizer = self.optimizers[id(unit)]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
