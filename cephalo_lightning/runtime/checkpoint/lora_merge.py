"""LoRA adapters merged into their base weights while a checkpoint is exported.

A peft LoRA layer computes ``y = W x + scaling * B A x``; merged, it is one linear of weight::

    W' = W + (B @ A) * scaling          ((B @ A).T when the layer stores its weight transposed,
                                         ``fan_in_fan_out``, as GPT-2's Conv1D does)

which is what peft's ``merge_and_unload()`` computes, in the weight's dtype. The checkpoint records
every LoRA layer's path, adapters and scaling (``cephalo_lightning.models.lora.lora_layers``).
"""

from __future__ import annotations

from typing import Any

import torch

from cephalo_lightning.runtime.checkpoint.format import CheckpointError


def merge(tensors: dict[str, torch.Tensor], layers: dict[str, dict[str, dict[str, Any]]]) -> dict[str, torch.Tensor]:
    """``tensors`` (names relative to the model that ``layers``' paths are relative to, e.g. one
    unit's) with every LoRA layer whose base weight is among them merged as peft's
    ``merge_and_unload()`` merges it: ``W + (B @ A) * scaling`` (``(B @ A).T`` for ``fan_in_fan_out``),
    in the weight's dtype, as ``<layer>.weight``, its bias as ``<layer>.bias``; the adapters' own
    tensors are dropped."""
    out = dict(tensors)
    for path, adapters in layers.items():
        base = f"{path}.base_layer.weight"
        if base not in out:
            continue
        weight = out.pop(base).clone()
        for adapter, spec in adapters.items():
            a, b = out.pop(f"{path}.lora_A.{adapter}.weight", None), out.pop(f"{path}.lora_B.{adapter}.weight", None)
            if a is None or b is None:
                raise CheckpointError(f"{path}: adapter {adapter!r} has no lora_A or lora_B beside its base weight; "
                                         "export with --no-merge and merge with peft's merge_and_unload()")
            if out.pop(f"{path}.lora_B.{adapter}.bias", None) is not None:
                raise CheckpointError(f"{path}: a LoRA bias (lora_bias=True) is not merged here; export with "
                                       "--no-merge and merge with peft's merge_and_unload()")
            delta = b.to(weight.dtype) @ a.to(weight.dtype)
            weight += (delta.T if spec["fan_in_fan_out"] else delta) * spec["scaling"]
        out[f"{path}.weight"] = weight
        bias = out.pop(f"{path}.base_layer.bias", None)
        if bias is not None:
            out[f"{path}.bias"] = bias
    return out
