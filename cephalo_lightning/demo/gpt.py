"""A small, clean GPT (in the spirit of nanoGPT), written as an ordered list of layers.

Cephalo shards and schedules a model *layer by layer*: each layer is one shard unit whose
parameters are gathered, run for every micro-batch, and released before the next layer. So the
model here is deliberately a plain chain ``Embedding -> Block x n_layer -> Head`` where every
layer maps ONE tensor to ONE tensor::

    idx (B, T) long --Embedding--> x (B, T, C) --Block--> ... --Block--> x --Head--> logits (B, T, V)

Pure torch, no Lightning: :mod:`cephalo_lightning.demo.module` wraps it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning.demo.gpt_config import PRESETS, GPTConfig

__all__ = ["GPT", "PRESETS", "Block", "CausalSelfAttention", "Embedding", "GPTConfig", "Head", "MLP"]


class Embedding(nn.Module):
    """Token ids ``(B, T)`` -> hidden states ``(B, T, C)``: token + learned position embeddings."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.seq_len, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.size(1)
        if t > self.wpe.num_embeddings:
            raise ConfigurationError(f"sequence of length {t} is longer than seq_len {self.wpe.num_embeddings}")
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention`` (flash when available)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wide with GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """A pre-LayerNorm transformer block ``(B, T, C) -> (B, T, C)``: attention then MLP, both residual."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """Hidden states ``(B, T, C)`` -> logits ``(B, T, V)``: final LayerNorm and the language-model head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    """A decoder-only transformer as the chain ``[embed, *blocks, head]``.

    There is NO weight tying between ``embed.wte`` and ``head.lm_head`` (unlike GPT-2): Cephalo
    gives every parameter to exactly one layer, its shard unit, and a parameter shared by the first
    and last layer could be owned by neither. The untied head costs ``vocab_size * n_embd`` more
    parameters, which is small at byte-level vocabularies.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.head = Head(config)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), zero biases, residual projections scaled by 1/sqrt(2 L)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        # each residual branch adds to the stream; keep its variance from growing with depth
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.c_proj.weight, mean=0.0, std=residual_std)

    def init_module(self, module: nn.Module) -> None:
        """:meth:`reset_parameters` for ``module``'s own parameters alone (the same distributions), as
        Cephalo initialises a model built on the meta device one unit at a time."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            residual = any(module is block.attn.c_proj or module is block.mlp.c_proj for block in self.blocks)
            nn.init.normal_(module.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer) if residual else 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def layers(self) -> list[nn.Module]:
        """The shard units in execution order; running them one after another is :meth:`forward`."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids ``(B, T)`` -> logits ``(B, T, vocab_size)``."""
        x = idx
        for layer in self.layers():
            x = layer(x)
        return x

    @staticmethod
    def loss(logits: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross entropy over every position of every sequence."""
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameters of the built model (equals :meth:`GPTConfig.num_parameters`)."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= sum(p.numel() for p in self.embed.parameters())
        return total

    def estimate_flops_per_token(self) -> float:
        """Training FLOPs per token; see :meth:`GPTConfig.estimate_flops_per_token`."""
        return self.config.estimate_flops_per_token()

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None) -> Tensor:
        """Sample ``max_new_tokens`` continuations of ``idx`` ``(B, T)``, cropping context to ``seq_len``."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.seq_len :]
            logits = self(context)[:, -1, :] / max(temperature, 1e-8)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_id), dim=1)
        return idx
