"""Models no named adapter knows, built tiny from configs (no downloads), for the discovered layered mode.

``Wrapped`` is the LightningModule a user would write around each: ``training_step`` returns the
model's own loss (``self.model(**batch).loss``; a plain ``nn.TransformerEncoder`` model computes its
cross entropy itself). Batches are padded to random lengths where the model takes a mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests.reference import steps_of, target_tokens, train_steps

VOCAB = 64
SEQ = 8
HIDDEN = 16
IMAGE = 8

CAUSAL = ("gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "stablelm", "falcon", "gptj", "opt", "bloom",
          "mixtral", "qwen2_moe")
FAMILIES = CAUSAL + ("bert_mlm", "vit", "torch_encoder")


def _causal(family: str):  # noqa: ANN202 - (config class, model class)
    import transformers as t

    small = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=32, max_position_embeddings=32, bos_token_id=1, eos_token_id=2)
    table = {
        "gemma": (t.GemmaConfig, t.GemmaForCausalLM, dict(num_key_value_heads=1, head_dim=8)),
        "gemma2": (t.Gemma2Config, t.Gemma2ForCausalLM,
                   dict(num_key_value_heads=1, head_dim=8, final_logit_softcapping=3.0, attn_logit_softcapping=5.0,
                        sliding_window=4)),
        "gemma3_text": (t.Gemma3TextConfig, t.Gemma3ForCausalLM,
                        dict(num_key_value_heads=1, head_dim=8, sliding_window=4, sliding_window_pattern=2)),
        "phi3": (t.Phi3Config, t.Phi3ForCausalLM, dict(num_key_value_heads=1, pad_token_id=0)),
        "olmo2": (t.Olmo2Config, t.Olmo2ForCausalLM, dict(num_key_value_heads=1, pad_token_id=0)),
        "stablelm": (t.StableLmConfig, t.StableLmForCausalLM, dict(num_key_value_heads=1)),
        "falcon": (t.FalconConfig, t.FalconForCausalLM, dict(new_decoder_architecture=False, multi_query=True)),
        "gptj": (t.GPTJConfig, t.GPTJForCausalLM, dict(n_embd=HIDDEN, n_layer=2, n_head=2, rotary_dim=4, n_positions=32,
                                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "opt": (t.OPTConfig, t.OPTForCausalLM, dict(ffn_dim=32, word_embed_proj_dim=HIDDEN, dropout=0.0,
                                                   pad_token_id=0)),
        "bloom": (t.BloomConfig, t.BloomForCausalLM, dict(n_layer=2, n_head=2, hidden_dropout=0.0,
                                                         attention_dropout=0.0)),
        "mixtral": (t.MixtralConfig, t.MixtralForCausalLM,
                    dict(num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)),
        # named adapters (tests/runtime/test_meta_buffers.py builds them on the meta device beside the families above)
        "llama": (t.LlamaConfig, t.LlamaForCausalLM, dict(num_key_value_heads=1)),
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM, dict(num_key_value_heads=1, head_dim=8)),
        "gpt_neox": (t.GPTNeoXConfig, t.GPTNeoXForCausalLM, dict(rotary_pct=0.5)),
        "qwen2_moe": (t.Qwen2MoeConfig, t.Qwen2MoeForCausalLM,
                      dict(num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                           shared_expert_intermediate_size=16)),
    }
    config_cls, model_cls, extra = table[family]
    fields = {**small, **extra}
    if family in ("gptj", "bloom"):
        fields = {k: v for k, v in fields.items() if k not in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                               "intermediate_size", "max_position_embeddings")}
        if family == "bloom":
            fields["hidden_size"] = HIDDEN
    if family == "opt":
        fields.pop("intermediate_size")
    return config_cls(**fields, attn_implementation="eager"), model_cls


class EncoderClassifier(nn.Module):
    """A plain ``nn.TransformerEncoder`` over token embeddings, mean-pooled, with a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor):  # noqa: ANN201
        h = self.encoder(self.embed(input_ids), src_key_padding_mask=attention_mask == 0)
        mask = attention_mask.unsqueeze(-1).to(h.dtype)
        logits = self.head((h * mask).sum(1) / mask.sum(1))
        return nn.functional.cross_entropy(logits, labels)


def build(family: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if family == "torch_encoder":
        return EncoderClassifier()
    import transformers as t

    if family == "bert_mlm":
        config = t.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0, attn_implementation="eager")
        return t.BertForMaskedLM(config)
    if family == "vit":
        config = t.ViTConfig(image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=HIDDEN, num_hidden_layers=2,
                             num_attention_heads=2, intermediate_size=32, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0, num_labels=3, attn_implementation="eager")
        return t.ViTForImageClassification(config)
    config, cls = _causal(family)
    for name in ("hidden_dropout", "attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout"):
        if hasattr(config, name) and isinstance(getattr(config, name), float):
            setattr(config, name, 0.0)
    return cls(config)


class Samples(Dataset):
    """Per family: right-padded token sequences of random lengths (labels -100 on the padding; BERT:
    labels on a random subset of positions from 1 on), or images with class labels."""

    def __init__(self, family: str, n: int, seed: int = 3) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.family = family
        self.ids = torch.randint(1, VOCAB, (n, SEQ), generator=gen)
        self.lengths = torch.randint(2, SEQ + 1, (n,), generator=gen)
        self.picked = torch.rand((n, SEQ), generator=gen) < 0.5
        self.pixels = torch.randn((n, 3, IMAGE, IMAGE), generator=gen)
        self.classes = torch.randint(0, 4 if family == "torch_encoder" else 3, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.family == "vit":
            return {"pixel_values": self.pixels[i], "labels": self.classes[i]}
        mask = (torch.arange(SEQ) < self.lengths[i]).long()
        ids = self.ids[i] * mask
        if self.family == "torch_encoder":
            return {"input_ids": ids, "attention_mask": mask, "labels": self.classes[i]}
        chosen = mask.bool()
        if self.family == "bert_mlm":  # masked positions from 1 on (position 0 is weighted apart: see the README)
            chosen = chosen & self.picked[i] & (torch.arange(SEQ) > 0)
            chosen[1] = True
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(chosen, self.ids[i], -100)}

    def batch(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        items = [self[i] for i in range(start, stop)]
        return {k: torch.stack([item[k] for item in items]) for k in items[0]}


def token_weighted(family: str) -> bool:
    """The model's loss is a mean over label tokens (not over samples)."""
    return family not in ("vit", "torch_encoder")


class Wrapped(pl.LightningModule):
    """What a user writes around the model; nothing here knows about Cephalo."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.model = build(family)

    def training_step(self, batch, batch_idx):
        out = self.model(**batch)
        return out if torch.is_tensor(out) else out.loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def reference(family: str, steps: int, global_batch: int, data: Samples,
              cuts: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """Single-process SGD on the same global batches: whole, or cut into ``cuts`` with each piece's loss
    weighted by its share of the batch's (the same training, its sums re-associated)."""
    module = Wrapped(family)
    count = target_tokens if token_weighted(family) else (lambda batch: len(batch["labels"]))
    train_steps(module.configure_optimizers(), lambda batch: module.training_step(batch, 0),
                steps_of(data.batch, steps, global_batch, cuts, count))
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def loader(data: Samples, batch_size: int) -> DataLoader:
    return DataLoader(data, batch_size=batch_size, shuffle=False)
