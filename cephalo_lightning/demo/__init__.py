"""The example workload: a small GPT with Cephalo's layered protocol and a byte-level text corpus.

``GPTConfig`` (torch-free: shapes, presets, parameter and FLOP counts), ``GPT`` (pure torch),
``GPTModule`` (its LightningModule) and ``TextDataModule`` (CPython's bundled help text, a local
file, or a cached Hugging Face dataset; never a download).

Names are imported lazily so that ``from cephalo_lightning.demo import GPTConfig`` stays torch-free
for the planner.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "GPTConfig": "gpt_config",
    "PRESETS": "gpt_config",
    "GPT": "gpt",
    "Block": "gpt",
    "Embedding": "gpt",
    "Head": "gpt",
    "GPTModule": "module",
    "no_weight_decay": "module",
    "VOCAB_SIZE": "data",
    "ByteWindowDataset": "data",
    "TextDataModule": "data",
    "decode": "data",
    "encode": "data",
    "load_corpus": "data",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from cephalo_lightning.demo.data import VOCAB_SIZE, ByteWindowDataset, TextDataModule, decode, encode, load_corpus
    from cephalo_lightning.demo.gpt import GPT, Block, Embedding, Head
    from cephalo_lightning.demo.gpt_config import PRESETS, GPTConfig
    from cephalo_lightning.demo.module import GPTModule, no_weight_decay


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
