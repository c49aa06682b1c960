"""What the layered schedule needs from a model, and how a LightningModule provides it.

A :class:`LayeredModel` is an ordered list of :class:`~cephalo_lightning.runtime.layered.Layer`
(each one shard unit), a ``prepare`` that turns a micro-batch into the first layer's input and the
side inputs every layer receives, a ``loss`` over the last layer's output, and how many *items*
that loss averages over (:class:`LossWeighting`). It comes either from an adapter that recognises
the model (:mod:`.hf`, :mod:`.litgpt`) or from the explicit protocol on the LightningModule:

* ``cephalo_layers()`` - the layers in order: modules (called on the hidden state alone) or
  :class:`~cephalo_lightning.runtime.layered.Layer` objects (modules plus a ``call(hidden, side)``);
* ``cephalo_input(batch)`` - the first layer's input, or ``(input, side)`` with side inputs;
* ``cephalo_loss(output, batch)`` - the MEAN loss of a micro-batch over its items;
* optionally ``cephalo_loss_items(batch)`` - how many items that mean is over (e.g. the
  non-ignored tokens); without it the items are the samples.

[Note: exact loss weighting] The gradient must be that of single-process training on the global
batch. A micro-batch's mean loss is weighted by its items over the items of the whole global batch
(all ranks, counted with one small all-reduce): per-sample means by sample counts, per-token means
(HF causal LMs: every label but -100) by token counts. So the result does not depend on how the
plan cuts the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from cephalo_lightning._common.errors import UnsupportedError
from cephalo_lightning.runtime.layered import Layer, Side

PROTOCOL = ("cephalo_layers", "cephalo_input", "cephalo_loss")

Prepare = Callable[[Any], tuple[torch.Tensor, Side]]
Loss = Callable[[torch.Tensor, Any, Side], torch.Tensor]  # (last output, micro-batch, side) -> mean loss
Items = Callable[[Any], int]  # micro-batch -> items its mean loss is over


Share = Callable[[torch.Tensor, Any, Side, float], torch.Tensor]  # (output, micro-batch, side, global items)


@dataclass(frozen=True)
class LossWeighting:
    """How a micro-batch's mean loss enters the global mean: by ``"samples"`` or by ``"items"``
    (``count(micro_batch)``: tokens, for a per-token mean). ``CephaloStrategy(loss_weighting=...)``
    names the items ``"tokens"``; :func:`cephalo_lightning.lightning.steps.schedules.loss_weighting` maps
    the user's word to this one.

    ``share``, where the model's loss can take the global item count itself (Hugging Face's
    ``num_items_in_batch``): the micro-batch's share of the global mean, computed as the model
    computes its mean, so every token's gradient is the single-process one bit for bit (a mean
    re-weighted afterwards rounds 1/n and n/N separately, in the loss's own fp32).
    """

    kind: Literal["samples", "items"] = "samples"
    count: Items | None = None
    share: Share | None = None

    def items(self, micro_batch: Any, samples: int) -> int:
        return int(self.count(micro_batch)) if self.count is not None else samples


@dataclass(frozen=True)
class LayeredModel:
    """A model as the layered schedule runs it (see the module docstring)."""

    layers: tuple[Layer, ...]
    prepare: Prepare
    loss: Loss
    weighting: LossWeighting
    name: str
    derived: bool  # found by an adapter (True) or written by the user (False)
    discovery: Any = None  # a models.discovery.Discovery: found from the structure, checked on the first step

    @property
    def units(self) -> list[list[nn.Module]]:
        return [list(layer.modules) for layer in self.layers]


def has_protocol(module: nn.Module) -> bool:
    return all(callable(getattr(module, name, None)) for name in PROTOCOL)


def from_protocol(module: nn.Module) -> LayeredModel:
    """The LightningModule's own layered protocol as a :class:`LayeredModel`."""
    layers = tuple(Layer.of(layer) for layer in module.cephalo_layers())
    if not layers:
        raise UnsupportedError(f"{type(module).__name__}.cephalo_layers() returned no layers")

    def prepare(micro_batch: Any) -> tuple[torch.Tensor, Side]:
        value = module.cephalo_input(micro_batch)
        x, side = (value if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], torch.Tensor)
                   else (value, None))
        if not isinstance(x, torch.Tensor):
            raise UnsupportedError(f"cephalo_input must return a tensor or (tensor, side inputs), got {type(value).__name__}")
        return x, side

    counter = getattr(module, "cephalo_loss_items", None)
    weighting = LossWeighting("items", counter) if callable(counter) else LossWeighting("samples")
    return LayeredModel(layers, prepare, lambda out, mb, side: module.cephalo_loss(out, mb), weighting,
                        type(module).__name__, derived=False)


def inputs_need_grad(x: torch.Tensor) -> bool:
    """A first-layer input computed with parameters would need a gradient the schedule cannot give."""
    return bool(x.requires_grad)


def check_first_inputs(inputs: Sequence[torch.Tensor]) -> None:
    if any(inputs_need_grad(x) for x in inputs):
        raise UnsupportedError(
            "cephalo_input returned a tensor that needs a gradient: it used parameters, which the "
            "layered schedule cannot train there. Move that computation (e.g. the embedding) into "
            "the first of cephalo_layers(); cephalo_input should only pick tensors out of the batch"
        )
