"""What a model's loss averages over, decided from its structure: how micro-batch losses are weighted.

The gradient equals single-process training on the global batch when every micro-batch's mean
loss is weighted by the items that mean is over, counted over the whole global batch
(:class:`~.protocol.LossWeighting`). Which items those are is a property of the loss the model
defines, so it is read from the model's structure, never guessed from an attribute name:

* a Hugging Face causal LM (``*ForCausalLM``, ``*LMHeadModel``) shifts its labels: the mean is over
  the labels after each row's first that are not -100;
* a masked LM (``*ForMaskedLM``), token classification (``*ForTokenClassification``) and an
  encoder-decoder's generation head (``config.is_encoder_decoder``: T5, BART) do not shift: every
  label that is not -100, position 0 included;
* sequence, image, audio classification, multiple choice and question answering average over samples;
* the layered protocol says it itself (``cephalo_loss_items``, else samples).

Where none of these applies (a model of its own, a head not listed) the choice is samples, said
once at setup with how to change it. A mixture-of-experts model that adds its router's auxiliary
loss (``output_router_logits=True``) is also said at setup: that term is a statistic of each
micro-batch, so its value depends on how the plan cuts the batch;
``CephaloStrategy(router_aux_loss="exclude")`` trains the token loss alone, exactly.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from cephalo_lightning.models.protocol import LayeredModel, LossWeighting

IGNORE_INDEX = -100
Kind = Literal["shifted", "unshifted", "samples"]

_SAMPLE_HEADS = ("ForSequenceClassification", "ForImageClassification", "ForAudioClassification",
                 "ForVideoClassification", "ForMultipleChoice", "ForQuestionAnswering", "ForImageClassificationWithTeacher")
_UNSHIFTED_HEADS = ("ForMaskedLM", "ForTokenClassification")
_CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")


def shifted_label_tokens(micro_batch: Any) -> int:
    """Labels a causal LM's loss averages over: every label after a row's first that is not -100."""
    return int((micro_batch["labels"][..., 1:] != IGNORE_INDEX).sum())


def label_tokens(micro_batch: Any) -> int:
    """Labels an unshifted token loss averages over: every label that is not -100."""
    return int((micro_batch["labels"] != IGNORE_INDEX).sum())


_COUNTS = {"shifted": shifted_label_tokens, "unshifted": label_tokens}
_WORDS = {"shifted": "tokens (non-ignored labels after each row's first: a causal LM's shifted loss)",
          "unshifted": "tokens (every non-ignored label, position 0 included: an unshifted token loss)",
          "samples": "samples"}


@dataclass(frozen=True)
class Decision:
    """The weighting a fit applies, the setup log's words for it, and what to say once at setup."""

    weighting: LossWeighting
    words: str  # e.g. "tokens (every non-ignored label ...) for BertForMaskedLM (a masked LM)"
    note: str = ""  # a choice made without certainty, said once at setup with how to change it
    router_aux: str = ""  # the MoE model whose loss adds a per-micro-batch router term, if any


def hf_model(module: nn.Module) -> nn.Module | None:
    """The outermost ``transformers.PreTrainedModel`` under ``module`` (``transformers`` only if imported)."""
    if "transformers" not in sys.modules:
        return None
    from transformers import PreTrainedModel

    return next((sub for sub in module.modules() if isinstance(sub, PreTrainedModel)), None)


def structural_kind(model: nn.Module) -> tuple[Kind | None, str]:
    """What a Hugging Face model's loss averages over, from its class and config, and why."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if name.endswith(_SAMPLE_HEADS):
        return "samples", f"{name} (a per-sample loss)"
    if name.endswith(_UNSHIFTED_HEADS):
        return "unshifted", f"{name} ({'a masked LM' if 'MaskedLM' in name else 'token classification'}: labels not shifted)"
    if getattr(config, "is_encoder_decoder", False) and hasattr(model, "lm_head"):
        return "unshifted", f"{name} (an encoder-decoder: decoder labels not shifted)"
    if name.endswith(_CAUSAL_HEADS) and not getattr(config, "is_encoder_decoder", False):
        return "shifted", f"{name} (a causal LM: labels shifted)"
    return None, name


def router_aux_model(module: nn.Module) -> nn.Module | None:
    """A Hugging Face model under ``module`` whose loss adds the router's auxiliary loss."""
    model = hf_model(module)
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "output_router_logits", False):
        return None
    return model if getattr(config, "router_aux_loss_coef", 1.0) else None


