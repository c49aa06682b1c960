"""The fine-tuning workload: a pretrained Hugging Face causal LM with peft LoRA adapters, local text files.

``LoraCausalLM`` builds the model named by a local ``save_pretrained`` directory in
``configure_model()`` (on the meta device under the Cephalo strategy; the weights then come from
``CephaloStrategy(pretrained=DIR)``, each rank reading its shard's slices), wraps it with LoRA
adapters (``peft.get_peft_model``; the base frozen, AdamW over the adapters alone) and may compile
each decoder block in place. ``TextFilesDataModule`` tokenises local text files with the model's
own tokenizer into a map-style dataset of fixed-length blocks (labels = the tokens; the last block
padded, its padding ignored as -100). ``make_pretrained`` writes a tiny pretrained directory (a
Llama config and a byte-level BPE tokenizer trained on the given files) for runs that must not
download anything. Everything is imported lazily: ``transformers``, ``peft`` and ``tokenizers`` are
the ``[hf]`` extra.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

IGNORE = -100
SAMPLE_TEXT = (
    "Cephalo trains transformers on clusters of unlike GPUs: each GPU gets its own batch, its own number of "
    "micro-batches and its own share of the sharded state. ",
    "A pretrained model is fine-tuned with small LoRA adapters while its base weights stay frozen; the planner "
    "charges the frozen weights their stored bytes and the adapters their full training state. ",
    "After training, the adapters are saved on their own and a merged model is exported for inference. ",
)


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


def make_pretrained(path: str | Path, texts: str | Path, hidden_size: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A tiny "pretrained" Llama as a ``save_pretrained`` directory, with a byte-level BPE tokenizer
    trained on ``texts``' files (a stand-in for a downloaded checkpoint)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(f) for f in text_files(texts)], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")
    config = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, pad_token_id=fast.pad_token_id,
                                      bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    fast.save_pretrained(path)
    return path


class TokenizedText(Dataset):
    """Local text files tokenised and cut into ``seq_len``-token blocks (map-style)."""

    def __init__(self, folder: str | Path, tokenizer: str | Path, seq_len: int) -> None:
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer))
        ids = [i for f in text_files(folder) for i in tok(f.read_text())["input_ids"] + [tok.eos_token_id]]
        self.blocks = [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]
        self.seq_len, self.pad = seq_len, tok.pad_token_id

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        block = self.blocks[i]
        pad = self.seq_len - len(block)
        ids = torch.tensor(block + [self.pad] * pad)
        mask = torch.tensor([1] * len(block) + [0] * pad)
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, IGNORE)}


class TextFilesDataModule(pl.LightningDataModule):
    """``TokenizedText`` of ``text_dir`` with the tokenizer saved in ``tokenizer`` (the pretrained directory)."""

    def __init__(self, text_dir: str, tokenizer: str, seq_len: int = 32, batch_size: int = 8) -> None:
        super().__init__()
        self.text_dir, self.tokenizer, self.seq_len, self.batch_size = text_dir, tokenizer, seq_len, batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenizedText(self.text_dir, self.tokenizer, self.seq_len), batch_size=self.batch_size,
                          shuffle=False)


class LoraCausalLM(pl.LightningModule):
    """A pretrained causal LM (``base``: a ``save_pretrained`` directory) with LoRA adapters on
    ``targets``; the base's weights come from ``CephaloStrategy(pretrained=base)`` (or, without the
    strategy, ``from_pretrained``). ``compile``: compile each decoder block in place."""

    def __init__(self, base: str, r: int = 8, alpha: int = 16, targets: Sequence[str] = ("q_proj", "v_proj"),
                 lr: float = 1e-3, compile: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.base, self.r, self.alpha, self.targets, self.lr, self.compile_blocks = base, r, alpha, list(targets), lr, compile

    def configure_model(self) -> None:
        import transformers
        from peft import LoraConfig, get_peft_model

        if hasattr(self, "model"):
            return
        config = transformers.AutoConfig.from_pretrained(self.base)
        lm = transformers.AutoModelForCausalLM.from_config(config)  # weights: CephaloStrategy(pretrained=base)
        self.model = get_peft_model(lm, LoraConfig(r=self.r, lora_alpha=self.alpha, target_modules=self.targets,
                                                   lora_dropout=0.0))
        if self.compile_blocks:
            for block in self.model.base_model.model.model.layers:
                block.compile()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True, batch_size=batch["input_ids"].size(0))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)
