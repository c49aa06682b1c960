"""The demo package's GPT at its ``tiny`` preset (sequences of 32 tokens) and a seeded sample of its
tokens: the model the profiling tests time."""

from __future__ import annotations

import torch

from cephalo_lightning.demo.gpt import GPT, GPTConfig


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny", seq_len=32))


def sample_tokens(rows: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (rows, 32), generator=torch.Generator().manual_seed(1))
