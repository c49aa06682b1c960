"""Every rank the same number of steps, each rank its own number of samples per step.

One seeded global order per data epoch; each global batch of B samples is cut into the ranks'
consecutive slices of the plan's sizes b_0, b_1, ... (sum B). So the union of the ranks' batches at
step s is exactly the global batch a single process would see at step s, and no rank ever runs
out of batches before another (which would hang the collectives). The sizes come from the
:class:`~.plan_state.PlanState` version in force at each step, which also records every cut.

[Note: the sampler's position is the truth] The data epoch and the steps consumed in it are the
sampler's own (saved in checkpoints), not Lightning's epoch counter: a run that stopped at
``max_steps`` mid-epoch and is resumed is counted by Lightning as a new epoch starting at that
batch index, but its data continues exactly where it stopped (Lightning's epoch numbers then run
one ahead of the data epochs; the samples trained on are the uninterrupted run's).
"""

from __future__ import annotations

import copy
import math
import warnings
import zlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from cephalo_lightning._common.errors import ConfigurationError, UnsupportedError
from cephalo_lightning.runtime.plan_state import PlanState


class PlannedBatchSampler(Sampler[list[int]]):
    """Yields this rank's slice of every global batch; resumable mid-epoch."""

    def __init__(self, num_samples: int, plan_state: PlanState, rank: int, *, shuffle: bool = True, seed: int = 0,
                 whole: bool = False) -> None:
        plan = plan_state.latest.plan
        self.num_samples = num_samples
        self.plan_state = plan_state
        self.global_batch_size = plan.global_batch_size
        if not 0 <= rank < plan.world_size:
            raise ConfigurationError(f"rank {rank} outside a plan of {plan.world_size} ranks")
        if num_samples < self.global_batch_size:
            raise ConfigurationError(
                f"the dataset has {num_samples} samples, fewer than one global batch of {self.global_batch_size}: "
                "lower the global batch size or use more data"
            )
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.whole = whole  # every rank the whole global batch (fault tolerance: cut after the step's quorum)
        self.epoch = 0  # the data epoch
        self.consumed = 0  # steps of the data epoch the training loop has taken
        self._resume_at: int | None = None  # where the next iteration starts (a resumed position)
        self._epoch_offset = 0  # Lightning's epoch minus the data epoch (see the module note)
        self._orders: tuple[int, int, torch.Tensor] | None = None  # (seed, data epoch, order): the last one drawn
        self.sampler = self  # Lightning calls set_epoch on ``batch_sampler.sampler``

    def set_epoch(self, epoch: int) -> None:
        """Lightning starts its epoch ``epoch``: a resumed position inside a data epoch is kept."""
        if self._resume_at is not None:  # a restored position: Lightning's epoch maps onto it
            self._epoch_offset = epoch - self.epoch
            return
        data_epoch = epoch - self._epoch_offset
        if data_epoch != self.epoch:
            self.epoch = data_epoch
            self.consumed = 0

    def __len__(self) -> int:
        return self.num_samples // self.global_batch_size

    @property
    def dropped_per_epoch(self) -> int:
        return self.num_samples - len(self) * self.global_batch_size

    def order(self, epoch: int | None = None) -> torch.Tensor:
        """The sample indices of data epoch ``epoch`` (default: the current one) in training order."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return torch.arange(self.num_samples)
        if self._orders is not None and self._orders[:2] == (self.seed, epoch):
            return self._orders[2]
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(self.num_samples, generator=generator)
        self._orders = (self.seed, epoch, order)
        return order

    def fingerprint(self, step: int) -> int:
        """A fingerprint of global batch ``step`` of the whole order (counted from data epoch 0): the
        CRC-32 of its sample indices, ``0 <= f < 2**32``. Two ranks drawing other samples for the
        step (another seed, data size or global batch) differ but for a 2**-32 chance."""
        epoch, at = divmod(step, len(self))
        indices = self.order(epoch)[at * self.global_batch_size:(at + 1) * self.global_batch_size]
        return zlib.crc32(indices.to(torch.int64).numpy().tobytes())

    def global_batch(self, step: int) -> list[int]:
        """Every rank's samples of step ``step`` of this epoch (the single-process batch)."""
        order = self.order()
        return order[step * self.global_batch_size : (step + 1) * self.global_batch_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        start = self._resume_at if self._resume_at is not None else self.consumed
        self._resume_at = None
        self.plan_state.restart_cutting()
        for step in range(start, len(self)):
            offset, size = self.plan_state.cut(self.epoch, step).plan.samples_of(self.rank)
            if self.whole:
                size, offset = self.global_batch_size, 0
            first = step * self.global_batch_size
            if size:
                yield order[first + offset : first + offset + size].tolist()
            else:  # a rank with no samples still takes every step: one placeholder, never computed on
                yield [int(order[first])]

    def seek(self, step: int) -> None:
        """Start the next iteration at global batch ``step`` of the whole order (counted from data
        epoch 0): data epoch ``step // n``, step ``step mod n`` of it (``n`` global batches per epoch),
        Lightning's epoch counted from there."""
        if step < 0:
            raise ValueError(f"seek({step}): a step of the data order is >= 0")
        self.epoch, self.consumed = divmod(step, len(self))
        self._epoch_offset = 0
        self._resume_at = self.consumed

    def mark_consumed(self, step: int) -> None:
        """The training loop took step ``step`` of the current data epoch."""
        self.consumed = step + 1

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "global_batch_size": self.global_batch_size,
                "seed": self.seed, "epoch_offset": self._epoch_offset, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("global_batch_size") != self.global_batch_size:
            raise ConfigurationError(
                f"the checkpoint was written with a global batch of {state.get('global_batch_size')}, this run uses "
                f"{self.global_batch_size}: resume with the same global batch size (steps would mean something else)"
            )
        saved_samples = state.get("num_samples", self.num_samples)
        if saved_samples != self.num_samples:
            raise ConfigurationError(
                f"the checkpoint was written for a training set of {saved_samples} samples, this run has "
                f"{self.num_samples}: the resumed position (epoch {state['epoch']}, step {state['consumed']}) "
                "would point at other samples. Resume with the same training data"
            )
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self.seed = state.get("seed", self.seed)
        self._epoch_offset = int(state.get("epoch_offset", 0))
        if self.consumed >= len(self):  # saved at the end of a data epoch: resume at the next one
            self.epoch, self.consumed = self.epoch + 1, 0
        self._resume_at = self.consumed


class PlannedDataLoader(DataLoader):
    """A DataLoader whose position survives a checkpoint (Lightning's ``state_dict`` protocol)."""

    batch_sampler: PlannedBatchSampler

    def state_dict(self) -> dict[str, Any]:
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state)


