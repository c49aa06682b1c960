"""The user's module after a fit: whole trained parameters, or shard pieces that refuse to be used.

    whole model bytes = sum over units of (unit numel x master element size)
    host memory of a hand-back = whole model bytes x (ranks that get it: every rank, one, or none)

While a fit runs, the modules hold this rank's local pieces (views of the master shard) and the
hooks gather them for compute. Once ``fit``/``validate``/``test`` returns, code outside the
strategy (``save_pretrained``, ``generate``, ``state_dict``, a plain forward) must see the model
it trained, so ``ShardedModel.hand_back`` does what :class:`~cephalo_lightning._common.vocabulary.Handback`
says:

* ``ALL``: gathers every unit once (an all-gather per unit, in the master dtype) and puts whole
  copies of the trained parameters into the modules (in host memory when training ran on a GPU):
  an ordinary model on every rank, tied parameters still tied; the hooks stand aside
  (``Driver.HANDED_BACK``);
* ``RANK0``: the same on global rank 0 alone, each unit sent to it piece by piece (no other rank
  allocates a unit); every other rank keeps its pieces, refused as below (they are what it held
  while training, so dropping them would free nothing new, and a later ``validate``/``test`` of the
  same module shards from them again; rank 0's whole copy is dropped then, edits and all: they could
  reach only its own shards);
* ``NONE``: every rank keeps its pieces (for a model too big to hold whole) and refuses every
  forward through a module holding them and every ``state_dict()`` of the model with an error that
  says what to do (``Driver.PARKED``).

[Note: the size default] ``gather_on_teardown="auto"`` (:func:`decide`) hands the whole model
back on every rank when it takes at most :data:`AUTO_WHOLE_LIMIT_BYTES` (8 GiB: a 2-billion
parameter model in fp32, 64 GiB on a node of 8 ranks) and keeps it sharded above: the whole model
on every rank of a node at once is what runs a host out of memory at the end of an otherwise good
run (an 8B model: 32 GB per rank, 128 GB on a node of 4), and a model that size is exported from a
checkpoint anyway. Below the limit nothing changes for anyone. The decision and the memory it
takes are logged once, before any gather (:func:`decide` returns the line).

:func:`copy_into_shards` undoes it when the same module is set up again (``trainer.test`` after
``trainer.fit``): the whole parameters, edited or not, are copied into the master shards, which the
optimizer's pieces view, and the modules hold the pieces again. The modes themselves are
:class:`~.sharded_model.ShardedModel`'s (``hand_back``, ``take_back``), which passes its units
here and keeps the refusing hooks these functions return.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from cephalo_lightning._common.errors import UnsupportedError
from cephalo_lightning._common.units import GIB, memory_text
from cephalo_lightning._common.vocabulary import AUTO, Auto, Handback
from cephalo_lightning.runtime.collectives import Collectives
from cephalo_lightning.runtime.sharding.flat_unit import FlatUnit

PIECE_ATTRIBUTE = "_cephalo_full_shape"  # set on every local piece (see flat_unit)
AUTO_WHOLE_LIMIT_BYTES = 8 * 2**30  # see [Note: the size default]

REFUSAL = ("{what}: the module's parameters are this rank's shard pieces of a Cephalo fit, not the model's "
           "weights ({why}). Use the model through the Trainer (trainer.validate/test/predict), set "
           "CephaloStrategy(gather_on_teardown='rank0') (the whole model on global rank 0) or 'all' (on every rank) "
           "to get whole parameters after the fit, or export a checkpoint: "
           "python -m cephalo_lightning export CHECKPOINT_DIR --hf OUT")
WHY_NONE = "left sharded: gather_on_teardown='none' or False, 'auto' above its size limit, or the run failed"
WHY_RANK0 = "gather_on_teardown='rank0': the whole model is on global rank 0 only"


@dataclass(frozen=True)
class HandbackDecision:
    """What a hand-back does (:func:`decide`) and the line that says so, with the memory it takes."""

    handback: Handback
    line: str


def whole_bytes(units: Sequence[FlatUnit]) -> int:
    """The whole model in its master dtype: what one rank holds after a whole hand-back."""
    return sum(unit.layout.numel * unit.master.element_size() for unit in units)


def decide(choice: Handback | Auto, whole: int, ranks_per_node: int, limit: int = AUTO_WHOLE_LIMIT_BYTES) -> HandbackDecision:
    """``gather_on_teardown`` for a model of ``whole`` bytes (see [Note: the size default]), with the
    line to log before gathering: what is gathered, where, and the host memory it takes."""
    size = memory_text(whole / GIB)
    if choice == AUTO:
        handback = Handback.ALL if whole <= limit else Handback.NONE
        why = f"gather_on_teardown='auto': the whole model is {size}, {'at most' if whole <= limit else 'over'} " \
              f"the {memory_text(limit / GIB)} limit"
    else:
        handback = Handback(choice)
        why = f"gather_on_teardown={handback.value!r}: the whole model is {size}"
    if handback is Handback.ALL:
        what = (f"gathering it whole on every rank: {size} of host memory per rank, "
                f"{memory_text(whole * ranks_per_node / GIB)} on a node of {ranks_per_node}")
    elif handback is Handback.RANK0:
        what = f"gathering it whole on global rank 0 only: {size} of host memory there, none elsewhere"
    else:
        what = ("not gathered: the module keeps its shard pieces and refuses use (gather_on_teardown='rank0' gives "
                "the whole model to rank 0; or export a checkpoint)")
    return HandbackDecision(handback, f"Cephalo: {why}; {what}")


def put_whole(units: Sequence[FlatUnit], comm: Collectives, device: torch.device) -> None:
    """Collective: whole copies of the trained parameters into the modules, one unit at a time on
    the device; after a GPU fit they go to host memory, where Lightning's teardown moves the module
    anyway, so the device never holds more than one unit."""
    for unit in units:
        flat = torch.empty(unit.layout.numel, dtype=unit.master.dtype, device=unit.device)
        comm.all_gather(unit.shard_values(), flat, unit.layout).wait()
        _install(unit, flat.to(_home(device)))


def put_whole_on_first(units: Sequence[FlatUnit], comm: Collectives, device: torch.device) -> bool:
    """Collective over one shard group: its first rank receives every other rank's piece of each
    unit (point to point, one unit at a time) and gets whole copies, as :func:`put_whole`; the
    other ranks only send and allocate nothing. Returns whether this rank got the whole model."""
    first = comm.rank == 0
    for unit in units:
        layout = unit.layout
        if first:
            flat = torch.empty(layout.numel, dtype=unit.master.dtype, device=unit.device)
            lo, hi = layout.shard_range(0)
            flat[lo:hi].copy_(unit.shard_values())
            ops = [dist.P2POp(dist.irecv, flat[a:b], comm.global_ranks[r], comm.group)
                   for r, (a, b) in enumerate(zip(layout.bounds, layout.bounds[1:])) if r and b > a]
        else:
            lo, hi = layout.shard_range(comm.rank)
            ops = [dist.P2POp(dist.isend, unit.shard_values(), comm.global_ranks[0], comm.group)] if hi > lo else []
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()
        if first:
            _install(unit, flat.to(_home(device)))
    return first


def _home(device: torch.device) -> torch.device:
    return torch.device("cpu") if device.type == "cuda" else device


def _install(unit: FlatUnit, flat: torch.Tensor) -> None:
    for slot, span, requires_grad in zip(unit.slots, unit.spans, unit.requires_grad):
        whole = flat[span.offset : span.offset + span.numel].view(span.shape).clone()
        slot.set(nn.Parameter(whole, requires_grad=requires_grad))


def copy_into_shards(units: Sequence[FlatUnit]) -> None:
    """The modules' whole parameters (edited or not) into this rank's master shards; the modules
    hold the local pieces again."""
    for unit in units:
        for index, (slot, span) in enumerate(zip(unit.slots, unit.spans)):
            current = slot.current
            if tuple(current.shape) != tuple(span.shape):
                raise UnsupportedError(
                    f"{span.name} is now {tuple(current.shape)}, was {tuple(span.shape)} when the model was sharded: "
                    "a module whose parameters changed shape cannot train on; build a new module")
            a, b = unit.local_range(index)
            if not unit.local_params[index].is_meta:
                unit.local_params[index].detach().view(-1).copy_(current.detach().reshape(-1)[a:b])  # a view of its storage
        if any(p.is_meta for p in unit.local_params):  # a quantised base: stored again from the modules' values
            unit.restore_frozen([slot.current.detach().reshape(-1)[slice(*unit.local_range(i))]
                                 for i, (slot, rg) in enumerate(zip(unit.slots, unit.requires_grad)) if not rg])
        unit.use_local()


def refuse_use(units: Sequence[FlatUnit], model: nn.Module, why: str = WHY_NONE) -> list[RemovableHandle]:
    """Every forward through a module holding pieces, and every ``state_dict()`` of ``model`` or a
    submodule, raises (saying ``why`` the pieces are there) until the returned hooks are removed."""
    holders = {id(m): m for unit in units for slot in unit.slots for m, _ in slot.holders}
    holders[id(model)] = model

    def refuse_forward(module: nn.Module, args: Any) -> None:
        raise UnsupportedError(REFUSAL.format(what=f"{type(module).__name__}.forward() after the fit", why=why))

    def refuse_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        raise UnsupportedError(REFUSAL.format(what=f"{type(module).__name__}.state_dict() after the fit", why=why))

    handles = [module.register_forward_pre_hook(refuse_forward) for module in holders.values()]
    # save_pretrained() asks a submodule for its state_dict
    return handles + [module.register_state_dict_pre_hook(refuse_state_dict) for module in model.modules()]


def check_not_pieces(module: nn.Module) -> None:
    """Refuse to shard a module that still holds the pieces of an earlier fit's sharding."""
    pieces = [name for name, p in module.named_parameters() if hasattr(p, PIECE_ATTRIBUTE)]
    if pieces:
        raise UnsupportedError(REFUSAL.format(what=f"cannot shard {type(module).__name__} again ({pieces[0]}, ...)",
                                              why=WHY_NONE))


__all__ = ["AUTO_WHOLE_LIMIT_BYTES", "HandbackDecision", "check_not_pieces", "copy_into_shards", "decide", "put_whole",
           "put_whole_on_first", "refuse_use", "whole_bytes"]
