"""How the strategy sees a LightningModule's model: layers, side inputs, loss weighting, init.

:func:`resolve` looks, in order, for the explicit layered protocol on the module
(:mod:`.protocol`), a Hugging Face causal LM (:mod:`.hf`) or a litgpt ``GPT`` (:mod:`.litgpt`)
inside it (named adapters: fast paths), and else for a block sequence in the model's structure
(:mod:`.discovery`, checked on the first step). What it finds decides the mode (layered when a
layered form exists), how micro-batch losses are weighted (:mod:`.weighting`: by what the model's
loss averages over) and how a model built on the meta device is initialised. ``transformers`` and
``litgpt`` are only looked at when already imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning.models import discovery, hf, litgpt, lora, weighting
from cephalo_lightning.models.protocol import PROTOCOL, LayeredModel, LossWeighting, from_protocol, has_protocol

InitFn = Callable[[nn.Module], None]

SUPPORTED = ("the layered protocol (cephalo_layers, cephalo_input, cephalo_loss)",
             "Hugging Face causal LMs: " + ", ".join(sorted(hf.FAMILIES)), "litgpt GPT",
             "any model whose largest ModuleList is a sequence of blocks (found on the first step)")


@dataclass(frozen=True)
class Resolution:
    layered: LayeredModel | None  # None: only the uniform mode (the user's training_step) can run
    weighting: LossWeighting  # how the uniform mode weights micro-batches too
    reason: str  # why there is no layered form (for the log line); empty when there is
    init: InitFn | None  # how to initialise a module built on the meta device
    model: nn.Module | None  # the recognised library model (HF / litgpt), if any


def _torch_init(module: nn.Module) -> None:
    """A module's own ``reset_parameters()``; a module without one cannot be initialised from meta,
    unless all it holds is non-persistent buffers (its constructor's values are replayed:
    :mod:`cephalo_lightning.runtime.sharding.construction`)."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
        return
    own = [n for n, p in module._parameters.items() if p is not None] + [
        n for n, b in module._buffers.items() if b is not None and n not in module._non_persistent_buffers_set]
    if own:
        raise ConfigurationError(
            f"{type(module).__name__} was built on the meta device and has no reset_parameters() to initialise "
            f"{own}; define reset_parameters() on it or cephalo_init_weights(module) on the LightningModule, or "
            "load weights into the shards (CephaloStrategy(pretrained=...))"
        )


def _init_for(lightning_module: nn.Module, library_model: nn.Module | None, library_init: InitFn | None) -> InitFn:
    user = getattr(lightning_module, "cephalo_init_weights", None)
    if callable(user):
        return user
    inside = {id(m) for m in library_model.modules()} if library_model is not None else set()
    adapters = lora.adapter_inits(lightning_module)  # peft's own init for LoRA adapters, not the library's

    def init(module: nn.Module) -> None:
        if id(module) in adapters:
            adapters[id(module)](module)
        elif library_init is not None and id(module) in inside:
            library_init(module)
        else:
            _torch_init(module)

    return init


def resolve(module: nn.Module, router_aux_loss: str = "keep") -> Resolution:
    """Everything the strategy needs to know about ``module``'s model (see the module docstring).
    ``router_aux_loss``: the strategy's option (``"exclude"``: an MoE model's router term is turned off
    at setup, so it does not keep the model from the layered mode)."""
    lm, gpt = hf.find_causal_lm(module), litgpt.find_gpt(module)
    library = lm if lm is not None else gpt
    pretrained = hf.find_pretrained(module) if lm is None else lm  # any HF model initialises as its own class does
    initialised = pretrained if pretrained is not None else gpt
    library_init = hf.init_weights(pretrained) if pretrained is not None else litgpt.init_weights(gpt) if gpt is not None else None
    init = _init_for(module, initialised, library_init)
    if has_protocol(module):
        layered = from_protocol(module)
        return Resolution(layered, weighting.choose("auto", module, layered).weighting, "", init, library)
    if lm is not None:
        layered, why = hf.adapt(lm)
    elif gpt is not None:
        layered, why = litgpt.adapt(gpt)
    else:
        layered, why = None, f"{type(module).__name__} holds no model a named adapter knows"
    if layered is None:  # no named adapter: the block sequence found from the model's structure
        name = type(library).__name__ if library is not None else type(module).__name__
        layered, found = discovery.adapt(module, weighting.choose("auto", module, None).weighting, name,
                                         router_aux_excluded=router_aux_loss == "exclude")
        why = "" if layered is not None else f"{why}; {found}"
    return Resolution(layered, weighting.choose("auto", module, layered).weighting, why, init, library)


__all__ = ["LayeredModel", "LossWeighting", "PROTOCOL", "Resolution", "SUPPORTED", "resolve"]