def loading_settings(dataloader: DataLoader) -> dict[str, Any]:
    """How a user's DataLoader loads (workers, collation, pinning, ...), kept when it is re-cut."""
    settings = {"num_workers": dataloader.num_workers, "collate_fn": dataloader.collate_fn,
                "pin_memory": dataloader.pin_memory, "worker_init_fn": dataloader.worker_init_fn,
                "persistent_workers": dataloader.persistent_workers, "timeout": dataloader.timeout,
                "multiprocessing_context": dataloader.multiprocessing_context}
    if dataloader.num_workers > 0:
        settings["prefetch_factor"] = dataloader.prefetch_factor
    return settings


_SAMPLING_FIX = (
    "CephaloStrategy draws every global batch itself (the dataset's indices in order, or a seeded permutation "
    "of them, cut into the plan's per-rank slices), so it supports the default sampling only: "
    "DataLoader(shuffle=False / True) (SequentialSampler, RandomSampler without replacement) and Lightning's "
    "DistributedSampler over them. To weight or balance samples, put that in the dataset (e.g. a "
    "torch.utils.data.Subset whose index list repeats the rarer samples, drawn once from your sampler) or in "
    "the loss (per-sample weights); to batch by length, pad or bucket inside the dataset"
)


def _user_sampler(sampler: Sampler) -> Sampler | None:
    """The sampler the user gave, or None if it is a default (``sampler``: the loader's, seen through a
    launcher's distributed wrapper by the caller, who knows the launcher)."""
    if type(sampler) is RandomSampler and (sampler.replacement or sampler._num_samples is not None):
        return sampler
    if type(sampler) in (SequentialSampler, RandomSampler, DistributedSampler):
        return None
    return sampler


