"""The GPT's shape, its presets, and sizes computed from the shape alone (no torch needed).

Kept apart from :mod:`cephalo_lightning.demo.gpt` so the torch-free planner can size a 7B-parameter
preset (parameters per layer, FLOPs per token) without importing torch or building the model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

from cephalo_lightning._common.errors import ConfigurationError, UnsupportedError

# name -> (n_layer, n_head, n_embd). The big shapes are for planning (parameter counts, FLOPs).
PRESETS: dict[str, tuple[int, int, int]] = {
    "tiny": (2, 2, 32),  # unit tests: builds and steps in milliseconds
    "small": (4, 4, 128),  # CPU demo: ~0.9M parameters at vocab 256, trains visibly in minutes
    "gpt2-124m": (12, 12, 768),
    "gpt-1.3b": (24, 16, 2048),
    "gpt-2.7b": (32, 32, 2560),
    "llama-7b-shape": (32, 32, 4096),  # Llama-7B's depth and width with a GPT block (4x MLP)
}


@dataclass
class GPTConfig:
    """The model shape. ``seq_len`` is the block size: the longest sequence the model accepts."""

    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, as in GPT-2

    presets: ClassVar[dict[str, tuple[int, int, int]]] = PRESETS

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd"):
            if int(getattr(self, name)) < 1:
                raise ConfigurationError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ConfigurationError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigurationError(f"dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def preset(cls, name: str, vocab_size: int = 256, seq_len: int = 64, **overrides: Any) -> GPTConfig:
        """A named shape (see :data:`PRESETS`); ``overrides`` replace any field, e.g. ``n_layer=6``."""
        if name not in PRESETS:
            raise ConfigurationError(f"unknown GPT preset {name!r}; choose one of {sorted(PRESETS)}")
        n_layer, n_head, n_embd = PRESETS[name]
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise UnsupportedError(f"unknown GPTConfig field(s): {sorted(unknown)}")
        config = cls(vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        return replace(config, **{k: v for k, v in overrides.items() if v is not None})

    # ---- sizes computed from the shape alone, so the planner can size a 7B model without building it

    def embedding_parameters(self) -> int:
        """Token and position tables (``Embedding``)."""
        return (self.vocab_size + self.seq_len) * self.n_embd

    def block_parameters(self) -> int:
        """One transformer ``Block``: 12 C^2 weights, 2 LayerNorm scales and, with ``bias``, 11 C biases."""
        c = self.n_embd
        return 12 * c * c + 2 * c + (11 * c if self.bias else 0)

    def head_parameters(self) -> int:
        """Final LayerNorm plus the (bias-free) projection to the vocabulary (``Head``)."""
        c = self.n_embd
        return c + (c if self.bias else 0) + c * self.vocab_size

    def layer_parameters(self) -> list[int]:
        """Parameter count of each layer in :meth:`GPT.layers` order: embed, blocks, head."""
        return [self.embedding_parameters(), *[self.block_parameters()] * self.n_layer, self.head_parameters()]

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Total parameters; ``non_embedding`` leaves out the lookup tables (they cost no FLOPs)."""
        total = sum(self.layer_parameters())
        return total - self.embedding_parameters() if non_embedding else total

    def estimate_flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B: ``6 N + 12 L C T``.

        ``N`` counts the parameters that take part in matmuls (not the embedding lookups); the second
        term is attention's QK^T and AV products over the full sequence.
        """
        return 6.0 * self.num_parameters(non_embedding=True) + 12.0 * self.n_layer * self.n_embd * self.seq_len
