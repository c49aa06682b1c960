"""One training step's state, per mode, from its ``training_step`` to the end of its backward, and
the report every rank agrees on after it.

A step is ``context`` (what is known as it starts: the rank's plan, the global batch, Lightning's
accumulation, the loss scale, the stop signal to report) plus what its forward leaves for its
backward: the rank's micro-batches and their weights ``w_k`` (micro-batch k's share of the global
mean loss, :mod:`.micro_batch_weights`), and per mode the rest. One object holds it for the
step's duration (:class:`~.fit.FitRuntime`); the runners keep nothing of a step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from signal import Signals
from typing import Any

import torch

from cephalo_lightning.lightning._private import LoggedValue
from cephalo_lightning.planner import RankPlan
from cephalo_lightning.runtime.layered import LayeredPass

StopSignalProbe = Callable[[], Signals | None]  # the stop signal this rank received (None: none yet)


def no_stop_signal() -> Signals | None:
    """The probe of a fit that handles no stop signal (no preemption handling): none ever arrives."""
    return None


@dataclass(frozen=True)
class StepContext:
    """What one training step (one batch) is given as it starts."""

    rank_plan: RankPlan
    global_batch: int
    accumulate: int  # Trainer(accumulate_grad_batches=...)
    sync: bool  # reduce gradients at the end of this batch (False while Lightning accumulates)
    loss_scale: float | torch.Tensor = 1.0  # a gradient scaler's scale (16-mixed), kept on the device
    args: tuple = ()  # training_step's arguments after the batch (batch_idx, ...)
    pending_signal: StopSignalProbe = no_stop_signal  # read at the step's all-reduce (:mod:`.step_sync`)
    global_items: float | None = None  # the global batch's items where this rank holds all of it (fault tolerance)
    # fault tolerance: the step's logs (name, value, options) go here, logged once the replica groups commit
    deferred_logs: list[tuple[str, Any, dict[str, Any]]] | None = None

    @property
    def batch_idx(self) -> int:
        return self.args[0] if self.args else 0


@dataclass
class MicroBatchStep:
    """A step cut into this rank's micro-batches, each with its share of the global mean loss."""

    context: StepContext
    micro_batches: list[Any]
    weights: list[float]


@dataclass
class LayeredStep(MicroBatchStep):
    """The layered mode's step: the global batch's items (for a loss that divides by them itself)
    and, after the forward, the schedule's pass (this rank's weighted loss and what its backward uses)."""

    items: float
    forward_pass: LayeredPass | None = None


@dataclass
class UniformStep(MicroBatchStep):
    """The uniform mode's step: each micro-batch's loss and logged values, as the user's
    ``training_step`` returns and logs them."""

    losses: list[torch.Tensor] = field(default_factory=list)  # detached
    logged: list[tuple[float, list[LoggedValue]]] = field(default_factory=list)  # (weight, its logs)
    capturing: bool = False  # inside the user's training_step: the strategy's reduce() leaves logs alone


@dataclass(frozen=True)
class StepReport:
    """What every rank agrees on after a step's all-reduce."""

    loss: float  # the global batch's mean loss (weighted as the gradient is)
    nonfinite: tuple[int, ...]  # ranks whose loss (or, if none, gradient shard) was not finite
    what: str = "loss"  # which of the two
    signals: tuple[tuple[int, int], ...] = ()  # (rank, signal number) of the ranks a stop signal reached
    synced: bool = True  # the batch's gradients were reduced (and checked): an optimizer step follows
