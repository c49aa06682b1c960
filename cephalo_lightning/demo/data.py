"""Byte-level language-modelling data: a real text corpus, no tokenizer file, no downloads.

Text is modelled as its UTF-8 bytes, so the vocabulary is the 256 byte values. The default corpus
is the English help text that ships with every CPython (``pydoc_data.topics``, ~465k characters of
the Python reference manual), so the demo needs nothing beyond Python itself. Alternatives:

* ``corpus="path/to/file.txt"`` - any local text file;
* ``corpus="hf:<name>[:<config>]"`` - a Hugging Face ``datasets`` dataset already in the local
  cache (offline mode is forced; nothing is ever downloaded).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from cephalo_lightning._common.errors import ConfigurationError

VOCAB_SIZE = 256
PYDOC_CORPUS = "pydoc"
HF_PREFIX = "hf:"


def bytes_to_tensor(raw: bytes) -> Tensor:
    """Bytes -> a 1-D ``uint8`` tensor without a Python-level loop (corpora can be large)."""
    if not raw:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def encode(text: str) -> Tensor:
    """Text -> its UTF-8 bytes as a 1-D ``uint8`` tensor (the token ids)."""
    return bytes_to_tensor(text.encode("utf-8"))


def decode(ids: Tensor | list[int]) -> str:
    """Token ids -> text; byte sequences cut mid-character decode to U+FFFD instead of failing."""
    values = ids.tolist() if isinstance(ids, Tensor) else ids
    return bytes(int(v) for v in values).decode("utf-8", errors="replace")


def pydoc_text() -> str:
    """CPython's bundled help topics joined in sorted-key order (deterministic for a Python version)."""
    try:
        from pydoc_data.topics import topics
    except ImportError as err:  # some distributions split the stdlib; say what is missing
        raise RuntimeError(
            "the default corpus needs the standard-library module pydoc_data (missing from this Python); "
            "pass corpus='path/to/file.txt' instead"
        ) from err
    return "\n\n".join(topics[key] for key in sorted(topics))


def hf_text(spec: str, split: str = "train") -> str:
    """Text of the cached Hugging Face dataset ``<name>[:<config>]``, rows joined by newlines.

    Offline mode is forced (``HF_DATASETS_OFFLINE=1``, ``HF_HUB_OFFLINE=1``) so a dataset missing
    from the cache is an error, never a download. The ``text`` column is used, else the first
    string column.
    """
    name, _, config = spec.partition(":")
    if not name:
        raise ConfigurationError(f"corpus {HF_PREFIX + spec!r}: expected 'hf:<dataset_name>[:<config>]'")
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets
    except ImportError as err:
        raise ImportError(
            f"corpus {HF_PREFIX + spec!r} needs the optional package `datasets` (pip install datasets) "
            "and the dataset in the local Hugging Face cache"
        ) from err
    # the flags are read at import time; if the libraries were imported earlier, set them directly
    for module_name, attrs in (("datasets.config", ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")),
                               ("huggingface_hub.constants", ("HF_HUB_OFFLINE",))):
        module = sys.modules.get(module_name)
        for attr in attrs:
            if module is not None and hasattr(module, attr):
                setattr(module, attr, True)
    try:
        ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as err:  # the library raises several types for "not cached"
        raise RuntimeError(
            f"could not load Hugging Face dataset {name!r} (config {config or None!r}, split {split!r}) from the "
            f"local cache with downloads disabled: {err}"
        ) from err
    columns = list(ds.column_names)
    features = getattr(ds, "features", {}) or {}
    strings = [c for c in columns if getattr(features.get(c), "dtype", None) in ("string", "large_string")]
    column = "text" if "text" in columns else (strings or columns)[0]
    return "\n".join(str(row) for row in ds[column])


def load_corpus(corpus: str = PYDOC_CORPUS) -> bytes:
    """The corpus as bytes: ``"pydoc"``, ``"hf:<name>[:<config>]"`` or a local file path."""
    if corpus == PYDOC_CORPUS:
        return pydoc_text().encode("utf-8")
    if corpus.startswith(HF_PREFIX):
        return hf_text(corpus[len(HF_PREFIX) :]).encode("utf-8")
    path = Path(corpus).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"corpus {corpus!r} is not {PYDOC_CORPUS!r}, not 'hf:<name>[:<config>]' and not an existing file"
        )
    return path.read_bytes()