def check_sampling(dataloader: DataLoader, sampler: Sampler | None = None) -> None:
    """Refuse a training DataLoader whose sampler or batch sampler the planned loader would replace:
    training on samples the user's sampler would never draw is a silent change of the data.
    ``sampler``: the loader's sampler as the user gave it (default: ``dataloader.sampler``)."""
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        raise UnsupportedError(
            f"the training DataLoader has a custom batch_sampler ({type(batch_sampler).__qualname__}), which "
            f"CephaloStrategy would replace, training on batches it never forms. {_SAMPLING_FIX}; then give the "
            "DataLoader a batch_size instead of the batch_sampler")
    sampler = _user_sampler(dataloader.sampler if sampler is None else sampler)
    if sampler is not None:
        detail = " with replacement or num_samples" if type(sampler) is RandomSampler else ""
        raise UnsupportedError(
            f"the training DataLoader's sampler is a {type(sampler).__qualname__}{detail}, which CephaloStrategy "
            f"would replace, training on samples it would never draw. {_SAMPLING_FIX}; then drop the sampler "
            "argument")


def planned_loader(dataloader: DataLoader, plan_state: PlanState, rank: int, *, shuffle: bool, seed: int,
                   whole: bool = False, sampler: Sampler | None = None) -> PlannedDataLoader:
    """``dataloader`` re-cut so this rank takes its slice of every global batch of ``plan_state``
    (``whole``: the whole global batch, which the strategy cuts once the step's quorum is known;
    ``sampler``: the loader's sampler as the user gave it, which a launcher may have wrapped)."""
    dataset = dataloader.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise UnsupportedError(
            f"CephaloStrategy cuts every global batch into per-rank slices by sample index, but the training "
            f"dataset is a {type(dataset).__name__} without indices (an IterableDataset or no __len__). Use a "
            "map-style Dataset (with __len__ and __getitem__), e.g. by materialising or indexing the stream"
        )
    check_sampling(dataloader, sampler)
    sampler = PlannedBatchSampler(len(dataset), plan_state, rank, shuffle=shuffle, seed=seed, whole=whole)
    if sampler.dropped_per_epoch and rank == 0:
        which = "different samples each epoch (reshuffled)" if shuffle else "the SAME last samples every epoch (no shuffling)"
        warnings.warn(
            f"Cephalo: the training set has {sampler.num_samples} samples, {sampler.dropped_per_epoch} more than "
            f"{len(sampler)} global batches of {sampler.global_batch_size}: every rank must take the same number of "
            f"steps, so the partial last batch is dropped, {which}. Choose a global batch that divides the data "
            "to use every sample",
            stacklevel=2,
        )
    return PlannedDataLoader(dataset, batch_sampler=sampler, **loading_settings(dataloader))


def shuffles(dataloader: DataLoader) -> bool:
    """Whether the training loader as Lightning prepared it draws samples in a random order."""
    sampler = dataloader.sampler
    return isinstance(sampler, RandomSampler) or (isinstance(sampler, DistributedSampler) and sampler.shuffle)


