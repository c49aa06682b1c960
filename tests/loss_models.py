"""Models whose losses average over different items, built tiny from configs (no downloads).

A masked LM (labels anywhere, position 0 included), two encoder-decoders (T5, BART), a per-sample
mean of a model of its own, and a mixture-of-experts causal LM with the router's auxiliary loss:
what ``loss_weighting="auto"`` must tell apart. ``HFModule`` is what a user writes around them.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn

from tests.reference import steps_of, train_steps

VOCAB = 48
SEQ = 10
KINDS = ("bert", "t5", "bart", "per_sample")


def build(kind: str, seed: int = 0, **overrides) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "per_sample":
        return PerSampleMean()
    import transformers

    if kind == "bert":
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=32, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0, attn_implementation="eager")
        return transformers.BertForMaskedLM(config)
    if kind == "t5":
        config = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                       dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                                       attn_implementation="eager")
        return transformers.T5ForConditionalGeneration(config)
    if kind == "bart":
        config = transformers.BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
                                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                         decoder_ffn_dim=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                         max_position_embeddings=SEQ + 2, pad_token_id=1, bos_token_id=0,
                                         eos_token_id=2, decoder_start_token_id=2, attn_implementation="eager")
        return transformers.BartForConditionalGeneration(config)
    if kind == "mixtral":
        config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                            num_experts_per_tok=2, max_position_embeddings=16, router_jitter_noise=0.0,
                                            attn_implementation="eager", **{"output_router_logits": True, **overrides})
        return transformers.MixtralForCausalLM(config)
    raise ValueError(kind)


class PerSampleMean(nn.Module):
    """A model of its own whose loss is the mean over samples of each sample's mean over its
    labelled tokens: weighting it by tokens would be wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids, labels, attention_mask=None):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        per_token = nn.functional.cross_entropy(self.head(h).transpose(1, 2), labels.clamp(min=0), reduction="none")
        mask = (labels != -100).to(per_token.dtype)
        return ((per_token * mask).sum(1) / mask.sum(1)).mean()


def data(kind: str, n: int, seed: int = 5) -> list[dict[str, torch.Tensor]]:
    """``n`` samples of random lengths; every sample has at least one label, some at position 0."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=gen)
    lengths = torch.randint(3, SEQ + 1, (n,), generator=gen)
    mask = (torch.arange(SEQ) < lengths[:, None]).long()
    if kind in ("t5", "bart"):
        targets = torch.randint(3, VOCAB, (n, SEQ), generator=gen)
        target_lengths = torch.randint(1, SEQ + 1, (n,), generator=gen)
        labels = torch.where(torch.arange(SEQ) < target_lengths[:, None], targets, torch.full_like(targets, -100))
    else:  # masked-LM style: random positions labelled (position 0 for every third sample)
        chosen = (torch.rand(n, SEQ, generator=gen) < 0.3) & mask.bool()
        chosen[torch.arange(n) % 3 == 0, 0] = True
        chosen[torch.arange(n), lengths - 1] = True
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    return [{"input_ids": ids[i] * mask[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([item[k] for item in items]) for k in items[0]}


class HFModule(pl.LightningModule):
    """What a user writes around a model that returns its own loss; nothing here knows Cephalo."""

    def __init__(self, kind: str, **overrides) -> None:
        super().__init__()
        self.model = build(kind, **overrides)
        self.kind = kind

    def training_step(self, batch, batch_idx):
        out = self.model(**batch)
        return out if self.kind == "per_sample" else out.loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def reference(kind: str, steps: int, global_batch: int, samples: list[dict[str, torch.Tensor]],
              split: tuple[int, ...] | None = None, count=None, **overrides) -> dict[str, torch.Tensor]:
    """Single-process training on the global batches; with ``split`` the same maths micro-batched
    (each micro-batch's mean weighted by ``count``'s share), which differs only in summation order."""
    module = HFModule(kind, **overrides)
    train_steps(module.configure_optimizers(), lambda batch: module.training_step(batch, 0),
                steps_of(lambda lo, hi: collate(samples[lo:hi]), steps, global_batch, split, count))
    return {name: p.detach().clone() for name, p in module.named_parameters()}
