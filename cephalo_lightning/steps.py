"""One training step of a rank under the plan: the layered schedule or micro-batch-major (uniform).

Both cut the rank's local batch (b_i samples) into its n_i micro-batches and weight micro-batch
k's mean loss by s_k / B (and 1 / accumulate_grad_batches), so that the gradients summed by the
reduce-scatter equal the gradient of the mean loss over the global batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from cephalo_lightning.planner import RankPlan
from cephalo_lightning.runtime.batching import micro_batches
from cephalo_lightning.runtime.engine import ShardedModel
from cephalo_lightning.runtime.layered import LayeredSchedule

LAYERED_PROTOCOL = ("cephalo_layers", "cephalo_input", "cephalo_loss")


def has_layered_protocol(module: pl.LightningModule) -> bool:
    return all(callable(getattr(module, name, None)) for name in LAYERED_PROTOCOL)


def global_sum(value: torch.Tensor) -> torch.Tensor:
    value = value.detach().float().clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value)
    return value


@dataclass(frozen=True)
class StepContext:
    rank_plan: RankPlan
    global_batch: int
    accumulate: int  # Trainer(accumulate_grad_batches=...)
    sync: bool  # reduce gradients at the end of this batch (False while Lightning accumulates)
    loss_scale: float = 1.0  # a gradient scaler's scale (16-mixed)

    def weights(self) -> list[float]:
        return [s / self.global_batch for s in self.rank_plan.micro_batch_sizes]


class LayeredSteps:
    """Layer-major: the strategy runs ``cephalo_input -> cephalo_layers -> cephalo_loss``.

    The user's ``training_step`` is not called; the step's global mean loss is returned (and
    logged by the strategy).
    """

    def __init__(self, module: pl.LightningModule, schedule: LayeredSchedule) -> None:
        self.module = module
        self.schedule = schedule

    def forward(self, batch: Any, ctx: StepContext, *args: Any) -> torch.Tensor:
        sizes = ctx.rank_plan.micro_batch_sizes
        parts = micro_batches(batch, sizes) if sizes else []
        inputs = [self.module.cephalo_input(part) for part in parts]
        if any(x.requires_grad for x in inputs):
            raise TypeError(
                "cephalo_input returned a tensor that needs a gradient: it used parameters, which the "
                "layered schedule cannot train there. Move that computation (e.g. the embedding) into "
                "the first of cephalo_layers(); cephalo_input should only pick tensors out of the batch"
            )
        weights = [w / ctx.accumulate for w in ctx.weights()]
        local = self.schedule.forward(inputs, lambda k, out: self.module.cephalo_loss(out, parts[k]), weights)
        return global_sum(local) * ctx.accumulate  # Lightning divides what we return by `accumulate`

    def backward(self, closure_loss: torch.Tensor, ctx: StepContext) -> None:
        self.schedule.backward(ctx.loss_scale)


class UniformSteps:
    """Micro-batch-major through the user's own ``training_step`` (any model).

    Micro-batch 0 runs in ``forward`` (Lightning then zeroes the gradients and calls backward);
    the others run in ``backward``, each followed by its own backward, with the gradients kept
    unsharded until the last one.
    """

    def __init__(self, sharded: ShardedModel, training_step: Callable[..., Any]) -> None:
        self.sharded = sharded
        self.training_step = training_step
        self._rest: list[Any] = []
        self._args: tuple = ()

    def forward(self, batch: Any, ctx: StepContext, *args: Any) -> Any:
        parts = micro_batches(batch, ctx.rank_plan.micro_batch_sizes)
        self._rest, self._args = parts[1:], args
        self.sharded.gather_root()
        return self.training_step(parts[0], *args)

    @staticmethod
    def _loss(output: Any) -> torch.Tensor:
        return output["loss"] if isinstance(output, dict) else output

    def backward(self, closure_loss: torch.Tensor, ctx: StepContext) -> None:
        """``closure_loss``: micro-batch 0's loss as Lightning prepared it (already / accumulate
        and, with a gradient scaler, already scaled)."""
        weights = ctx.weights()
        n = len(weights)
        self.sharded.set_requires_gradient_sync(ctx.sync and n == 1)
        self.sharded.backward(closure_loss * weights[0])
        for k, part in enumerate(self._rest, start=1):
            loss = self._loss(self.training_step(part, *self._args)) / ctx.accumulate
            self.sharded.set_requires_gradient_sync(ctx.sync and k == n - 1)
            self.sharded.backward(loss * (weights[k] * ctx.loss_scale))
        self._rest = []
        self.sharded.set_requires_gradient_sync(True)
