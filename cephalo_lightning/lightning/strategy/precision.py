"""Lightning precision plugins that know the gradients are uneven shards.

Lightning clips with ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters; under
Cephalo those are this rank's pieces only, so the norm would be local. These plugins compute the
norm of the whole model across ranks instead, and 16-bit AMP gets a scaler whose inf/nan check is
agreed by all ranks (one rank skipping a step alone would desynchronise the model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer
from typing_extensions import override

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning.runtime.collectives import Collectives
from cephalo_lightning.runtime.sharding.clip import clip_grad_norm_


class _ShardedClipping(Precision):
    """Mixin: gradient-norm clipping by the norm over every rank's shard of the optimizer's parameters.

    Lightning's hook (``clip_grad_by_norm``) gets the optimizer; its parameters are this rank's
    pieces, each element owned by one rank, so one all-reduce over the ranks that share the model
    (:meth:`shard_over`) gives the global norm.
    """

    comm: Collectives | None = None  # the sharded model's world collectives; None: the world group
    contributes: bool = True  # this rank's replica is the one whose norm every replica uses

    clipper: Callable[[float], Any] | None = None  # a pipelined plan's clip over every stage

    def shard_over(self, comm: Collectives, contributes: bool = True) -> None:
        """Clip over the ranks of ``comm``'s group, every replica's; with shard groups only one
        replica's ranks ``contribute`` their shards' norm, so every replica scales alike."""
        self.comm, self.contributes = comm, contributes

    def clip_with(self, clipper: Callable[[float], Any]) -> None:
        """Clip by norm with ``clipper(max_norm)`` instead (a pipelined plan's runner: the norm over
        every stage's pieces, a parameter tied across stages counted once)."""
        self.clipper = clipper

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        if self.clipper is not None:
            self.clipper(float(clip_val))
            return
        clip_grad_norm_(self.main_params(optimizer), float(clip_val), comm=self.comm, contributes=self.contributes)

    # clipping by value is elementwise, so each rank clipping its own pieces is already exact


class CephaloPrecision(_ShardedClipping, Precision):
    """``precision="32-true"``."""


class CephaloDoublePrecision(_ShardedClipping, DoublePrecision):
    """``precision="64-true"``: fp64 masters and reductions (for exactness checks, mostly)."""


class CephaloHalfPrecision(_ShardedClipping, HalfPrecision):
    """``precision="bf16-true" / "16-true"``: the master shards stay fp32, compute is 16-bit."""


class CephaloMixedPrecision(_ShardedClipping, MixedPrecision):
    """``precision="bf16-mixed" / "16-mixed"`` (autocast); 16-mixed gets a cross-rank scaler."""

    def __init__(self, precision: str, device: str) -> None:
        scaler = None
        if precision == "16-mixed":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler(device=device)
        super().__init__(precision, device, scaler)  # type: ignore[arg-type]


def autocast_dtype(plugin: Precision) -> torch.dtype | None:
    """The dtype autocast computes in under ``bf16-mixed`` / ``16-mixed`` (bf16 / fp16), None under any
    other precision: what a frozen parameter is stored and gathered in while the trainable ones stay
    fp32 (:class:`~cephalo_lightning.runtime.sharding.flat_unit.FlatUnit`'s ``frozen_dtype``)."""
    if not isinstance(plugin, MixedPrecision):
        return None
    return torch.bfloat16 if str(plugin.precision).startswith("bf16") else torch.float16


def sharded_precision(plugin: Precision) -> Precision:
    """The Cephalo counterpart of the plugin Lightning chose for ``Trainer(precision=...)``."""
    if isinstance(plugin, _ShardedClipping):
        return plugin
    if type(plugin) is Precision:
        return CephaloPrecision()
    if type(plugin) is DoublePrecision:
        return CephaloDoublePrecision()
    if type(plugin) is HalfPrecision:
        return CephaloHalfPrecision(plugin.precision)  # type: ignore[arg-type]
    if type(plugin) is MixedPrecision:
        return CephaloMixedPrecision(plugin.precision, plugin.device)
    raise ConfigurationError(
        f"CephaloStrategy does not support the precision plugin {type(plugin).__name__} "
        f"(precision={getattr(plugin, 'precision', '?')!r}); use precision='32-true', '64-true', "
        "'bf16-mixed', '16-mixed', 'bf16-true' or '16-true'"
    )
