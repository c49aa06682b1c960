"""Ranks that share a host's cores take turns measuring, one piece at a time, round-robin.

Two CPU ranks measuring at once measure each other (and an emulated slow rank's waits hand its
core to the others, which a fast rank would then "measure" as its own speed). Measuring one rank
after the other fixes that but exposes them to different moments of the host's background load.
So the measuring ranks interleave: the measurement is cut into small steps (a calibration, one
round over the micro-batch sizes, a memory pass) and the ranks run their steps in turn, so slow
drifts of the background load reach every rank alike while no two steps ever overlap.

Protocol: the world advances through slots ``0, 1, 2, ...``; slot ``s`` belongs to
``order[s % len(order)]``. Every rank ends every slot with one small ``all_reduce`` (in lockstep),
the owner after running its step. The reduced value counts the ranks that still have steps; when
it is zero, everyone leaves together. A rank with nothing to measure just calls :meth:`finish`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from cephalo_lightning._common.errors import ConfigurationError

T = TypeVar("T")


class TurnTaker:
    """Runs this rank's measurement steps only in its own slots (see the module docstring)."""

    def __init__(self, rank: int, order: Sequence[int], group: dist.ProcessGroup | None = None) -> None:
        if len(set(order)) != len(order) or not order:
            raise ConfigurationError(f"order must list distinct ranks, got {list(order)}")
        self.rank = rank
        self.order = list(order)
        self.group = group
        self.slot = 0
        self.finished = False
        nccl = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._flag = torch.zeros(1, dtype=torch.int64, device=device)

    def _end_slot(self, busy: bool) -> int:
        self._flag.fill_(1 if busy else 0)
        dist.all_reduce(self._flag, op=dist.ReduceOp.SUM, group=self.group)
        self.slot += 1
        return int(self._flag.item())

    def _owner(self) -> int:
        return self.order[self.slot % len(self.order)]

    def __call__(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in this rank's next slot; the other ranks wait meanwhile."""
        if self.finished:
            raise RuntimeError("TurnTaker.finish() was already called on this rank")
        if self.rank not in self.order:
            raise RuntimeError(f"rank {self.rank} has no slot (order {self.order}); call finish() only")
        while self._owner() != self.rank:
            self._end_slot(busy=True)
        try:
            return fn()
        finally:
            self._end_slot(busy=True)  # even if fn failed, so the others are not left waiting

    def finish(self) -> None:
        """No more steps on this rank: keep ending slots until every rank is done."""
        if self.finished:
            return
        self.finished = True
        while self._end_slot(busy=False) > 0:
            pass
