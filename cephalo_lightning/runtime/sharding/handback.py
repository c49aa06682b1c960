"""The user's module after a fit: whole trained parameters, or shard pieces that refuse to be used.

While a fit runs, the modules hold this rank's local pieces (views of the master shard) and the
hooks gather them for compute. Once ``fit``/``validate``/``test`` returns, code outside the
strategy (``save_pretrained``, ``generate``, ``state_dict``, a plain forward) must see the model
it trained, so ``ShardedModel.hand_back`` either

* gathers every unit once (an all-gather per unit, in the master dtype) and puts whole copies of
  the trained parameters into the modules (``whole=True``; in host memory when training ran on a
  GPU): an ordinary model on every rank, tied parameters still tied; the hooks stand aside
  (``Driver.HANDED_BACK``); or
* leaves the pieces in place (``whole=False``, for a model too big to hold whole) and refuses every
  forward through a module holding them and every ``state_dict()`` of the model with an error that
  says what to do (``Driver.PARKED``).

:func:`copy_into_shards` undoes it when the same module is set up again (``trainer.test`` after
``trainer.fit``): the whole parameters, edited or not, are copied into the master shards, which the
optimizer's pieces view, and the modules hold the pieces again. The modes themselves are
:class:`~.sharded_model.ShardedModel`'s (``hand_back``, ``take_back``), which passes its units
here and keeps the refusing hooks these functions return.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from cephalo_lightning._common.errors import UnsupportedError
from cephalo_lightning.runtime.collectives import Collectives
from cephalo_lightning.runtime.sharding.flat_unit import FlatUnit

PIECE_ATTRIBUTE = "_cephalo_full_shape"  # set on every local piece (see flat_unit)

REFUSAL = ("{what}: the module's parameters are this rank's shard pieces of a Cephalo fit, not the model's "
           "weights (left sharded: CephaloStrategy(gather_on_teardown=False), or the run failed). Use the model "
           "through the Trainer (trainer.validate/test/predict), set gather_on_teardown=True to get whole "
           "parameters after the fit, or export a checkpoint: python -m cephalo_lightning export CHECKPOINT_DIR --hf OUT")


def put_whole(units: Sequence[FlatUnit], comm: Collectives, device: torch.device) -> None:
    """Collective: whole copies of the trained parameters into the modules, one unit at a time on
    the device; after a GPU fit they go to host memory, where Lightning's teardown moves the module
    anyway, so the device never holds more than one unit."""
    home = torch.device("cpu") if device.type == "cuda" else device
    for unit in units:
        flat = torch.empty(unit.layout.numel, dtype=unit.master.dtype, device=unit.device)
        comm.all_gather(unit.master, flat, unit.layout).wait()
        flat = flat.to(home)
        for slot, span, requires_grad in zip(unit.slots, unit.spans, unit.requires_grad):
            whole = flat[span.offset : span.offset + span.numel].view(span.shape).clone()
            slot.set(nn.Parameter(whole, requires_grad=requires_grad))


def copy_into_shards(units: Sequence[FlatUnit]) -> None:
    """The modules' whole parameters (edited or not) into this rank's master shards; the modules
    hold the local pieces again."""
    for unit in units:
        lo, _ = unit.layout.shard_range(unit.rank)
        for index, (slot, span) in enumerate(zip(unit.slots, unit.spans)):
            current = slot.current
            if tuple(current.shape) != tuple(span.shape):
                raise UnsupportedError(
                    f"{span.name} is now {tuple(current.shape)}, was {tuple(span.shape)} when the model was sharded: "
                    "a module whose parameters changed shape cannot train on; build a new module")
            a, b = unit.local_range(index)
            start = span.offset + a - lo
            unit.master[start : start + b - a].copy_(current.detach().reshape(-1)[a:b])
        unit.use_local()


def refuse_use(units: Sequence[FlatUnit], model: nn.Module) -> list[RemovableHandle]:
    """Every forward through a module holding pieces, and every ``state_dict()`` of ``model`` or a
    submodule, raises until the returned hooks are removed."""
    holders = {id(m): m for unit in units for slot in unit.slots for m, _ in slot.holders}
    holders[id(model)] = model

    def refuse_forward(module: nn.Module, args: Any) -> None:
        raise UnsupportedError(REFUSAL.format(what=f"{type(module).__name__}.forward() after the fit"))

    def refuse_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        raise UnsupportedError(REFUSAL.format(what=f"{type(module).__name__}.state_dict() after the fit"))

    handles = [module.register_forward_pre_hook(refuse_forward) for module in holders.values()]
    # save_pretrained() asks a submodule for its state_dict
    return handles + [module.register_state_dict_pre_hook(refuse_state_dict) for module in model.modules()]


def check_not_pieces(module: nn.Module) -> None:
    """Refuse to shard a module that still holds the pieces of an earlier fit's sharding."""
    pieces = [name for name, p in module.named_parameters() if hasattr(p, PIECE_ATTRIBUTE)]
    if pieces:
        raise UnsupportedError(REFUSAL.format(what=f"cannot shard {type(module).__name__} again ({pieces[0]}, ...)"))


__all__ = ["check_not_pieces", "copy_into_shards", "put_whole", "refuse_use"]
