"""The layered mode's training step: the strategy runs the model's layers itself
(:class:`~.models.protocol.LayeredModel`, :class:`~.runtime.layered.LayeredSchedule`).

The schedule's forward returns a pass whose loss is ``sum_k w_k l_k`` over this rank's micro-batches
(:mod:`.micro_batch_weights`); the step (:class:`~.step_state.LayeredStep`) holds the pass and hands
it to the schedule's backward, which reduce-scatters the gradient of that loss; the step's
all-reduce (:mod:`.step_sync`) makes the global mean loss, logged as ``train_loss``. On the first
step, a model an adapter found is checked against the user's ``training_step`` (the same loss on
a micro-batch, computed by the schedule's forward), and a discovered one's block sequence is
checked (:mod:`.discovered`): where it does not hold, :meth:`LayeredSteps.start` returns a
:class:`FallBack` and the fit's runtime, which owns the step runner, swaps in the uniform mode's.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning.lightning._private import captured_logs
from cephalo_lightning.lightning.steps.discovered import LossPassLogs, discovered_check, user_code
from cephalo_lightning.lightning.steps.log_relay import log_all, relayed
from cephalo_lightning.lightning.steps.micro_batch_weights import micro_batch_weights
from cephalo_lightning.lightning.steps.step_output import loss_or_refusal
from cephalo_lightning.lightning.steps.step_state import LayeredStep, StepContext, StepReport
from cephalo_lightning.lightning.steps.step_sync import start_step
from cephalo_lightning.models.protocol import LayeredModel, check_first_inputs
from cephalo_lightning.runtime.batching import micro_batches
from cephalo_lightning.runtime.distributed import gather_objects
from cephalo_lightning.runtime.layered import LayeredSchedule


@dataclass(frozen=True)
class FallBack:
    """What :meth:`LayeredSteps.start` returns where the first step found that a discovered block
    sequence does not hold (``why``): its runner's owner runs the uniform mode from then on, or
    refuses where the plan needs the layered one (:meth:`~.fit.FitRuntime.forward`)."""

    why: str


class LayeredSteps:
    """Layer-major: the strategy runs the model's layers itself (:class:`~.models.protocol.LayeredModel`).

    The user's ``training_step`` is not called; the step's global mean loss is logged as
    ``train_loss``. A rank whose plan says ``recompute=False`` (one micro-batch, memory to spare)
    keeps the forward's graph instead of recomputing each layer in the backward pass.
    ``verify_loss``: on the first step, a model found by an adapter checks that the user's
    ``training_step`` computes the same loss as the model's own on a micro-batch, and refuses to
    train a different objective silently.
    """

    def __init__(self, module: pl.LightningModule, schedule: LayeredSchedule, model: LayeredModel,
                 verify_loss: bool = True, tolerance: float = 1e-3, logs: LossPassLogs | None = None) -> None:
        self.module = module
        self.schedule = schedule
        self.model = model
        self.weighting = model.weighting  # the fit's decision (loss_weighting=, see .fit)
        self.verify_loss = verify_loss and model.derived  # cleared once checked (the first step of the fit)
        self.check_discovered = model.discovery is not None  # always checked: the structure is only guessed
        self.tolerance = tolerance
        self.logs = logs  # a discovered model: what its training_step logs, relayed once per step

    def start(self, batch: Any, context: StepContext) -> LayeredStep | FallBack:
        """Collective: the step cut into micro-batches, each with its weight; on the first step, the
        checks (a discovered structure that does not hold: a :class:`FallBack`, on every rank alike)."""
        sizes = context.rank_plan.micro_batch_sizes
        parts = micro_batches(batch, sizes) if sizes else []
        if self.check_discovered:
            self.check_discovered = self.verify_loss = False
            why = discovered_check(self, parts[0] if parts else batch, bool(parts), context.batch_idx)
            if why:
                return FallBack(why)
        if self.verify_loss:
            self.verify_loss = False
            self._verify(parts[0] if parts else batch, has_samples=bool(parts), batch_idx=context.batch_idx)
        shares, items = micro_batch_weights(parts, self.weighting, context.global_batch, self.schedule.device,
                                            self.schedule.sharded.world_group, context.global_items)
        return LayeredStep(context, parts, shares, items)

    def forward(self, step: LayeredStep) -> torch.Tensor:
        context, parts = step.context, step.micro_batches
        share = self.weighting.share
        if share is not None:  # the model's loss divides by the global items itself: weight 1
            weights = [(1.0 if w else 0.0) / context.accumulate for w in step.weights]
            loss = lambda k, out, side: share(out, parts[k], side, step.items)  # noqa: E731
        else:
            weights = [w / context.accumulate for w in step.weights]
            loss = lambda k, out, side: self.model.loss(out, parts[k], side)  # noqa: E731
        recompute = context.rank_plan.recompute or len(parts) > 1
        with self._model_code(), self.logs.recorded() if self.logs is not None else contextlib.nullcontext():
            step.forward_pass = self.schedule.forward(parts, self._prepare, loss, weights, recompute=recompute)
        return step.forward_pass.loss.detach() * context.accumulate  # Lightning divides what we return by `accumulate`

    def _prepare(self, micro_batch: Any) -> tuple[torch.Tensor, Any]:
        x, side = self.model.prepare(micro_batch)
        check_first_inputs([x])
        return x, side

    def _model_code(self) -> contextlib.AbstractContextManager[Any]:
        """A discovered model's layers run the user's training_step: its self.log calls are dropped
        (the step logs its global loss itself)."""
        return user_code(self.module) if self.model.discovery is not None else contextlib.nullcontext()

    def backward(self, closure_loss: torch.Tensor, step: LayeredStep) -> StepReport:
        context, sharded = step.context, self.schedule.sharded
        forward_pass = step.forward_pass
        if forward_pass is None:
            raise RuntimeError("LayeredSteps.backward(): the step has no forward pass; call forward(step) first")
        names, sums = self.logs.sums(step.weights, sharded.world_group) if self.logs is not None else ([], [])
        sync = start_step(forward_pass.loss * context.accumulate, sharded, sums, signal=context.pending_signal)
        with self._model_code():
            self.schedule.backward(forward_pass, context.loss_scale)
        report, values = sync.finish(context.sync)
        entries = relayed(names, values)
        if "train_loss" not in {spec.name for spec in names}:  # the user's own train_loss is relayed instead
            entries.insert(0, ("train_loss", report.loss, {"prog_bar": True, "on_step": True, "on_epoch": True}))
        if context.deferred_logs is not None:  # logged when the step commits (fault tolerance)
            context.deferred_logs.extend(entries)
        else:
            log_all(self.module, entries, context.global_batch)
        return report

    @torch.no_grad()
    def _verify(self, micro_batch: Any, has_samples: bool, batch_idx: int) -> None:
        """Collective: the user's ``training_step`` and the model's own loss, computed by the
        schedule's forward, agree on a micro-batch."""
        sharded = self.schedule.sharded
        with captured_logs(self.module.trainer):  # the check's own self.log calls are dropped
            sharded.gather_root()
            try:
                output = self.module.training_step(micro_batch, batch_idx)
            finally:
                sharded.free_all()
        user, refusal = loss_or_refusal(output)  # every rank learns a refusal at the gather below
        parts = [micro_batch] if has_samples else []  # a rank without samples gathers every layer all the same
        value = self.schedule.evaluate(parts, self._prepare, lambda k, out, side: self.model.loss(out, micro_batch, side),
                                       [1.0] * len(parts))
        derived = float(value) if parts else math.nan
        mismatch = has_samples and not refusal and not math.isclose(user, derived, rel_tol=self.tolerance,
                                                                      abs_tol=self.tolerance)
        flag = [1.0 if mismatch else 0.0, user, derived, refusal]
        flags = gather_objects(flag, sharded.world_group)
        refused = next(((r, f[3]) for r, f in enumerate(flags) if f[3]), None)
        if refused is not None:
            raise ConfigurationError(f"{refused[1]} (rank {refused[0]})")
        bad = [(r, f) for r, f in enumerate(flags) if f[0] > 0]
        if bad:
            rank, (_, got, want, _) = bad[0]
            raise ConfigurationError(
                f"Cephalo runs {self.model.name} layer by layer and computes the model's own loss, but on rank {rank} "
                f"your training_step returned {got:.6g} where the model's own loss is {want:.6g} on the same micro-batch. "
                "Your training_step computes a different objective, which the layered mode would silently replace. Use "
                "CephaloStrategy(mode='uniform') to train with your training_step, or implement the layered protocol "
                "(cephalo_layers, cephalo_input, cephalo_loss) for your loss; CephaloStrategy(verify_loss=False) "
                "skips this check"
            )
