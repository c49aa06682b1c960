"""NF4 blocks: a frozen weight as 4-bit codes and one fp32 scale per block, through bitsandbytes.

A weight ``w`` (any shape) is flattened, padded with zeros to whole blocks of ``B`` elements
(``B = blocksize``, 64 by default as in QLoRA), and each block ``k`` is stored as::

    absmax[k] = max_j |w[kB + j]|                      (fp32, one per block)
    code[kB + j] = argmin_c |NF4[c] - w[kB + j] / absmax[k]|   (4 bits, two per byte, first in the high nibble)

    dequantised: w~[kB + j] = NF4[code[kB + j]] * absmax[k]   (in the compute dtype)

``NF4`` is the 16-value NormalFloat code book of QLoRA (Dettmers et al., 2023). A weight of ``n``
elements costs ``ceil(n / B) * (B / 2 + 4)`` bytes: ``0.5 + 4 / B`` bytes a parameter (0.5625 at
``B = 64``; :mod:`cephalo_lightning.planner.cost.base_storage` prices it torch-free). Padding zeros
change no scale, and a block never straddles two weights.

[Note: whole blocks] Blocks are independent: any contiguous run of whole blocks (its bytes, its
scales) dequantises alone to exactly the elements the whole weight's dequantisation gives there.
So the blocks of several weights (or pieces) stored one after another (:func:`concatenate`) are
sliced, gathered and dequantised run by run, bit for bit as each weight alone.

**Why bitsandbytes** (``pip install "cephalo-lightning[qlora]"``, pinned in ``.ci/constraints.txt``):
its ``quantize_4bit`` / ``dequantize_4bit`` run on the CPU (its own CPU kernels, no GPU needed) as on
CUDA, so the suite tests the bytes a GPU run uses; it is the library QLoRA, Hugging Face's
``BitsAndBytesConfig`` and Answer.AI's FSDP + QLoRA quantise with, so a base quantised here holds
the codes and scales those produce. torchao's NF4 tensor was the alternative: its pinned release
(0.18) no longer ships ``torchao.dtypes.nf4tensor`` and its wheel's native extensions do not load
against this torch CPU build. Only bitsandbytes' public ``bitsandbytes.functional`` is called.
Double quantisation (8-bit scales) is not offered: it saves 0.05 bytes a parameter (0.5625 to about
0.52) at the cost of a second code book per shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cephalo_lightning._common.errors import ConfigurationError, UnsupportedError

BLOCKSIZE = 64  # elements per block: QLoRA's and bitsandbytes' default
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes accepts
QUANT_TYPE = "nf4"


def _functional():  # noqa: ANN202 - bitsandbytes.functional, imported on first use
    try:
        import bitsandbytes.functional as bnb_functional
    except ImportError as err:
        raise UnsupportedError(
            "a 4-bit (NF4) base needs bitsandbytes: pip install \"cephalo-lightning[qlora]\" (or "
            "bitsandbytes itself), or store the base in bf16 instead") from err
    return bnb_functional


def check_blocksize(blocksize: int) -> int:
    if blocksize not in BLOCKSIZES:
        raise ConfigurationError(f"NF4 blocksize {blocksize!r} is not one bitsandbytes supports: use one of "
                                 f"{', '.join(map(str, BLOCKSIZES))} (64 is QLoRA's)")
    return blocksize


@dataclass(frozen=True)
class Nf4Blocks:
    """Whole NF4 blocks: ``codes`` (uint8, ``blocksize / 2`` bytes a block), ``absmax`` (fp32, one a block)."""

    codes: torch.Tensor
    absmax: torch.Tensor
    blocksize: int = BLOCKSIZE

    def __post_init__(self) -> None:
        if self.codes.dtype != torch.uint8 or self.absmax.dtype != torch.float32:
            raise ConfigurationError(f"NF4 blocks hold uint8 codes and fp32 scales, not {self.codes.dtype} and "
                                     f"{self.absmax.dtype}")
        if self.codes.numel() != self.absmax.numel() * self.blocksize // 2:
            raise ConfigurationError(f"{self.codes.numel()} code bytes do not make {self.absmax.numel()} blocks of "
                                     f"{self.blocksize} elements ({self.blocksize // 2} bytes each)")

    @property
    def num_blocks(self) -> int:
        return self.absmax.numel()

    @property
    def numel(self) -> int:
        """Elements the blocks hold, padding included."""
        return self.num_blocks * self.blocksize

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.absmax.numel()

    def blocks(self, start: int, stop: int) -> Nf4Blocks:
        """Blocks ``[start, stop)``: views of the codes and scales."""
        half = self.blocksize // 2
        return Nf4Blocks(self.codes[start * half:stop * half], self.absmax[start:stop], self.blocksize)

    def dequantize(self, dtype: torch.dtype, numel: int | None = None) -> torch.Tensor:
        """The blocks' elements in ``dtype`` (flat), the first ``numel`` of them (all: None)."""
        if not self.num_blocks:
            return torch.empty(0, dtype=dtype, device=self.codes.device)
        bnb = _functional()
        state = bnb.QuantState(absmax=self.absmax, shape=torch.Size([self.numel]), blocksize=self.blocksize,
                               quant_type=QUANT_TYPE, dtype=dtype)
        out = bnb.dequantize_4bit(self.codes.view(-1, 1), quant_state=state).reshape(-1)
        return out if numel is None else out[:numel]


def num_blocks(numel: int, blocksize: int = BLOCKSIZE) -> int:
    return -(-numel // blocksize)


def quantize(weight: torch.Tensor, blocksize: int = BLOCKSIZE) -> Nf4Blocks:
    """``weight`` (floating, any shape) as NF4 blocks, quantised from its own dtype (bf16, fp16 or fp32)."""
    check_blocksize(blocksize)
    if not weight.is_floating_point():
        raise UnsupportedError(f"only a floating weight is quantised to NF4, not {weight.dtype}")
    flat = weight.detach().reshape(-1)
    if flat.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        flat = flat.float()
    padded = num_blocks(flat.numel(), blocksize) * blocksize
    if padded != flat.numel():
        flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
    if not padded:
        return Nf4Blocks(torch.empty(0, dtype=torch.uint8), torch.empty(0), blocksize)
    codes, state = _functional().quantize_4bit(flat.contiguous(), blocksize=blocksize, compress_statistics=False,
                                               quant_type=QUANT_TYPE)
    return Nf4Blocks(codes.reshape(-1), state.absmax.float().reshape(-1), blocksize)


def concatenate(parts: Sequence[Nf4Blocks]) -> Nf4Blocks:
    """The blocks of several weights, one after another (a unit's frozen weights)."""
    sizes = {p.blocksize for p in parts}
    if len(sizes) > 1:
        raise ConfigurationError(f"NF4 blocks of one unit share one blocksize, not {sorted(sizes)}")
    blocksize = sizes.pop() if sizes else BLOCKSIZE
    return Nf4Blocks(torch.cat([p.codes for p in parts]) if parts else torch.empty(0, dtype=torch.uint8),
                     torch.cat([p.absmax for p in parts]) if parts else torch.empty(0), blocksize)
