"""Fine-tuning data from local files, tokenised by the model's own tokenizer: every item is ``seq_len`` long.

One item, ``n`` real tokens padded to ``seq_len``::

    input_ids      = t_1 .. t_n  f .. f          f = the pad token, else the end-of-sequence token, else 0
    attention_mask = 1   .. 1    0 .. 0
    labels         = l_1 .. l_n  -100 .. -100    l_i = t_i, or -100 where t_i is a prompt token

A label of -100 carries no loss (the causal-LM loss averages over the other labels), so the fill id
never reaches the loss and a tokenizer without a pad token (Llama-3, Mistral) pads with its
end-of-sequence token. Two sources:

* ``TextFilesDataModule``: the ``*.txt`` files of a folder, each followed by the end-of-sequence
  token, cut into ``seq_len`` blocks (the last one padded);
* ``InstructionDataModule``: prompt/response records from local JSON (a list of objects) or JSONL
  (one object a line) files; ``prompt + response + eos`` truncated to ``seq_len``, the prompt's
  labels -100, so only the response is learnt.

Tokenizers are read from a local directory only (``local_files_only``): nothing is downloaded.
``transformers`` is imported lazily (the ``[hf]`` extra).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from cephalo_lightning._common.errors import ConfigurationError

IGNORE = -100
SAMPLE_TEXT = (
    "Cephalo trains transformers on clusters of unlike GPUs: each GPU gets its own batch, its own number of "
    "micro-batches and its own share of the sharded state. ",
    "A pretrained model is fine-tuned with small LoRA adapters while its base weights stay frozen; the planner "
    "charges the frozen weights their stored bytes and the adapters their full training state. ",
    "After training, the adapters are saved on their own and a merged model is exported for inference. ",
)
RECORD_SUFFIXES = (".json", ".jsonl")


def write_sample_texts(folder: str | Path, copies: int = 8) -> Path:
    """A few local text files to fine-tune on (no download)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(SAMPLE_TEXT):
        (folder / f"part-{i}.txt").write_text(text * copies)
    return folder


