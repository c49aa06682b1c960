"""The fine-tuning workload: a pretrained Hugging Face causal LM, trained whole or through peft LoRA adapters.

``CausalLM`` builds the model named by a local ``save_pretrained`` directory in
``configure_model()`` (on the meta device under the Cephalo strategy; the weights then come from
``CephaloStrategy(pretrained=DIR)``, each rank reading its shard's slices) and trains every
parameter: AdamW, the learning rate warmed up linearly over ``warmup_steps``::

    lr(step) = lr x min(1, (step + 1) / (warmup_steps + 1))

``LoraCausalLM`` wraps the same model with LoRA adapters (``peft.get_peft_model``; the base frozen,
AdamW over the adapters alone). Both may compile each decoder block in place. The data modules are
in :mod:`.finetune_data`. ``make_pretrained`` writes a tiny pretrained directory (a Llama config and
a byte-level BPE tokenizer trained on the given files) for runs that must not download anything.
Everything is imported lazily: ``transformers``, ``peft`` and ``tokenizers`` are the ``[hf]`` extra.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning.demo.finetune_data import text_files


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


class CausalLM(pl.LightningModule):
    """A pretrained causal LM (``base``: a local ``save_pretrained`` directory), every parameter trained;
    the weights come from ``CephaloStrategy(pretrained=base)`` (or, without the strategy,
    ``from_pretrained``). ``compile``: compile each decoder block in place."""

    def __init__(self, base: str, lr: float = 1e-5, weight_decay: float = 0.0, warmup_steps: int = 0,
                 compile: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()  # a subclass's arguments too (Lightning collects every __init__'s)
        if not Path(base).is_dir():
            raise ConfigurationError(
                f"{type(self).__name__}(base={base!r}) is not a local directory: give the model's save_pretrained "
                "directory (download it once with `huggingface-cli download NAME --local-dir DIR`)")
        self.base, self.lr, self.weight_decay, self.warmup_steps = base, lr, weight_decay, warmup_steps
        self.compile_blocks = compile

    def wrap(self, lm: nn.Module) -> nn.Module:
        """The module trained around the built model (here the model itself)."""
        return lm

    def configure_model(self) -> None:
        import transformers

        from cephalo_lightning.models.hf import FAMILIES

        if hasattr(self, "model"):
            return
        config = transformers.AutoConfig.from_pretrained(self.base, local_files_only=True)
        lm = transformers.AutoModelForCausalLM.from_config(config)  # weights: CephaloStrategy(pretrained=base)
        self.model = self.wrap(lm)
        family = FAMILIES.get(config.model_type)
        if self.compile_blocks and family is not None:  # the blocks are lm's own, whatever wraps them
            for block in getattr(getattr(lm, family.backbone), family.blocks):
                block.compile()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True, batch_size=batch["input_ids"].size(0))
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr,
                                      weight_decay=self.weight_decay)
        if self.warmup_steps <= 0:
            return optimizer
        warmup = self.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LoraCausalLM(CausalLM):
    """``CausalLM`` with LoRA adapters on ``targets``: the base frozen, the adapters trained."""

    def __init__(self, base: str, r: int = 8, alpha: int = 16, targets: Sequence[str] = ("q_proj", "v_proj"),
                 lr: float = 1e-3, compile: bool = False, weight_decay: float = 0.0, warmup_steps: int = 0) -> None:
        super().__init__(base, lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps, compile=compile)
        self.r, self.alpha, self.targets = r, alpha, list(targets)

    def wrap(self, lm: nn.Module) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        return get_peft_model(lm, LoraConfig(r=self.r, lora_alpha=self.alpha, target_modules=self.targets,
                                             lora_dropout=0.0))
