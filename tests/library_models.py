"""Models nobody here wrote, built tiny from configs (no downloads): HF transformers and litgpt.

``LibraryLM`` is the LightningModule a user would write: it holds the library model as
``self.model`` and its ``training_step`` is the standard one, nothing Cephalo-specific.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from tests.reference import steps_of, target_tokens, train_steps, with_moments

VOCAB = 48
SEQ = 12


def with_lora(model: torch.nn.Module, r: int = 4) -> torch.nn.Module:
    """``model`` with peft LoRA adapters on the attention's query and value projections (the base frozen)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0))


def build(family: str, tie: bool | None = None, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if family == "litgpt":
        from litgpt.config import Config
        from litgpt.model import GPT

        config = Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=16,
                        intermediate_size=32, bias=False, rotary_percentage=1.0, parallel_residual=False,
                        norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP")
        model = GPT(config)
        model.apply(model._init_weights)
        return model
    import transformers

    common = dict(vocab_size=VOCAB, attn_implementation="eager")
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=SEQ, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, **common)
        cls = transformers.GPT2LMHeadModel
    elif family == "llama":
        config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
                                          **common)
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        config = transformers.Qwen2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
                                          **common)
        cls = transformers.Qwen2ForCausalLM
    elif family == "gpt_neox":
        config = transformers.GPTNeoXConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, max_position_embeddings=SEQ, rotary_pct=0.5,
                                            hidden_dropout=0.0, attention_dropout=0.0, **common)
        cls = transformers.GPTNeoXForCausalLM
    else:
        raise ValueError(family)
    if tie is not None:
        config.tie_word_embeddings = tie
    return cls(config)


class PaddedTokens(Dataset):
    """Right-padded token sequences of random lengths; labels -100 on the padding."""

    def __init__(self, n: int, seed: int = 3) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, SEQ), generator=gen)
        self.lengths = torch.randint(2, SEQ + 1, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(SEQ) < self.lengths[i]).long()
        return {"input_ids": self.ids[i] * mask, "attention_mask": mask,
                "labels": torch.where(mask.bool(), self.ids[i], torch.full_like(self.ids[i], -100))}

    def batch(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        items = [self[i] for i in range(start, stop)]
        return {k: torch.stack([item[k] for item in items]) for k in items[0]}


def litgpt_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from litgpt.utils import chunked_cross_entropy

    return chunked_cross_entropy(logits[..., :-1, :], labels[..., 1:])


class LibraryLM(pl.LightningModule):
    """What a user writes around a library causal LM; nothing here knows about Cephalo."""

    def __init__(self, family: str, optimizer: str = "sgd", tie: bool | None = None,
                 checkpointing: bool = False) -> None:
        super().__init__()
        self.family = family
        self.optimizer_name = optimizer
        self.model = build(family, tie)
        if optimizer == "lora":  # peft LoRA adapters, AdamW over them alone
            self.model = with_lora(self.model)
        if checkpointing:  # what HF users turn on to save memory: each layer recomputed in the backward
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def training_step(self, batch, batch_idx):
        if self.family == "litgpt":
            return litgpt_loss(self.model(batch["input_ids"]), batch["labels"])
        return self.model(**batch).loss

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.5)
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def reference(family: str, optimizer: str, steps: int, global_batch: int, data: PaddedTokens,
              dtype: torch.dtype = torch.float32, tie: bool | None = None,
              micro_batches: tuple[int, ...] | None = None, items_in_batch: bool = False) -> dict[str, torch.Tensor]:
    """Single-process training on the same global batches: parameters (and Adam moments).

    ``micro_batches``: sizes that split each global batch, the gradients accumulated with each
    micro-batch's loss weighted by its share of the batch's target tokens, which is the same
    maths in another summation order (what :func:`noise_floor` compares). ``items_in_batch``: a
    Hugging Face model divides each micro-batch's summed loss by the batch's target tokens itself
    (``num_items_in_batch``) instead; its loss runs in fp32 whatever the model's precision, so in
    fp64 only this cut keeps every per-token gradient the whole batch's."""
    module = LibraryLM(family, optimizer, tie).to(dtype)
    opt = module.configure_optimizers()
    pieces = steps_of(data.batch, steps, global_batch, micro_batches, target_tokens)
    if micro_batches is not None and items_in_batch:  # each micro-batch's summed loss over the batch's tokens
        totals = [target_tokens(data.batch(s * global_batch, (s + 1) * global_batch)) for s in range(steps)]
        pieces = [[({**micro, "num_items_in_batch": total}, 1.0) for micro, _ in step]
                  for step, total in zip(pieces, totals)]
    train_steps(opt, lambda batch: module.training_step(batch, 0), pieces)
    return with_moments({name: p.detach().clone() for name, p in module.named_parameters()},
                        module.named_parameters(), opt)


def pipeline_reference(family: str, steps: int, global_batch: int, cuts: tuple[int, ...] | None = None,
                       clip: float | None = None, losses: list | None = None,
                       samples: int | None = None) -> dict[str, torch.Tensor]:
    """Single-process AdamW training in fp64 on :class:`PaddedTokens`' global batches (``cuts``: each
    cut into those micro-batches, each summed loss over the batch's tokens, Hugging Face's
    ``num_items_in_batch``), clipped to global norm ``clip``: the parameters by their model names
    (``losses``: each step's loss appended; ``samples``: the dataset's size, by default the steps')."""
    data = PaddedTokens(samples or global_batch * steps)
    module = LibraryLM(family, "adamw").to(torch.float64)
    pieces = steps_of(data.batch, steps, global_batch, cuts, target_tokens)
    if cuts is not None:
        totals = [target_tokens(data.batch(s * global_batch, (s + 1) * global_batch)) for s in range(steps)]
        pieces = [[({**micro, "num_items_in_batch": total}, 1.0) for micro, _ in step] for step, total in zip(pieces, totals)]
    trained = train_steps(module.configure_optimizers(), lambda batch: module.training_step(batch, 0), pieces, clip)
    if losses is not None:
        losses.extend(trained)
    return {name.removeprefix("model."): p.detach().clone() for name, p in module.named_parameters()}


def noise_floor(family: str, optimizer: str, steps: int, global_batch: int, data: PaddedTokens,
                dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Per tensor: how far apart two single-process runs of the same maths land when only the
    summation order differs (the whole global batch at once vs micro-batches of 5, 4 and 3)."""
    whole = reference(family, optimizer, steps, global_batch, data, dtype)
    split = reference(family, optimizer, steps, global_batch, data, dtype, micro_batches=(5, 4, 3))
    return {name: (whole[name] - split[name]).abs().max().item() for name in whole}


def loader(data: PaddedTokens, batch_size: int) -> DataLoader:
    return DataLoader(data, batch_size=batch_size, shuffle=False)
