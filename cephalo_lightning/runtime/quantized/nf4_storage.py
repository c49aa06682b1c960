"""A unit's frozen part stored as NF4 blocks: each rank quantises its own pieces, gathers 4-bit bytes.

Per rank r and frozen parameter s, the layout gives r's piece ``[a, b)`` of s. A matrix (two or more
dimensions: the linear weights, the embedding, the head) is stored as NF4 blocks of its piece alone
(:mod:`.nf4_blocks`), every other frozen parameter (norms, biases) in the compute dtype::

    blocks(r, s) = ceil((b - a) / B)      codes: B / 2 bytes a block,  scales: one fp32 a block
    stored(r)    = sum_s blocks(r, s) x (B / 2 + 4)  +  dense elements x compute size

Every count above is a function of the layout alone, so every rank knows every rank's byte counts
without talking: a gather is three uneven all-gathers (codes, scales, dense values), then each
rank dequantises the gathered unit into the compute dtype, piece by piece, in place.

[Note: NF4 blocks restart at every piece] A block never straddles two ranks' pieces, so a rank
quantises what it holds without its neighbours' elements. The NF4 bytes therefore depend on the
layout that cut the pieces: a single-process model is "the same quantised model" when it quantises
each parameter in the same pieces (tests/runtime/test_qlora.py decodes the ranks' bytes), and a
re-sharded run re-quantises the dequantised values at the new cut points (the same bytes where no
cut moves).

[Note: a quantised piece holds no data] Outside compute the modules hold a quantised matrix's
local piece on the meta device: its shape, no bytes (a dequantised copy would cost more than the 4-bit
one saves). What reads values (checkpoints, the frozen base's fingerprint, hand-backs, re-sharding)
asks the storage (:meth:`Nf4Storage.piece_values`: dequantised in fp32, where ``NF4[c] x absmax`` is
exact, so quantising them again in the same pieces gives the same bytes) and stores loaded values
again through ``FlatUnit.restore_frozen``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate

import torch

from cephalo_lightning._common.vocabulary import BaseStorage
from cephalo_lightning.runtime.collectives import Collectives, PendingGather
from cephalo_lightning.runtime.quantized.nf4_blocks import BLOCKSIZE, Nf4Blocks, concatenate, num_blocks, quantize
from cephalo_lightning.runtime.sharding.frozen_storage import KINDS, FrozenStorage
from cephalo_lightning.runtime.sharding.layout import ParamSpan, UnitLayout


def quantised(span: ParamSpan) -> bool:
    """A matrix is stored as NF4 blocks; a vector (norm, bias) in the compute dtype."""
    return len(span.shape) >= 2


@dataclass(frozen=True)
class PieceCounts:
    """Every rank's blocks and dense elements of a frozen part: the gathers' layouts."""

    codes: UnitLayout
    scales: UnitLayout
    dense: UnitLayout

    @staticmethod
    def of(layout: UnitLayout, blocksize: int) -> PieceCounts:
        blocks, dense = [], []
        for r in range(layout.world_size):
            pieces = [(span, layout.param_piece(span, r)) for span in layout.params]
            blocks.append(sum(num_blocks(b - a, blocksize) for span, (a, b) in pieces if quantised(span)))
            dense.append(sum(b - a for span, (a, b) in pieces if not quantised(span)))

        def cut(sizes: list[int], tag: str) -> UnitLayout:
            return UnitLayout(f"{layout.name}.{tag}", (0, *accumulate(sizes)))

        return PieceCounts(cut([n * blocksize // 2 for n in blocks], "nf4-codes"), cut(blocks, "nf4-scales"),
                           cut(dense, "dense"))


class Nf4Storage(FrozenStorage):
    """This rank's frozen pieces: matrices as NF4 blocks (``blocks``), vectors in the compute dtype (``dense``)."""

    kind = BaseStorage.NF4

    def __init__(self, layout: UnitLayout, rank: int, compute_dtype: torch.dtype, blocks: Nf4Blocks,
                 dense: torch.Tensor) -> None:
        super().__init__(layout, rank, compute_dtype)
        self.blocksize = blocks.blocksize
        self.counts = PieceCounts.of(layout, self.blocksize)
        if blocks.num_blocks != self.counts.scales.shard_sizes[rank] or dense.numel() != self.counts.dense.shard_sizes[rank]:
            raise ValueError(f"unit {layout.name}: {blocks.num_blocks} NF4 blocks and {dense.numel()} dense elements "
                             f"for rank {rank}'s pieces, which take {self.counts.scales.shard_sizes[rank]} and "
                             f"{self.counts.dense.shard_sizes[rank]}")
        self.blocks, self.dense = blocks, dense

    @classmethod
    def from_values(cls, layout: UnitLayout, rank: int, values: torch.Tensor, compute_dtype: torch.dtype,
                    blocksize: int = BLOCKSIZE) -> Nf4Storage:
        lo, _ = layout.shard_range(rank)
        flat = values.detach().reshape(-1)
        parts, dense = [], []
        for span in layout.params:
            a, b = layout.param_piece(span, rank)
            piece = flat[span.offset + a - lo: span.offset + b - lo]
            if quantised(span):
                parts.append(quantize(piece, blocksize))
            else:
                dense.append(piece.to(compute_dtype))
        blocks = concatenate(parts) if parts else Nf4Blocks(torch.empty(0, dtype=torch.uint8), torch.empty(0), blocksize)
        return cls(layout, rank, compute_dtype,
                   Nf4Blocks(blocks.codes.to(flat.device), blocks.absmax.to(flat.device), blocksize),
                   torch.cat(dense) if dense else flat.new_empty(0, dtype=compute_dtype))

    def _dequantised_pieces(self, blocks: Nf4Blocks, dense: torch.Tensor, rank: int,
                            dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Rank ``rank``'s piece of every frozen parameter, from its blocks (dequantised into ``dtype``,
        the compute dtype by default) and its dense values."""
        return list(self._each_piece(blocks, dense, rank, dtype))

    def _each_piece(self, blocks: Nf4Blocks, dense: torch.Tensor, rank: int,
                    dtype: torch.dtype | None = None) -> Iterator[torch.Tensor]:
        """:meth:`_dequantised_pieces` one at a time (a gather copies each into place and frees it)."""
        block, at = 0, 0
        for span in self.layout.params:
            a, b = self.layout.param_piece(span, rank)
            if quantised(span):
                n = num_blocks(b - a, self.blocksize)
                yield blocks.blocks(block, block + n).dequantize(dtype or self.compute_dtype, b - a)
                block += n
            else:
                yield dense[at: at + b - a]
                at += b - a

    @classmethod
    def bytes_per_element(cls, compute_dtype: torch.dtype) -> float:
        """A quantised matrix's element: half a byte and its share of its block's fp32 scale (the
        vectors and each piece's padding: :meth:`part_bytes`)."""
        return 0.5 + 4 / BLOCKSIZE

    def part_bytes(self) -> int:
        """The whole part over its ranks: every rank's codes and scales, and its vectors in the compute dtype."""
        return (self.counts.codes.numel + 4 * self.counts.scales.numel
                + self.counts.dense.numel * torch.empty(0, dtype=self.compute_dtype).element_size())

    def quantised_names(self) -> list[str]:
        """The frozen parameters this kind stores as NF4 blocks (the matrices)."""
        return [span.name for span in self.layout.params if quantised(span)]

    def local_bytes(self) -> int:
        return self.blocks.nbytes + self.dense.numel() * self.dense.element_size()

    def gathered_bytes(self) -> int:
        return self.part_bytes()

    def pieces(self) -> list[torch.Tensor]:
        """A quantised matrix's piece on the meta device, a vector's a view of the dense values
        (see [Note: a quantised piece holds no data])."""
        out, at = [], 0
        for span in self.layout.params:
            a, b = self.layout.param_piece(span, self.rank)
            if quantised(span):
                out.append(torch.empty(b - a, dtype=self.compute_dtype, device="meta"))
            else:
                out.append(self.dense[at: at + b - a])
                at += b - a
        return out

    def piece_values(self) -> list[torch.Tensor]:
        return self._dequantised_pieces(self.blocks, self.dense, self.rank, torch.float32)

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        pieces = self._dequantised_pieces(self.blocks, self.dense, self.rank, dtype)
        return torch.cat([p.reshape(-1).to(dtype) for p in pieces]) if pieces else self.dense.to(dtype)

    def start_gather(self, comm: Collectives, out: torch.Tensor, async_op: bool) -> GatheredNf4:
        counts, device = self.counts, out.device
        codes = torch.empty(counts.codes.numel, dtype=torch.uint8, device=device)
        scales = torch.empty(counts.scales.numel, dtype=torch.float32, device=device)
        dense = torch.empty(counts.dense.numel, dtype=self.compute_dtype, device=device)
        pending = [comm.all_gather(self.blocks.codes, codes, counts.codes, async_op=async_op),
                   comm.all_gather(self.blocks.absmax, scales, counts.scales, async_op=async_op),
                   comm.all_gather(self.dense, dense, counts.dense, async_op=async_op)]
        return GatheredNf4(self, out, codes, scales, dense, pending)


@dataclass
class GatheredNf4:
    """The three gathers of an NF4 part in flight; ``wait()`` dequantises every rank's pieces into ``out``."""

    storage: Nf4Storage
    out: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    dense: torch.Tensor
    pending: list[PendingGather]

    def wait(self) -> torch.Tensor:
        for p in self.pending:
            p.wait()
        s, counts = self.storage, self.storage.counts
        for r in range(s.layout.world_size):
            c_lo, c_hi = counts.codes.shard_range(r)
            a_lo, a_hi = counts.scales.shard_range(r)
            d_lo, d_hi = counts.dense.shard_range(r)
            pieces = s._each_piece(Nf4Blocks(self.codes[c_lo:c_hi], self.scales[a_lo:a_hi], s.blocksize),
                                   self.dense[d_lo:d_hi], r)
            for span, piece in zip(s.layout.params, pieces):
                a, b = s.layout.param_piece(span, r)
                self.out[span.offset + a: span.offset + b].copy_(piece)
        self.codes = self.scales = self.dense = self.out[:0]  # the gathered 4-bit copy, freed with the wait
        return self.out


KINDS[BaseStorage.NF4] = Nf4Storage
