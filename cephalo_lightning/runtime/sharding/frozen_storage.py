"""How a unit's frozen parameters are held: stored, sharded and gathered in the compute dtype.

A unit is two parts (:meth:`~.layout.UnitLayout.part`): its trainable parameters, packed, whose
shard is the fp32 master the optimizer steps (gradients and optimizer state follow it), and its
frozen parameters, packed, held by a :class:`FrozenStorage`. Per rank and unit::

    stored bytes  = trainable_local x master_size  +  storage.local_bytes()
    gathered      = [trainable part in the compute dtype | frozen part in the compute dtype]
    all-gathered  = trainable_part.numel x compute_size + storage.gathered_bytes()  (bytes a step moves per gather)
    reduced       = trainable_part.numel x reduce_size                        (frozen elements: none)

A storage kind (:class:`~cephalo_lightning._common.vocabulary.BaseStorage`) is a subclass of
:class:`FrozenStorage` registered in :data:`KINDS`; :func:`make_storage` builds one from this rank's
frozen values, and the unit calls only the methods below. :class:`ComputeDtypeStorage` holds the
values themselves in the compute dtype; a quantised kind keeps bytes and scales, gathers those and
dequantises into the unit's gathered buffer per unit.

[Note: a frozen part holds no gradient] Frozen elements are never in a unit's reduced gradient:
the reduce-scatter and the data-parallel buckets take the trainable part only, so a frozen
parameter costs neither gradient memory nor reduction bytes, in either mode.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import torch

from cephalo_lightning._common.vocabulary import BaseStorage
from cephalo_lightning.runtime.collectives import Collectives, PendingGather
from cephalo_lightning.runtime.sharding.layout import UnitLayout


class FrozenStorage(abc.ABC):
    """This rank's share of a unit's frozen part (``layout``: the part's packed sub-layout)."""

    kind: ClassVar[BaseStorage]

    def __init__(self, layout: UnitLayout, rank: int, compute_dtype: torch.dtype) -> None:
        self.layout = layout
        self.rank = rank
        self.compute_dtype = compute_dtype

    @property
    def local_numel(self) -> int:
        lo, hi = self.layout.shard_range(self.rank)
        return hi - lo

    @classmethod
    @abc.abstractmethod
    def from_values(cls, layout: UnitLayout, rank: int, values: torch.Tensor,
                    compute_dtype: torch.dtype) -> FrozenStorage:
        """Stored from ``values``: this rank's frozen elements (packed, any floating dtype)."""

    @classmethod
    @abc.abstractmethod
    def bytes_per_element(cls, compute_dtype: torch.dtype) -> float:
        """Bytes the kind stores per frozen element (what the memory model's ``weight_bytes_per_param`` is)."""

    def part_bytes(self) -> int:
        """Bytes the whole part takes over its ranks (the memory model's mean is this over its elements);
        a kind whose cost depends on the layout (a quantised one: its padding, its unquantised vectors) says."""
        return round(self.layout.numel * self.bytes_per_element(self.compute_dtype))

    @abc.abstractmethod
    def local_bytes(self) -> int:
        """Bytes this rank stores for the part (what the memory model prices)."""

    @abc.abstractmethod
    def gathered_bytes(self) -> int:
        """Bytes one all-gather of the whole part receives on a rank (what the links carry)."""

    @abc.abstractmethod
    def pieces(self) -> list[torch.Tensor]:
        """This rank's piece of every frozen parameter, flat, in the part's order: the tensors the
        modules hold outside compute (views of the storage where it holds the values themselves)."""

    def piece_values(self) -> list[torch.Tensor]:
        """This rank's piece of every frozen parameter as values (flat, in the part's order): what a
        checkpoint saves and loads. The pieces themselves where they hold the values; a kind whose
        pieces hold no data (on the meta device) gives values exact enough to store it again."""
        return self.pieces()

    @abc.abstractmethod
    def values(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's frozen elements as values in ``dtype`` (dequantised where stored otherwise):
        what checkpoints, hand-backs and re-sharding read."""

    @abc.abstractmethod
    def start_gather(self, comm: Collectives, out: torch.Tensor, async_op: bool) -> PendingGather:
        """Fill ``out`` (the compute dtype, ``layout.numel`` elements) with the whole part; a quantised
        kind gathers its bytes and dequantises into ``out`` on ``wait()``."""


class ComputeDtypeStorage(FrozenStorage):
    """The frozen values themselves in the compute dtype (bf16 / fp16, fp32 under fp32 training)."""

    kind = BaseStorage.COMPUTE

    def __init__(self, layout: UnitLayout, rank: int, compute_dtype: torch.dtype, shard: torch.Tensor) -> None:
        super().__init__(layout, rank, compute_dtype)
        if shard.numel() != self.local_numel or shard.dtype != compute_dtype:
            raise ValueError(f"unit {layout.name}: a frozen shard of {shard.numel()} {shard.dtype} elements for a "
                             f"range of {self.local_numel} in {compute_dtype}")
        self.shard = shard

    @classmethod
    def from_values(cls, layout: UnitLayout, rank: int, values: torch.Tensor,
                    compute_dtype: torch.dtype) -> ComputeDtypeStorage:
        return cls(layout, rank, compute_dtype, values.detach().to(compute_dtype).reshape(-1).clone())

    @classmethod
    def bytes_per_element(cls, compute_dtype: torch.dtype) -> float:
        return float(compute_dtype.itemsize)

    def local_bytes(self) -> int:
        return self.shard.numel() * self.shard.element_size()

    def gathered_bytes(self) -> int:
        return self.layout.numel * self.shard.element_size()

    def pieces(self) -> list[torch.Tensor]:
        lo, _ = self.layout.shard_range(self.rank)
        out = []
        for span in self.layout.params:
            a, b = self.layout.param_piece(span, self.rank)
            out.append(self.shard[span.offset + a - lo : span.offset + b - lo])
        return out

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        return self.shard.to(dtype)

    def start_gather(self, comm: Collectives, out: torch.Tensor, async_op: bool) -> PendingGather:
        return comm.all_gather(self.shard, out, self.layout, async_op=async_op, dtype=self.compute_dtype)


KINDS: dict[BaseStorage, type[FrozenStorage]] = {BaseStorage.COMPUTE: ComputeDtypeStorage}


def stored_bytes_per_element(kind: BaseStorage, compute_dtype: torch.dtype) -> float:
    """Bytes a frozen element costs stored as ``kind`` under ``compute_dtype``."""
    return KINDS[BaseStorage(kind)].bytes_per_element(compute_dtype)


def make_storage(kind: BaseStorage, layout: UnitLayout, rank: int, values: torch.Tensor,
                 compute_dtype: torch.dtype) -> FrozenStorage:
    """This rank's frozen part of a unit stored as ``kind`` from its values."""
    if kind not in KINDS:
        raise ValueError(f"frozen base storage {kind!r}: choose one of {sorted(str(k) for k in KINDS)}")
    return KINDS[kind].from_values(layout, rank, values, compute_dtype)
