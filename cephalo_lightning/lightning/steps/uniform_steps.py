"""The uniform mode's training step: micro-batch-major through the user's own ``training_step``.

Micro-batch k's loss ``l_k`` enters the gradient as ``w_k l_k`` (:mod:`.micro_batch_weights`),
one backward per micro-batch, the gradients kept unsharded until the last one, which
reduce-scatters them; the step's all-reduce (:mod:`.step_sync`) carries ``sum_k w_k l_k`` and the
user's logged values (:mod:`.log_relay`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from cephalo_lightning.lightning._private import LoggedValue, captured_logs, logged_values
from cephalo_lightning.lightning.steps.log_relay import relog, relog_last, weighted_logs
from cephalo_lightning.lightning.steps.micro_batch_weights import micro_batch_weights
from cephalo_lightning.lightning.steps.step_output import check_training_step_output
from cephalo_lightning.lightning.steps.step_state import StepContext, StepReport, UniformStep
from cephalo_lightning.lightning.steps.step_sync import StepSync, finish_step, start_step
from cephalo_lightning.models.protocol import LossWeighting
from cephalo_lightning.runtime.batching import micro_batches
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel


class UniformSteps:
    """Micro-batch-major through the user's own ``training_step`` (any model).

    Micro-batch 0 runs in ``forward`` (Lightning then zeroes the gradients and calls backward);
    the others run in ``backward``, each followed by its own backward, with the gradients kept
    unsharded until the last one. The user's ``self.log`` calls are collected per micro-batch and
    logged once per step with their weighted global value (as single-process training on the
    global batch would log them).

    Manual optimization (one micro-batch per rank): the user's ``training_step`` drives the step
    itself (``manual_backward``, ``optimizer.step()``), so it runs as it is, its logs untouched.
    """

    def __init__(self, module: pl.LightningModule, sharded: ShardedModel, training_step: Callable[..., Any],
                 weighting: LossWeighting) -> None:
        self.module = module
        self.sharded = sharded
        self.training_step = training_step
        self.weighting = weighting
        self.output_checked = False  # the first call's output is checked (check_training_step_output)

    def start(self, batch: Any, context: StepContext) -> UniformStep:
        """Collective (token weighting): the step cut into micro-batches, each with its weight."""
        parts = micro_batches(batch, context.rank_plan.micro_batch_sizes)
        weights, _ = micro_batch_weights(parts, self.weighting, context.global_batch, self.sharded.device,
                                         self.sharded.world_group, context.global_items)
        return UniformStep(context, parts, weights)

    def forward(self, step: UniformStep) -> Any:
        self.sharded.gather_root()
        return self._run(step, 0)

    def _run(self, step: UniformStep, k: int) -> Any:
        """The user's ``training_step`` on micro-batch ``k``, its loss and logged values kept in ``step``."""
        part, args = step.micro_batches[k], step.context.args
        if not self.module.automatic_optimization:
            return self.training_step(part, *args)
        with captured_logs(self.module.trainer) as capture:
            step.capturing = True
            try:
                output = self.training_step(part, *args)
            finally:
                step.capturing = False
        if output is None or not self.output_checked:
            check_training_step_output(output)
            self.output_checked = True
        step.logged.append((step.weights[k], logged_values(capture)))
        step.losses.append(self._loss(output).detach())
        return output

    @staticmethod
    def _loss(output: Any) -> torch.Tensor:
        return output["loss"] if isinstance(output, dict) else output

    def backward(self, closure_loss: torch.Tensor, step: UniformStep) -> StepReport:
        """``closure_loss``: micro-batch 0's loss as Lightning prepared it (already / accumulate
        and, with a gradient scaler, already scaled)."""
        context, weights = step.context, step.weights
        n = len(weights)
        if not self.module.automatic_optimization:  # manual_backward(loss) from inside training_step
            self.sharded.backward(closure_loss * weights[0])  # already scaled by the precision plugin
            report, _ = finish_step(closure_loss.detach() * weights[0], self.sharded, context.sync,
                                    signal=context.pending_signal())
            return report
        self.sharded.set_requires_gradient_sync(context.sync and n == 1)
        started = self._start_sync(step) if n == 1 else None  # the last micro-batch's loss and logs are known
        self.sharded.backward(closure_loss * weights[0])
        for k in range(1, n):
            loss = self._loss(self._run(step, k)) / context.accumulate
            self.sharded.set_requires_gradient_sync(context.sync and k == n - 1)
            if k == n - 1:
                started = self._start_sync(step)
            self.sharded.backward(loss * (weights[k] * context.loss_scale))
        self.sharded.set_requires_gradient_sync(True)
        assert started is not None
        names, sync = started
        report, values = sync.finish(context.sync)
        relog(self.module, names, values, context.global_batch)
        relog_last(self.module, step.logged, {spec.name for spec in names})
        return report

    def _start_sync(self, step: UniformStep) -> tuple[list[LoggedValue], StepSync]:
        """The step's all-reduce, once every micro-batch's loss and logs are in ``step``: the names
        of the logged sums it carries, and the all-reduce."""
        local = sum((w * loss.double() for w, loss in zip(step.weights, step.losses) if w),
                    torch.zeros((), dtype=torch.float64))
        names, sums = weighted_logs(step.logged)
        return names, start_step(local, self.sharded, sums, signal=step.context.pending_signal)
