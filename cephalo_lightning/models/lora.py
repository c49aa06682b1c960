"""peft LoRA adapters inside a LightningModule: their names, their initialisation, their merge.

``peft.get_peft_model(model, LoraConfig(...))`` replaces each targeted ``nn.Linear`` by a LoRA
layer holding the original as ``base_layer`` and the adapter ``default`` as two small linears::

    y = base_layer(x) + scaling * lora_B(lora_A(x))        scaling = lora_alpha / r  (sqrt(r) with rsLoRA)

so the model's parameter names change: ``...q_proj.weight`` becomes ``...q_proj.base_layer.weight``
beside ``...q_proj.lora_A.default.weight``. Three things follow here:

* **Pretrained names**: :data:`WRAPPED_SEGMENTS` are the name segments peft inserts; a pretrained
  file is looked up by the name with them removed (the original model's), and the adapters,
  which no pretrained file holds, are :func:`adapter_parameters` (kept as built, or initialised).
* **Meta initialisation**: a model built in ``configure_model()`` lives on the meta device and is
  initialised unit by unit; :func:`adapter_inits` gives each adapter linear peft's own
  initialisation (``init_lora_weights=True``: A Kaiming-uniform, B zeros, so the adapted model
  starts as the base model; ``"gaussian"``: A normal with std 1/r). Initialisations that need the
  base weights (PiSSA, OLoRA, LoftQ, ...) are refused with the fix.
* **Merged export**: :func:`lora_layers` records every LoRA layer's scaling in a checkpoint, from
  which the export (:mod:`cephalo_lightning.runtime.checkpoint.lora_merge`) folds
  ``W + scaling * B @ A`` into the base weights under their original names.

Only LoRA on linear layers is handled (the common case); an adapter of another kind is refused
where it matters (meta initialisation, merged export) with what to do instead.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cephalo_lightning._common.errors import UnsupportedError

WRAPPED_SEGMENTS = (".base_layer",)  # what peft inserts into a wrapped module's parameter names
ADAPTER_DICTS = ("lora_A", "lora_B")


def _lora_layer_class() -> type | None:
    """peft's ``LoraLayer`` when peft is imported (a model can only hold one if it is)."""
    if "peft" not in sys.modules:
        return None
    from peft.tuners.lora import LoraLayer

    return LoraLayer


def _config_of(module: nn.Module, adapter: str) -> Any:
    """The ``LoraConfig`` of ``adapter`` from the peft model (or tuner) holding it, or None."""
    for sub in module.modules():
        configs = getattr(sub, "peft_config", None)
        if isinstance(configs, dict) and adapter in configs:
            return configs[adapter]
    return None


def lora_layers(module: nn.Module) -> dict[str, dict[str, dict[str, Any]]]:
    """Every LoRA layer under ``module``: its path -> adapter -> {"scaling", "fan_in_fan_out"}."""
    cls = _lora_layer_class()
    if cls is None:
        return {}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, sub in module.named_modules():
        if isinstance(sub, cls):
            out[name] = {a: {"scaling": float(sub.scaling[a]), "fan_in_fan_out": bool(getattr(sub, "fan_in_fan_out", False))}
                         for a in sub.lora_A}
    return out


def adapter_parameters(module: nn.Module) -> set[str]:
    """Names (``module.named_parameters()``'s) of every adapter parameter: what no pretrained file holds."""
    cls = _lora_layer_class()
    if cls is None:
        return set()
    out = set()
    for name, sub in module.named_modules():
        if isinstance(sub, cls):
            for child, _ in sub.named_children():
                if child != "base_layer":
                    out |= {f"{name}.{child}.{p}" for p, _ in getattr(sub, child).named_parameters()}
    return out


def _reset(linear: nn.Linear, which: str, init: Any, r: int) -> None:
    """peft's initialisation of one adapter linear (``LoraLayer.reset_lora_parameters``)."""
    with torch.no_grad():
        if which == "lora_B":
            nn.init.zeros_(linear.weight)
        elif init is True:
            nn.init.kaiming_uniform_(linear.weight, a=math.sqrt(5))
        else:
            nn.init.normal_(linear.weight, std=1 / r)
        if linear.bias is not None:
            nn.init.zeros_(linear.bias)


def _refuse(name: str, what: str) -> Callable[[nn.Module], None]:
    def refuse(module: nn.Module) -> None:
        raise UnsupportedError(
            f"{name}: a LoRA layer with {what} cannot be initialised on the meta device (configure_model() builds "
            "there, one unit at a time): build the peft model in the LightningModule's __init__ instead, or use "
            "LoraConfig(init_lora_weights=True)")

    return refuse


def adapter_inits(module: nn.Module) -> dict[int, Callable[[nn.Module], None]]:
    """For every adapter module of a LoRA layer under ``module`` (``id`` of the module): its init
    on the meta device (one that refuses, naming the fix, where peft's needs the base weights)."""
    cls = _lora_layer_class()
    if cls is None:
        return {}
    out: dict[int, Callable[[nn.Module], None]] = {}
    for name, layer in module.named_modules():
        if not isinstance(layer, cls):
            continue
        other = [k for k in ("lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
                 if len(getattr(layer, k, ()))]
        for key in other:
            for sub in getattr(layer, key).modules():
                out[id(sub)] = _refuse(name, f"adapters {other}")
        for adapter in layer.lora_A:
            config = _config_of(module, adapter)
            init = True if config is None else config.init_lora_weights
            supported = init is True or (isinstance(init, str) and init.lower() == "gaussian")
            for which in ADAPTER_DICTS:
                linear = getattr(layer, which)[adapter]
                out[id(linear)] = ((lambda m, which=which, init=init, r=layer.r[adapter]: _reset(m, which, init, r))
                                   if supported else _refuse(name, f"init_lora_weights={init!r}"))
    return out
