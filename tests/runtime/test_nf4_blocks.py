"""NF4 blocks through bitsandbytes, checked against the published NF4 code book decoded by hand.

The reference here is independent of bitsandbytes: QLoRA's 16 NormalFloat values (Dettmers et al.,
2023, Appendix E), two codes a byte with the first element in the high nibble, each block scaled
by its absolute maximum. The tests fail on a block dequantised with another block's scale and on
scales that are not the blocks' maxima.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("bitsandbytes")

from cephalo_lightning._common.errors import ConfigurationError  # noqa: E402
from cephalo_lightning.runtime.quantized.nf4_blocks import (  # noqa: E402
    Nf4Blocks,
    concatenate,
    num_blocks,
    quantize,
)

# QLoRA's NF4 code book, as published (Appendix E of arXiv 2305.14314)
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])


def by_hand(codes: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> torch.Tensor:
    """The code book decoded by hand: high nibble first, every element times its block's scale (fp32)."""
    nibbles = torch.stack([codes >> 4, codes & 15], dim=1).reshape(-1).long()
    return NF4[nibbles] * absmax.repeat_interleave(blocksize)


@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantisation_is_the_code_book_times_each_blocks_scale(blocksize: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    weight = (torch.randn(37, 29) * torch.linspace(0.01, 3, 29)).to(dtype)  # 1073 elements: a padded last block
    blocks = quantize(weight, blocksize)
    assert blocks.num_blocks == num_blocks(weight.numel(), blocksize) == -(-1073 // blocksize)
    assert blocks.nbytes == blocks.num_blocks * (blocksize // 2 + 4)
    flat = torch.cat([weight.float().reshape(-1), torch.zeros(blocks.numel - weight.numel())])
    # every block's scale is its absolute maximum (padding zeros change none)
    assert torch.equal(blocks.absmax, flat.view(-1, blocksize).abs().amax(dim=1))
    expected = by_hand(blocks.codes, blocks.absmax, blocksize)
    assert torch.equal(blocks.dequantize(torch.float32), expected)
    assert torch.equal(blocks.dequantize(torch.bfloat16), expected.to(torch.bfloat16))
    assert torch.equal(blocks.dequantize(torch.float32, weight.numel()), expected[:weight.numel()])
    # every code is a nearest code-book value of its element over its block's scale
    nibbles = torch.stack([blocks.codes >> 4, blocks.codes & 15], dim=1).reshape(-1).long()
    scaled = flat / blocks.absmax.repeat_interleave(blocksize)
    nearest = (scaled[:, None] - NF4[None, :]).abs().min(dim=1).values
    assert torch.all((scaled - NF4[nibbles]).abs() <= nearest + 1e-6)


def test_a_block_dequantised_with_another_blocks_scale_is_caught() -> None:
    """The check above fails when the scales are off by one block (what a shard misplaced would do)."""
    torch.manual_seed(1)
    blocks = quantize(torch.randn(640))
    shifted = Nf4Blocks(blocks.codes, torch.roll(blocks.absmax, 1), blocks.blocksize)
    assert not torch.equal(shifted.dequantize(torch.float32), by_hand(blocks.codes, blocks.absmax, 64))


def test_any_run_of_whole_blocks_dequantises_alone_as_in_the_whole() -> None:
    torch.manual_seed(2)
    weights = [torch.randn(3, 50), torch.randn(200), torch.randn(7, 9, 4)]
    unit = concatenate([quantize(w) for w in weights])
    assert unit.num_blocks == sum(num_blocks(w.numel(), 64) for w in weights)
    whole = unit.dequantize(torch.bfloat16)
    cuts = (0, 1, 2, 7, unit.num_blocks)  # uneven runs of whole blocks
    pieces = [unit.blocks(a, b).dequantize(torch.bfloat16) for a, b in zip(cuts, cuts[1:])]
    assert torch.equal(torch.cat(pieces), whole)
    # each weight's elements are where its blocks put them, padding skipped
    start = 0
    for w in weights:
        n = num_blocks(w.numel(), 64)
        assert torch.equal(whole[start * 64:start * 64 + w.numel()], quantize(w).dequantize(torch.bfloat16, w.numel()))
        start += n


def test_bad_input_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigurationError, match="blocksize 48 .*64 is QLoRA"):
        quantize(torch.randn(64), blocksize=48)
    with pytest.raises(TypeError, match="only a floating weight"):
        quantize(torch.arange(64))
    with pytest.raises(ConfigurationError, match="do not make"):
        Nf4Blocks(torch.zeros(31, dtype=torch.uint8), torch.ones(1))