def evaluation_loader(dataloader: DataLoader, world_size: int) -> DataLoader:
    """Lightning's even sharding, ``batch_size / world_size`` samples per rank and step.

    The DataLoader's ``batch_size`` is a global batch here too, so an evaluation step covers the
    same samples whatever the plan (``limit_val_batches`` means the same under any plan); a device
    too small for that many samples in a forward needs a smaller evaluation ``batch_size``.
    """
    if dataloader.batch_size is None:
        return dataloader  # a custom batch sampler: the user decides
    size = -(-dataloader.batch_size // world_size)
    if size >= dataloader.batch_size:
        return dataloader
    return DataLoader(dataloader.dataset, batch_size=size, sampler=dataloader.sampler, drop_last=dataloader.drop_last,
                      **loading_settings(dataloader))


def _check_predict_batches(samples: int, batch_size: int, pipelines: int) -> None:
    """Every predict batch deals at least one sample to each pipeline (a pipeline's ranks share its steps)."""
    short = (samples % batch_size or batch_size) if samples else pipelines  # the last batch: the smallest
    if short < pipelines:
        raise UnsupportedError(
            f"a pipelined plan deals each predict batch out to its {pipelines} pipelines, and a batch of {short} "
            f"sample(s) ({samples} samples in batches of {batch_size}) leaves a pipeline without one: give the predict "
            f"DataLoader a batch_size of at least {pipelines} and a last batch of at least {pipelines} samples (e.g. "
            "drop the remainder from the dataset), or predict under a plan without pipelines")


class _PipelineSlices(Sampler[list[int]]):
    """Pipeline ``pipeline``'s slice of every evaluation batch of ``batch_size`` samples of ``order``
    (one order on every rank): the batch cut into ``pipelines`` consecutive slices as even as can be."""

    def __init__(self, order: Sampler, batch_size: int, pipelines: int, pipeline: int) -> None:
        self.order, self.batch_size, self.pipelines, self.pipeline = order, batch_size, pipelines, pipeline

    def __len__(self) -> int:
        return -(-len(self.order) // self.batch_size)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[int]]:
        indices = list(self.order)
        for start in range(0, len(indices), self.batch_size):
            batch = indices[start:start + self.batch_size]
            sizes = [len(batch) // self.pipelines + (d < len(batch) % self.pipelines) for d in range(self.pipelines)]
            first = sum(sizes[:self.pipeline])
            yield batch[first:first + sizes[self.pipeline]]


def pipelined_evaluation_loader(dataloader: DataLoader, pipelines: int, pipeline: int, *,
                                predicting: bool = False) -> DataLoader:
    """Under a pipelined plan every rank of pipeline ``pipeline`` takes the pipeline's samples of each
    evaluation batch (one collated batch, which its stages cut into micro-batches): a distributed
    sampler dealt out to the ``pipelines`` pipelines instead of the ranks, with ``batch_size / pipelines``
    samples per step; a sampler of one order on every rank cut per batch into the pipelines' slices.
    ``predicting``: every sample once, as the DataLoader's ``batch_size`` batches of one order (a
    distributed sampler's whole order: Lightning's predict sampler) cut into the pipelines' slices, so
    every pipeline takes as many steps, each with at least one sample (else refused, naming the fix)."""
    batch_size, sampler, drop_last = dataloader.batch_size, dataloader.sampler, dataloader.drop_last
    if predicting and batch_size is None:  # Lightning's predict loader batches by a sampler that records the indices
        inner = dataloader.batch_sampler
        batch_size = getattr(inner, "batch_size", None)
        sampler, drop_last = getattr(inner, "sampler", sampler), getattr(inner, "drop_last", drop_last)
    if batch_size is None:
        raise UnsupportedError("a pipelined plan deals each evaluation batch out to its pipelines, which a DataLoader "
                               "with a custom batch_sampler does not let it do: give the DataLoader a batch_size")
    if predicting:
        if isinstance(sampler, DistributedSampler):  # one order on every rank: the whole of it
            sampler = copy.copy(sampler)
            sampler.num_replicas, sampler.rank = 1, 0
            sampler.num_samples = sampler.total_size = len(sampler.dataset)  # type: ignore[arg-type]
        _check_predict_batches(len(sampler), batch_size, pipelines)  # type: ignore[arg-type]
    elif isinstance(sampler, DistributedSampler):
        dealt = copy.copy(sampler)
        dealt.num_replicas, dealt.rank = pipelines, pipeline
        if sampler.drop_last and len(sampler.dataset) % pipelines:  # type: ignore[arg-type]
            dealt.num_samples = math.ceil((len(sampler.dataset) - pipelines) / pipelines)  # type: ignore[arg-type]
        else:
            dealt.num_samples = math.ceil(len(sampler.dataset) / pipelines)  # type: ignore[arg-type]
        dealt.total_size = dealt.num_samples * pipelines
        return DataLoader(dataloader.dataset, batch_size=-(-batch_size // pipelines), sampler=dealt,
                          drop_last=drop_last, **loading_settings(dataloader))
    if drop_last:
        raise UnsupportedError("a pipelined plan cuts each evaluation batch into its pipelines' slices, and does not "
                               "drop a partial last batch: give the evaluation DataLoader drop_last=False")
    if isinstance(sampler, RandomSampler):
        raise UnsupportedError("a pipelined plan cuts each evaluation batch into its pipelines' slices of one order on "
                               "every rank, which a RandomSampler draws apart on each: give the evaluation DataLoader "
                               "shuffle=False")
    slices = _PipelineSlices(sampler, batch_size, pipelines, pipeline)
    return DataLoader(dataloader.dataset, batch_sampler=slices, **loading_settings(dataloader))
