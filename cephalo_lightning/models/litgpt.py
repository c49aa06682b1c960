"""litgpt's ``GPT`` in the layered schedule, with no code from the user.

The layers are the token embedding, every block (called with the rope cache and mask the model's
forward passes, :mod:`.capture`) and the final norm with the head (and litgpt's final logit
soft-capping where configured). Batches follow litgpt's fine-tuning convention: dicts with
``input_ids`` and ``labels`` (-100 ignored), and the loss is the mean cross entropy of the logits
at position t against the label at t + 1 over every label that is not ignored, weighted by their
count. ``litgpt`` is imported only when such a model is seen.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cephalo_lightning._common.errors import UnsupportedError
from cephalo_lightning.models.capture import first_block_call
from cephalo_lightning.models.hf import IGNORE_INDEX, label_count
from cephalo_lightning.models.protocol import LayeredModel, LossWeighting
from cephalo_lightning.runtime.layered import Layer


def find_gpt(module: nn.Module) -> nn.Module | None:
    if "litgpt" not in sys.modules and "litgpt.model" not in sys.modules:
        return None
    from litgpt.model import GPT

    for sub in module.modules():
        if isinstance(sub, GPT):
            return sub
    return None


def shifted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, total: float | None = None) -> torch.Tensor:
    """Cross entropy of ``logits[:, t]`` against ``labels[:, t + 1]`` (litgpt's fine-tuning loss):
    the mean over the non-ignored labels, or their sum over ``total`` (a share of a larger batch's mean)."""
    flat_logits, flat_labels = logits[..., :-1, :].reshape(-1, logits.size(-1)).float(), labels[..., 1:].reshape(-1)
    if total is None:
        return F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX)
    summed = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return summed / torch.tensor(total, dtype=summed.dtype, device=summed.device)


def adapt(gpt: nn.Module) -> tuple[LayeredModel | None, str]:
    config = gpt.config
    if getattr(config, "rope_indices", None) is not None:
        return None, "this litgpt GPT gives its blocks different rope slices (rope_indices)"
    blocks = list(gpt.transformer.h)
    wte, ln_f, head = gpt.transformer.wte, gpt.transformer.ln_f, gpt.lm_head
    softcap = getattr(config, "final_logit_softcapping", None)

    def block_call(ids: torch.Tensor):  # noqa: ANN202
        return first_block_call(blocks[0], lambda: gpt(ids))

    def prepare(micro_batch: Any) -> tuple[torch.Tensor, Any]:
        if not isinstance(micro_batch, dict) or "input_ids" not in micro_batch or "labels" not in micro_batch:
            raise UnsupportedError("a litgpt GPT in the layered mode takes dict batches with 'input_ids' and 'labels'")
        return micro_batch["input_ids"], block_call(micro_batch["input_ids"])

    def run_head(h: torch.Tensor, side: Any) -> torch.Tensor:
        logits = head(ln_f(h))
        if softcap is not None:
            from litgpt.model import do_softcapping

            logits = do_softcapping(logits, softcap)
        return logits

    layers = [Layer((wte,), lambda ids, side: block_call(ids).hidden, "wte")]
    layers += [Layer((b,), lambda h, side, b=b: side.run(b, h), f"block {i}") for i, b in enumerate(blocks)]
    layers.append(Layer((ln_f, head), run_head, "head"))
    return LayeredModel(
        tuple(layers), prepare, lambda logits, mb, side: shifted_cross_entropy(logits, mb["labels"]),
        LossWeighting("items", label_count, lambda logits, mb, side, total: shifted_cross_entropy(logits, mb["labels"], total)),
        "litgpt GPT", derived=True), ""


def init_weights(gpt: nn.Module):  # noqa: ANN201 - returns an InitFn
    """litgpt's initialisation: ``GPT._init_weights`` for linear and embedding layers, the rope
    cache (``GPT.reset_parameters``) for the model's own buffers, ``reset_parameters`` elsewhere."""

    def init(module: nn.Module) -> None:
        if module is gpt:
            gpt.reset_parameters()
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            gpt._init_weights(module)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()

    return init
