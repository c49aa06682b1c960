"""The training step of a pipelined plan: one call runs the whole step over the stages.

Rank (d, s) holds stage s of pipeline d (:class:`~.runtime.pipelining.runner.PipelineRunner`); the
planned sampler gives every rank of pipeline d the pipeline's samples, cut here into its micro-batches.

    forward   runner.train_step(micro-batches): the schedule's forward and backward passes
              interleaved (1F1B, GPipe), the stage's gradients reduced, tied parameters summed;
              returns L = sum over the global batch of the per-item losses / N on every rank
    backward  the step's one all-reduce over every rank of the world (:mod:`.step_sync`): the loss
              (rank 0 contributes L, the others 0: the sum is L bit for bit), every rank's non-finite
              flag of its pieces' gradient and its stop signal; ``train_loss`` = L is logged alike
              on every rank

    evaluate  a validation or test step: every rank of pipeline d holds the pipeline's samples of the
              evaluation batch, cut into at most M_d micro-batches; runner.evaluate(micro-batches)
              runs the forward passes only and returns the loss over every pipeline's samples /
              their item count, the same on every rank, logged as ``val_loss`` (``test_loss``)
    predict   a predict step: the pipeline's samples in at most M_d micro-batches; runner.predict
              returns the last layer's outputs of those samples (a Hugging Face model's logits, the
              protocol's input of ``cephalo_loss``) on every rank of the pipeline, which is what
              Lightning's predict gets back from this rank; the user's ``predict_step`` is not called

[Note: the step runs in the forward] Lightning calls ``training_step`` then ``backward``; under a
pipeline a stage's backward of one micro-batch comes before its forward of a later one (1F1B), so
both run inside ``training_step`` and ``backward`` only agrees on the report. What Lightning gets
back is L, detached: the gradient it would ask for is already on the pieces. Lightning zeroes the
gradients between the two (its closure: step, ``zero_grad``, backward), so the forward sets the
pieces' gradients aside and the backward puts them back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from cephalo_lightning._common.errors import UnsupportedError
from cephalo_lightning.lightning.steps.log_relay import log_all, log_scalar
from cephalo_lightning.lightning.steps.step_state import MicroBatchStep, StepContext, StepReport
from cephalo_lightning.lightning.steps.step_sync import start_step
from cephalo_lightning.models.protocol import LayeredModel
from cephalo_lightning.planner.schema.plan import split_sizes
from cephalo_lightning.runtime.batching import leading_size, micro_batches
from cephalo_lightning.runtime.pipelining.runner import PipelineRunner, WeightedLoss


@dataclass
class PipelineStep(MicroBatchStep):
    """A pipelined step: this pipeline's micro-batches and, after the forward, the global loss."""

    loss: torch.Tensor | None = None
    grads: list[tuple[torch.nn.Parameter, torch.Tensor | None]] | None = None  # set aside ([Note: the step runs in the forward])


class _World:
    """What the step's all-reduce (:class:`~.step_sync.StepSync`) asks of a sharded model, over every
    rank of the world (the stage's own model spans the stage's ranks only)."""

    replicated_grads = False
    world_group = None  # the default process group: every rank

    def __init__(self, runner: PipelineRunner) -> None:
        self.runner = runner
        self.device = runner.device

    def grads_finite(self) -> bool:
        return self.runner.sharded.grads_finite()


def weighted_loss(model: LayeredModel) -> WeightedLoss:
    """The micro-batch's summed loss over the global item count N, as the runner asks for it: the
    model's own share where its loss takes N itself, else its mean times the micro-batch's items / N."""
    weighting = model.weighting
    if weighting.share is not None:
        return weighting.share
    return lambda out, micro_batch, side, total: model.loss(out, micro_batch, side) * (
        weighting.items(micro_batch, leading_size(micro_batch) or 1) / total)