def exclude_router_aux(module: nn.Module) -> str:
    """``router_aux_loss="exclude"``: the model's loss without the router term; what was changed."""
    model = router_aux_model(module)
    if model is None:
        return ""
    model.config.output_router_logits = False
    return f"set {type(model).__name__}.config.output_router_logits=False (the loss is the token loss alone)"


def choose(requested: str, module: nn.Module, layered: LayeredModel | None) -> Decision:
    """``CephaloStrategy(loss_weighting=...)`` for ``module``: ``auto`` is what the model's loss
    averages over (see the module docstring); ``tokens`` counts the labels that loss counts (shifted
    for a causal LM or a model not recognised); ``samples`` is samples."""
    model = hf_model(module)
    kind, what = structural_kind(model) if model is not None else (None, type(module).__name__)
    aux = router_aux_model(module)
    aux_name = f"{type(aux).__name__} (output_router_logits=True)" if aux is not None else ""
    if requested == "samples":
        return Decision(LossWeighting("samples"), "samples (loss_weighting='samples')", router_aux=aux_name)
    own = layered.weighting if layered is not None else None
    if layered is not None and not layered.derived:  # the protocol: the user's own count, or samples
        counted = own.kind == "items"
        if requested == "tokens" and not counted:
            return Decision(LossWeighting("items", shifted_label_tokens), _WORDS["shifted"] + " (loss_weighting='tokens')",
                            router_aux=aux_name)
        return Decision(own, ("items (cephalo_loss_items)" if counted else "samples (no cephalo_loss_items)")
                        + f" for {layered.name}", router_aux=aux_name)
    if kind is None and requested == "tokens":
        if own is not None and own.kind == "items":
            return Decision(own, f"items (the adapter's count) for {layered.name} (loss_weighting='tokens')", router_aux=aux_name)
        return Decision(LossWeighting("items", shifted_label_tokens), f"{_WORDS['shifted']} for {what} (loss_weighting='tokens')",
                        router_aux=aux_name)
    if kind is None:
        if own is not None and own.kind == "items":  # an adapter that knows its loss (litgpt)
            return Decision(own, f"items (the adapter's count) for {layered.name}", router_aux=aux_name)
        note = (f"Cephalo: loss_weighting='auto' cannot tell what the loss of {what} averages over; micro-batches are "
                "weighted by samples, exact for a per-sample mean. For a mean over tokens whose number varies per "
                "sample, set CephaloStrategy(loss_weighting='tokens') (non-ignored batch['labels'], shifted as a "
                "causal LM's) or define cephalo_loss_items(batch) with the protocol.")
        return Decision(LossWeighting("samples"), f"samples (not recognised: {what})", note, aux_name)
    if requested == "tokens" and kind == "samples":
        kind = "unshifted"
    if kind == "samples":
        return Decision(LossWeighting("samples"), f"samples for {what}", router_aux=aux_name)
    # the causal adapter's loss takes the global count itself (bit-exact); its count is the shifted one
    share = own.share if own is not None and own.kind == "items" and kind == "shifted" else None
    return Decision(LossWeighting("items", _COUNTS[kind], share), f"{_WORDS[kind]} for {what}", router_aux=aux_name)


def router_aux_warning(model: str) -> str:
    return (f"Cephalo: {model} adds its router's auxiliary (load-balancing) loss to the loss it returns. That term is "
            "a statistic of each micro-batch, so the trained result depends on how the plan cuts the global batch "
            "(it is not single-process training on the global batch). For the exact token loss alone set "
            "CephaloStrategy(router_aux_loss='exclude') (sets config.output_router_logits=False; the router's "
            "balance is then not trained).")
