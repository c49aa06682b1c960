"""Every rank the same number of steps, each rank its own number of samples per step.

One seeded global order per epoch; each global batch of B samples is cut into the ranks'
consecutive slices of the plan's sizes b_0, b_1, ... (sum B). So the union of the ranks' batches at
step s is exactly the global batch a single process would see at step s, and no rank ever runs
out of batches before another (which would hang the collectives).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler


class PlannedBatchSampler(Sampler[list[int]]):
    """Yields this rank's slice of every global batch; resumable mid-epoch."""

    def __init__(self, num_samples: int, batch_sizes: Sequence[int], rank: int, *, shuffle: bool = True, seed: int = 0) -> None:
        self.num_samples = num_samples
        self.batch_sizes = list(batch_sizes)
        self.global_batch_size = sum(self.batch_sizes)
        if not 0 <= rank < len(self.batch_sizes):
            raise ValueError(f"rank {rank} outside a plan of {len(self.batch_sizes)} ranks")
        if num_samples < self.global_batch_size:
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than one global batch of {self.global_batch_size}: "
                "lower the global batch size or use more data"
            )
        self.rank = rank
        self._switches: list[tuple[int, int, list[int]]] = []  # (epoch, step, new batch sizes)
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = sum(self.batch_sizes[:rank])
        self.consumed = 0  # steps of the current epoch the training loop has finished
        self._resume_at = 0
        self.sampler = self  # Lightning calls set_epoch on ``batch_sampler.sampler``

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.consumed = 0
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples // self.global_batch_size

    def order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def global_batch(self, step: int) -> list[int]:
        """Every rank's samples of step ``step`` of this epoch (the single-process batch)."""
        order = self.order()
        return order[step * self.global_batch_size : (step + 1) * self.global_batch_size].tolist()

    def switch_sizes(self, batch_sizes: Sequence[int], epoch: int, step: int) -> None:
        """From (epoch, step) on, cut global batches by ``batch_sizes`` (a new plan, same B)."""
        if sum(batch_sizes) != self.global_batch_size or len(batch_sizes) != len(self.batch_sizes):
            raise ValueError("a new plan must keep the world size and the global batch size")
        self._switches.append((epoch, step, list(batch_sizes)))

    def _apply_switches(self, step: int) -> None:
        while self._switches and (self._switches[0][0], self._switches[0][1]) <= (self.epoch, step):
            self.batch_sizes = self._switches.pop(0)[2]
            self.offset = sum(self.batch_sizes[: self.rank])

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        start, self._resume_at = self._resume_at, 0
        for step in range(start, len(self)):
            self._apply_switches(step)
            size = self.batch_sizes[self.rank]
            first = step * self.global_batch_size
            if size:
                yield order[first + self.offset : first + self.offset + size].tolist()
            else:  # a rank with no samples still takes every step: one placeholder, never computed on
                yield [int(order[first])]

    def mark_consumed(self) -> None:
        self.consumed += 1

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "global_batch_size": self.global_batch_size, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("global_batch_size") != self.global_batch_size:
            raise ValueError(
                f"the checkpoint was written with a global batch of {state.get('global_batch_size')}, this run uses "
                f"{self.global_batch_size}: resume with the same global batch size (steps would mean something else)"
            )
        self.epoch = state["epoch"]
        self.seed = state.get("seed", self.seed)
        self.consumed = self._resume_at = state["consumed"]


class PlannedDataLoader(DataLoader):
    """A DataLoader whose position survives a checkpoint (the ``state_dict`` protocol)."""

    batch_sampler: PlannedBatchSampler

    def state_dict(self) -> dict[str, Any]:
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state)