def item_count(model: LayeredModel) -> Any:
    """A micro-batch's items (tokens or samples) as the model's weighting counts them."""
    return lambda micro_batch: model.weighting.items(micro_batch, leading_size(micro_batch) or 1)


class PipelineSteps:
    """A pipelined plan's steps (see the module docstring): ``runner`` is this rank's stage."""

    def __init__(self, module: pl.LightningModule, runner: PipelineRunner) -> None:
        self.module = module
        self.runner = runner
        self.world = _World(runner)

    def start(self, batch: Any, context: StepContext) -> PipelineStep:
        """The pipeline's samples cut into its micro-batches (every rank of the pipeline alike)."""
        layout, pipeline = self.runner.layout, self.runner.pipeline
        sizes = layout.micro_batch_sizes(pipeline) if layout.batch_sizes[pipeline] else []
        parts = micro_batches(batch, sizes) if sizes else []
        return PipelineStep(context, parts, [1.0] * len(parts))

    def forward(self, step: PipelineStep) -> torch.Tensor:
        """[Note: the step runs in the forward]"""
        for p in self.runner.parameters():  # the last step's, put back after Lightning's zero_grad: not this one's
            p.grad = None
        step.loss = self.runner.train_step(step.micro_batches)
        step.grads = [(p, p.grad) for p in self.runner.parameters()]
        for p, _ in step.grads:
            p.grad = None
        return step.loss.detach().float()

    def backward(self, closure_loss: torch.Tensor, step: PipelineStep) -> StepReport:
        assert step.loss is not None, "PipelineSteps.backward(): call forward(step) first"
        context = step.context
        for p, grad in step.grads or ():
            p.grad = grad
        mine = step.loss if self.runner.rank == 0 else torch.zeros_like(step.loss)
        sync = start_step(mine, self.world, (), signal=context.pending_signal)  # type: ignore[arg-type]
        report, _ = sync.finish(context.sync)
        entries = [("train_loss", report.loss, {"prog_bar": True, "on_step": True, "on_epoch": True})]
        if context.deferred_logs is not None:
            context.deferred_logs.extend(entries)
        else:
            log_all(self.module, entries, context.global_batch)
        return report

    def evaluate(self, batch: Any, hook: str) -> torch.Tensor:
        """A validation or test step (``hook``): the pipeline's samples in at most its micro-batch count,
        forward only; the global loss, the same on every rank, logged as ``val_loss`` or ``test_loss``."""
        runner = self.runner
        samples = leading_size(batch) or 0
        count = min(samples, runner.layout.micro_batches[runner.pipeline])
        # the global batch's samples (each pipeline's counted by its first stage) and the ranks without
        # any, in one all-reduce: every rank refuses alike, before the pipeline's transfers
        counts = torch.tensor([float(samples if runner.stage == 0 else 0), float(count < 1)], dtype=torch.float64,
                              device=runner.device)
        dist.all_reduce(counts)
        if counts[1].item() > 0:
            raise UnsupportedError(f"a pipelined plan's {hook} deals each batch out to its {len(runner.layout.pipelines)} "
                                   "pipelines, and a pipeline got no sample: give the evaluation DataLoader a "
                                   f"batch_size of at least {len(runner.layout.pipelines)} samples per batch")
        with torch.no_grad():
            loss = runner.evaluate(micro_batches(batch, split_sizes(samples, count))).detach().float()
        name = "val_loss" if hook == "validation_step" else "test_loss"
        log_scalar(self.module, name, loss.item(), int(counts[0].item()), hook=hook, prog_bar=True)
        return loss

    def predict(self, batch: Any) -> torch.Tensor:
        """A predict step: this pipeline's samples in at most its micro-batch count, forward only; the last
        layer's outputs of those samples, in their order, on every rank of the pipeline."""
        runner = self.runner
        samples = leading_size(batch) or 0
        count = min(samples, runner.layout.micro_batches[runner.pipeline])
        return runner.predict(micro_batches(batch, split_sizes(samples, count)))
