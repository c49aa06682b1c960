"""Hugging Face ``transformers`` causal LMs in the layered schedule, with no code from the user.

A LightningModule that holds a ``*ForCausalLM`` (under any attribute) and trains it on dict
batches (``input_ids``, optionally ``attention_mask`` and others, ``labels`` with -100 for
ignored positions) is run layer by layer: the embedding, every decoder block, and the final norm
with the LM head. Blocks are called exactly as the model's own forward calls them
(:mod:`.capture`), so padding masks, position ids and rotary embeddings are the model's own. The
loss is the model's own ``loss_function`` (the mean over non-ignored, shifted labels), weighted by
the number of those labels (:class:`~.protocol.LossWeighting`), so the gradient equals
single-process training on the global batch whatever the plan. Weights tied between the
embedding and the head stay tied (the engine shards them once).

Supported families (``config.model_type``): Llama, Mistral, Qwen2, Qwen3 (one decoder layout),
GPT-2, GPT-NeoX. ``transformers`` is imported only when such a model is seen.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cephalo_lightning._common.errors import UnsupportedError
from cephalo_lightning.models.capture import BlockCall, first_block_call
from cephalo_lightning.models.lora import lora_layers
from cephalo_lightning.models.protocol import LayeredModel, LossWeighting
from cephalo_lightning.models.weighting import IGNORE_INDEX, hf_model, shifted_label_tokens  # noqa: F401 - litgpt uses IGNORE_INDEX
from cephalo_lightning.runtime.layered import Layer


@dataclass(frozen=True)
class Family:
    backbone: str  # attribute of the *ForCausalLM holding the base model
    embeddings: tuple[str, ...]  # the base model's embedding modules (the first layer)
    blocks: str  # the base model's ModuleList of decoder blocks
    final_norm: str  # the base model's norm after the blocks (part of the last layer, with the head)
    head: str = "lm_head"


_LLAMA = Family("model", ("embed_tokens",), "layers", "norm")
FAMILIES: dict[str, Family] = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA,
    "gpt2": Family("transformer", ("wte", "wpe"), "h", "ln_f"),
    "gpt_neox": Family("gpt_neox", ("embed_in",), "layers", "final_layer_norm"),
}


def find_causal_lm(module: nn.Module) -> nn.Module | None:
    """The outermost ``transformers.PreTrainedModel`` with a language-model head under ``module``."""
    if "transformers" not in sys.modules:  # nothing built from transformers can be here
        return None
    from transformers import PreTrainedModel

    for sub in module.modules():
        if isinstance(sub, PreTrainedModel) and hasattr(sub, "lm_head"):
            return sub
    return None


def find_pretrained(module: nn.Module) -> nn.Module | None:
    """The outermost ``transformers.PreTrainedModel`` under ``module``, whatever its head: the one
    whose ``_init_weights`` initialises the model as ``from_config`` would."""
    if "transformers" not in sys.modules:
        return None
    from transformers import PreTrainedModel

    return next((sub for sub in module.modules() if isinstance(sub, PreTrainedModel)), None)


label_count = shifted_label_tokens  # what the causal-LM loss averages over (see :mod:`.weighting`)


@dataclass(frozen=True)
class _Side:
    inputs: dict[str, Any]  # the micro-batch's model inputs (everything but the labels)
    block: BlockCall  # what the model passes to its blocks


def adapt(lm: nn.Module) -> tuple[LayeredModel | None, str]:
    """The layered form of a causal LM, or ``(None, why not)``."""
    config = lm.config
    family = FAMILIES.get(getattr(config, "model_type", ""))
    if family is None:
        return None, (f"{type(lm).__name__} (model_type {getattr(config, 'model_type', '?')!r}) is not a supported family "
                      f"({', '.join(sorted(FAMILIES))})")
    base = getattr(lm, family.backbone, None)
    blocks = getattr(base, family.blocks, None) if base is not None else None
    if not isinstance(blocks, nn.ModuleList) or not len(blocks):
        return None, f"{type(lm).__name__} does not have the {family.backbone}.{family.blocks} layout this adapter expects"
    blocks = list(blocks)[: getattr(config, "num_hidden_layers", len(blocks))]
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and len(set(layer_types[: len(blocks)])) > 1:
        return None, f"{type(lm).__name__} mixes attention types per layer ({sorted(set(layer_types))})"
    embeddings = tuple(getattr(base, name) for name in family.embeddings)
    norm, head = getattr(base, family.final_norm), getattr(lm, family.head)
    first = blocks[0]

    def block_call(inputs: dict[str, Any]) -> BlockCall:
        return first_block_call(first, lambda: base(**inputs, use_cache=False))

    def prepare(micro_batch: Any) -> tuple[torch.Tensor, _Side]:
        if not isinstance(micro_batch, dict) or "input_ids" not in micro_batch or "labels" not in micro_batch:
            raise UnsupportedError(
                f"{type(lm).__name__} in the layered mode takes dict batches with 'input_ids' and 'labels' (and "
                f"optionally 'attention_mask'); got {type(micro_batch).__name__}"
                + (f" with keys {sorted(micro_batch)}" if isinstance(micro_batch, dict) else "")
            )
        inputs = {k: v for k, v in micro_batch.items() if k != "labels"}
        return inputs["input_ids"], _Side(inputs, block_call(inputs))

    layers = [Layer(embeddings, lambda ids, side: block_call({**side.inputs, "input_ids": ids}).hidden, "embeddings")]
    for index, block in enumerate(blocks):
        layers.append(Layer((block,), lambda h, side, block=block: side.block.run(block, h), f"block {index}"))
    layers.append(Layer((norm, head), lambda h, side: head(norm(h)), "head"))

    def loss(logits: torch.Tensor, micro_batch: Any, side: _Side) -> torch.Tensor:
        return lm.loss_function(logits=logits, labels=micro_batch["labels"], vocab_size=config.vocab_size)

    def share(logits: torch.Tensor, micro_batch: Any, side: _Side, total: float) -> torch.Tensor:
        items = torch.tensor(total, dtype=torch.float32, device=logits.device)
        return lm.loss_function(logits=logits, labels=micro_batch["labels"], vocab_size=config.vocab_size,
                                num_items_in_batch=items)

    return LayeredModel(tuple(layers), prepare, loss, LossWeighting("items", label_count, share),
                        f"{type(lm).__name__} ({config.model_type})", derived=True), ""


def init_weights(lm: nn.Module):  # noqa: ANN201 - returns an InitFn
    """The model's own per-module initialisation (``PreTrainedModel._init_weights``), for meta init."""

    def init(module: nn.Module) -> None:
        lm._init_weights(module)

    return init


def checkpoint_info(module: nn.Module) -> dict[str, Any]:
    """What a checkpoint records so an export can write a ``save_pretrained`` directory from it
    (:mod:`cephalo_lightning.runtime.checkpoint.export`): the Hugging Face model's config, class,
    generation config and attribute path in ``module``, and its peft LoRA layers (merged on export);
    nothing for a module without one."""
    model = hf_model(module)
    if model is None:
        return {}
    path = next(name for name, sub in module.named_modules() if sub is model)
    generation = getattr(model, "generation_config", None) if model.can_generate() else None
    return {"hf": {
        "prefix": f"{path}." if path else "",
        "class": type(model).__name__,
        "config": json.loads(model.config.to_json_string(use_diff=False)),
        "generation_config": json.loads(generation.to_json_string(use_diff=True)) if generation is not None else None,
        "lora": lora_layers(model),
    }}