def text_files(folder: str | Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.txt file; put the training text there")
    return files


def local_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved in a local directory (a ``save_pretrained`` one); a hub name is refused, not fetched."""
    import transformers

    if not Path(path).is_dir():
        raise ConfigurationError(
            f"tokenizer {str(path)!r} is not a local directory: give the model's save_pretrained directory (download "
            "it once with `huggingface-cli download NAME --local-dir DIR` on a machine with network access)")
    return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@dataclass(frozen=True)
class Fill:
    """What an item's padded positions hold: ``id`` in ``input_ids``, -100 in ``labels``."""

    id: int
    eos: int | None  # the end-of-sequence id appended after each text or response (None: the tokenizer has none)

    @classmethod
    def of(cls, tokenizer: Any) -> Fill:
        """The pad token, else the end-of-sequence token (Llama-3 and Mistral have no pad token), else 0."""
        pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
        return cls(pad if pad is not None else eos if eos is not None else 0, eos)

    def item(self, ids: Sequence[int], labels: Sequence[int], seq_len: int) -> dict[str, torch.Tensor]:
        """``ids`` and ``labels`` (as long as each other, at most ``seq_len``) padded to ``seq_len``."""
        pad = seq_len - len(ids)
        return {"input_ids": torch.tensor([*ids, *[self.id] * pad], dtype=torch.long),
                "attention_mask": torch.tensor([1] * len(ids) + [0] * pad, dtype=torch.long),
                "labels": torch.tensor([*labels, *[IGNORE] * pad], dtype=torch.long)}


class TokenizedText(Dataset):
    """Local text files tokenised and cut into ``seq_len``-token blocks (map-style)."""

    def __init__(self, folder: str | Path, tokenizer: str | Path, seq_len: int) -> None:
        tok = local_tokenizer(tokenizer)
        self.fill, self.seq_len = Fill.of(tok), seq_len
        end = [] if self.fill.eos is None else [self.fill.eos]
        ids = [i for f in text_files(folder) for i in tok(f.read_text())["input_ids"] + end]
        self.blocks = [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.fill.item(self.blocks[i], self.blocks[i], self.seq_len)


def record_files(path: str | Path) -> list[Path]:
    """``path`` itself (a ``.json`` or ``.jsonl`` file), or the ones in the folder ``path``."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.glob("*") if p.suffix in RECORD_SUFFIXES)
    if not files or any(f.suffix not in RECORD_SUFFIXES for f in files):
        raise ConfigurationError(f"instruction data {str(path)!r} must be a .json or .jsonl file, or a folder holding "
                                 "some (local files: nothing is downloaded)")
    return files


def read_records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(where, record)`` for every record of a JSON list or a JSONL file; ``where`` is ``file:line`` or ``file[i]``."""
    text = path.read_text()
    try:
        if path.suffix == ".jsonl":
            return [(f"{path}:{n}", json.loads(line)) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        records = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigurationError(f"{path}: not valid {path.suffix[1:].upper()} ({err})") from None
    if not isinstance(records, list):
        raise ConfigurationError(f"{path}: a .json file holds a list of records, got a {type(records).__name__}; "
                                 "write [{\"prompt\": ..., \"response\": ...}, ...] or one record a line in a .jsonl")
    return [(f"{path}[{i}]", record) for i, record in enumerate(records)]


class InstructionData(Dataset):
    """Prompt/response records, tokenised: the prompt's labels -100, the response's its tokens (map-style)."""

    def __init__(self, data: str | Path, tokenizer: str | Path, seq_len: int, prompt_key: str = "prompt",
                 response_key: str = "response") -> None:
        tok = local_tokenizer(tokenizer)
        self.fill, self.seq_len = Fill.of(tok), seq_len
        end = [] if self.fill.eos is None else [self.fill.eos]
        self.examples: list[tuple[list[int], list[int]]] = []
        too_long: list[str] = []
        for where, record in (r for f in record_files(data) for r in read_records(f)):
            if not isinstance(record, dict) or not isinstance(record.get(prompt_key), str) \
                    or not isinstance(record.get(response_key), str):
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ConfigurationError(f"{where}: a record needs the strings {prompt_key!r} and {response_key!r}, "
                                         f"got {keys}; name other keys with prompt_key= / response_key=")
            prompt = tok(record[prompt_key])["input_ids"]  # the tokenizer's own special tokens (Llama's BOS)
            if len(prompt) >= seq_len:
                too_long.append(where)
                continue
            response = tok(record[response_key], add_special_tokens=False)["input_ids"] + end
            self.examples.append(((prompt + response)[:seq_len], ([IGNORE] * len(prompt) + response)[:seq_len]))
        if too_long:
            message = (f"{len(too_long)} record(s) have a prompt of seq_len={seq_len} tokens or more, so no response "
                       f"token to learn (the first: {too_long[0]})")
            if not self.examples:
                raise ConfigurationError(f"{message}, and no other record: raise seq_len or shorten the prompts")
            rank_zero_warn(f"{message}: left out; raise seq_len to keep them")

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, labels = self.examples[i]
        return self.fill.item(ids, labels, self.seq_len)


class TextFilesDataModule(pl.LightningDataModule):
    """``TokenizedText`` of ``text_dir`` with the tokenizer saved in ``tokenizer`` (the pretrained directory)."""

    def __init__(self, text_dir: str, tokenizer: str, seq_len: int = 32, batch_size: int = 8) -> None:
        super().__init__()
        self.text_dir, self.tokenizer, self.seq_len, self.batch_size = text_dir, tokenizer, seq_len, batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenizedText(self.text_dir, self.tokenizer, self.seq_len), batch_size=self.batch_size,
                          shuffle=False)


class InstructionDataModule(pl.LightningDataModule):
    """``InstructionData`` of ``data`` (a .json/.jsonl file or a folder of them) with the tokenizer saved in
    ``tokenizer`` (the pretrained directory). ``batch_size`` is the global batch under the Cephalo
    strategy; ``shuffle`` draws the same order on every rank (the strategy seeds it)."""

    def __init__(self, data: str, tokenizer: str, seq_len: int = 512, batch_size: int = 8, prompt_key: str = "prompt",
                 response_key: str = "response", shuffle: bool = True, num_workers: int = 0) -> None:
        super().__init__()
        self.data, self.tokenizer, self.seq_len, self.batch_size = data, tokenizer, seq_len, batch_size
        self.prompt_key, self.response_key, self.shuffle, self.num_workers = prompt_key, response_key, shuffle, num_workers

    def train_dataloader(self) -> DataLoader:
        data = InstructionData(self.data, self.tokenizer, self.seq_len, self.prompt_key, self.response_key)
        return DataLoader(data, batch_size=self.batch_size, shuffle=self.shuffle, num_workers=self.num_workers)
