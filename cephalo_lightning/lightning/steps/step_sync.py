"""The step's one all-reduce: ``[sum_i l_i, sum_i e_i, flags]`` over the ranks, where ``l_i`` is
rank i's weighted loss, ``e_i`` the weighted values it logged, and ``flags`` three per rank (its
loss not finite, its gradient shard not finite, the stop signal it received).

[Note: one all-reduce per step] Every rank contributes, in ONE all-reduce, its weighted loss, the
weighted values the user logged, and a flag per rank that says whether its loss or its gradient
shard was not finite, and the stop signal (if any) each rank received. So every rank knows the step's
global loss (logged once, exact), whether any rank went non-finite (:class:`~.nonfinite.NonFiniteGuard`) and
whether any rank was told to stop (:mod:`.preemption`). It is made after the backward; under groups
of one rank it is started before it, the gradient flags coming from each rank's own check of the
replicated gradient (:class:`StepSync`), so data parallelism issues no collective the backward does
not hide.
"""

from __future__ import annotations

from collections.abc import Sequence
from signal import Signals
from typing import Any

import torch

from cephalo_lightning.lightning.steps.step_state import StepReport, StopSignalProbe, no_stop_signal
from cephalo_lightning.runtime.distributed import rank_and_size, start_all_reduce_
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel


class StepSync:
    """The step's one all-reduce (see the module note): made by :func:`start_step`, read by :meth:`finish`.

    Two flags per rank: its loss, and its gradient shard. A non-finite loss on one rank makes every
    rank's shard non-finite through the reduce-scatter, so the report names the ranks whose loss
    went non-finite (the origin), or, if none did, those whose gradients did.

    Under groups of one rank (:attr:`ShardedModel.replicated_grads`) every rank ends the backward
    holding the same reduced gradient, bit for bit, so its own check of the whole gradient is every
    rank's answer (all ranks' gradients are non-finite or none are) and the vector need not wait for
    it: :func:`start_step` sends the rest at once, before the backward, whose compute hides the
    all-reduce (as DDP hides its buckets'), and :meth:`finish` checks the gradient while it lands.
    Otherwise each rank's flag is known only after the backward, and the all-reduce is made then.
    """

    def __init__(self, local_loss: torch.Tensor, sharded: ShardedModel, extra: Sequence[torch.Tensor],
                 signal: StopSignalProbe) -> None:
        self.sharded = sharded
        self.group = sharded.world_group
        self.rank, self.world = rank_and_size(self.group)
        self.local_loss = local_loss
        self.extra = tuple(extra)
        self.signal = signal
        self.replicated = sharded.replicated_grads
        self.vector: torch.Tensor | None = None
        self.sizes: list[int] = []
        self.work: Any = None
        if self.replicated:
            self._send(gradient_flag=None)

    def _send(self, gradient_flag: float | None) -> None:
        """Build this rank's vector and start its all-reduce (the signal is read now)."""
        world, rank, device = self.world, self.rank, self.sharded.device
        loss = self.local_loss.detach().double().reshape(1).to(device)
        flags = torch.zeros(3 * world, dtype=torch.float64, device=device)
        received = self.signal()
        flags[2 * world + rank] = float(received) if received is not None else 0.0  # the signal number, 0: none
        flags[rank] = (~torch.isfinite(loss).all()).to(flags.dtype)  # on the device: no host sync before a backward
        if gradient_flag is not None:
            flags[world + rank] = gradient_flag
        values = [loss.nan_to_num(0.0, 0.0, 0.0)] + [e.detach().double().reshape(-1).to(device) for e in self.extra]
        values.append(flags)
        self.sizes = [v.numel() for v in values]
        self.vector = torch.cat(values)
        self.work = start_all_reduce_(self.vector, group=self.group)

    def finish(self, check_grads: bool) -> tuple[StepReport, list[torch.Tensor]]:
        """After the backward: the report every rank agrees on, and the ``extra`` sums
        (``check_grads``: the gradients were reduced, an optimizer step follows)."""
        replicated_bad = False
        if self.vector is None:
            self._send(gradient_flag=(0.0 if self.sharded.grads_finite() else 1.0) if check_grads else None)
        elif check_grads:  # replicated gradients: this rank's check holds for every rank
            replicated_bad = not self.sharded.grads_finite()
        if self.work is not None:
            self.work.wait()
            self.work = None
        assert self.vector is not None
        world = self.world
        parts = list(self.vector.split(self.sizes))
        flags_back = parts[-1].tolist()
        losses = tuple(i for i in range(world) if flags_back[i] > 0)
        grads = tuple(range(world)) if replicated_bad else tuple(i for i in range(world) if flags_back[world + i] > 0)
        signals = tuple((i, int(flags_back[2 * world + i])) for i in range(world) if flags_back[2 * world + i] > 0)
        report = StepReport(float(parts[0]), losses or grads, "loss" if losses else "gradient", signals, check_grads)
        return report, parts[1:-1]


def start_step(local_loss: torch.Tensor, sharded: ShardedModel, extra: Sequence[torch.Tensor] = (),
               signal: StopSignalProbe = no_stop_signal) -> StepSync:
    """The step's all-reduce of the global loss, the ``extra`` weighted sums, the non-finite flags
    and each rank's stop signal (``signal()``: see :mod:`.preemption`); call it once the loss and the
    logged values are known (before the backward where they are), then :meth:`StepSync.finish`."""
    return StepSync(local_loss, sharded, extra, signal)


def finish_step(local_loss: torch.Tensor, sharded: ShardedModel, check_grads: bool,
                extra: Sequence[torch.Tensor] = (),
                signal: Signals | None = None) -> tuple[StepReport, list[torch.Tensor]]:
    """:func:`start_step` and :meth:`StepSync.finish` at once, after the backward."""
    return start_step(local_loss, sharded, extra, lambda: signal).finish(check_grads)