class ByteWindowDataset(Dataset[tuple[Tensor, Tensor]]):
    """Windows of ``seq_len + 1`` bytes as ``(x, y)`` pairs with ``y`` = ``x`` shifted left by one.

    Window ``i`` starts at byte ``i * stride``; the default ``stride = seq_len`` tiles the text
    without repeating a target. ``max_samples`` keeps that many windows spread evenly over the
    whole text (deterministically), so a capped epoch still sees all of the corpus's topics.
    """

    def __init__(self, data: Tensor, seq_len: int, stride: int | None = None, max_samples: int | None = None) -> None:
        if data.dim() != 1:
            raise ConfigurationError("data must be a 1-D tensor of token ids")
        stride = seq_len if stride is None else stride
        if seq_len < 1 or stride < 1:
            raise ConfigurationError(f"seq_len and stride must be >= 1, got {seq_len} and {stride}")
        if data.numel() < seq_len + 1:
            raise ConfigurationError(f"{data.numel()} tokens cannot fill one window of seq_len + 1 = {seq_len + 1}")
        self.data = data
        self.seq_len = seq_len
        self.stride = stride
        count = (data.numel() - seq_len - 1) // stride + 1
        if max_samples is not None and max_samples < count:
            if max_samples < 1:
                raise ConfigurationError(f"max_samples must be >= 1, got {max_samples}")
            # evenly spaced, distinct (spacing >= 1), first and last window included
            self.starts = torch.linspace(0, count - 1, max_samples, dtype=torch.float64).round().long() * stride
        else:
            self.starts = torch.arange(count) * stride

    def __len__(self) -> int:
        return self.starts.numel()

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = int(self.starts[index])
        chunk = self.data[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class TextDataModule(pl.LightningDataModule):
    """Byte-level next-token data from ``corpus`` with a deterministic train/validation split.

    The last ``val_fraction`` of the bytes is the validation text, the rest the training text, so
    the split never depends on a seed and no window straddles the two.

    ``batch_size`` is the GLOBAL batch: the number of sequences in one optimizer step across all
    ranks. The Cephalo strategy re-cuts each global batch into the per-rank slices of its plan (a
    fast GPU gets more samples than a slow one) and rebuilds the training loader from
    ``train_dataloader().dataset`` and this batch size; other strategies use it per rank as usual.

    Args:
        corpus: ``"pydoc"`` (default), a local text file path, or ``"hf:<name>[:<config>]"``.
        seq_len: tokens per training sequence.
        batch_size: the global batch size (see above); also used for validation.
        num_workers: DataLoader worker processes.
        val_fraction: share of the text, taken from its end, held out for validation.
        max_train_samples: cap on training windows per epoch (spread evenly over the text).
        max_val_samples: cap on validation windows.
        stride: bytes between window starts (default ``seq_len``: non-overlapping targets).
    """

    vocab_size: int = VOCAB_SIZE

    def __init__(
        self,
        corpus: str = PYDOC_CORPUS,
        seq_len: int = 64,
        batch_size: int = 32,
        num_workers: int = 0,
        val_fraction: float = 0.05,
        max_train_samples: int | None = None,
        max_val_samples: int | None = None,
        stride: int | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ConfigurationError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.save_hyperparameters()
        self.corpus = corpus
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.val_fraction = val_fraction
        self.max_train_samples = max_train_samples
        self.max_val_samples = max_val_samples
        self.stride = stride
        self.train_dataset: ByteWindowDataset | None = None
        self.val_dataset: ByteWindowDataset | None = None

    @override
    def setup(self, stage: str | None = None) -> None:
        """Read and split the corpus once (local reads only, so every rank may do it)."""
        if self.train_dataset is not None:
            return
        data = bytes_to_tensor(load_corpus(self.corpus))
        split = int(data.numel() * (1.0 - self.val_fraction))
        train, val = data[:split], data[split:]
        for name, part in (("training", train), ("validation", val)):
            if part.numel() < self.seq_len + 1:
                raise ConfigurationError(
                    f"corpus {self.corpus!r} ({data.numel()} bytes) leaves {part.numel()} {name} bytes, "
                    f"fewer than seq_len + 1 = {self.seq_len + 1}; use a longer text or adjust val_fraction"
                )
        self.train_dataset = ByteWindowDataset(train, self.seq_len, self.stride, self.max_train_samples)
        self.val_dataset = ByteWindowDataset(val, self.seq_len, self.stride, self.max_val_samples)

    def _datasets(self) -> tuple[ByteWindowDataset, ByteWindowDataset]:
        if self.train_dataset is None or self.val_dataset is None:
            self.setup()
        assert self.train_dataset is not None and self.val_dataset is not None
        return self.train_dataset, self.val_dataset

    def _loader(self, dataset: ByteWindowDataset, train: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=train,
            drop_last=train,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        """Shuffled, full batches only (every optimizer step sees exactly ``batch_size`` samples)."""
        return self._loader(self._datasets()[0], train=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self._datasets()[1], train=False)

    @override
    def test_dataloader(self) -> DataLoader:
        """The held-out text again: the corpus has no separate test split."""
        return self._loader(self._datasets()[1], train=False)

    @override
    def predict_dataloader(self) -> DataLoader:
        """The held-out text, in order: ``predict`` scores each window (see ``GPTModule.predict_step``)."""
        return self._loader(self._datasets()[1], train=False)
