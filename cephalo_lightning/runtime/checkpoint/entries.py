"""What of a sharded model a checkpoint stores, and under which keys.

Every parameter under its original name and shape (``model.<name>``), each rank contributing the
piece it owns; persistent buffers and replicated optimizer tensors (Adam's ``step``) once, by the
group's first rank; optimizer moments sharded like their parameters
(``optimizer_<i>.state.<name>.<key>``); hyperparameters and scalars by parameter name, as JSON.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cephalo_lightning.runtime.checkpoint.dcp_planners import Entry
from cephalo_lightning.runtime.checkpoint.format import MODEL_PREFIX, CheckpointError
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel


@dataclass
class SavedOptimizer:
    """How one optimizer's state is stored: tensors go to DCP, the rest to ``cephalo.json``."""

    entries: list[Entry] = field(default_factory=list)
    replicated: dict[str, torch.Tensor] = field(default_factory=dict)  # fqn -> tensor (the group's first rank writes)
    info: dict[str, Any] = field(default_factory=dict)  # param groups by name, scalars


def local_pieces(sharded: ShardedModel, trainable_only: bool = False) -> Iterator[tuple[str, nn.Parameter, tuple[int, ...], int]]:
    """(name, local piece, original shape, start of the piece within the flattened parameter), of
    every parameter or of the trainable ones."""
    for unit in sharded.units:  # a quantised frozen piece as its values (see unit.local_values)
        for index, (span, param, trainable) in enumerate(zip(unit.spans, unit.local_values(), unit.requires_grad)):
            if trainable or not trainable_only:
                yield span.name, param, span.shape, unit.local_range(index)[0]


def buffers(sharded: ShardedModel) -> dict[str, torch.Tensor]:
    """Persistent buffers under their canonical names (replicated on every rank, saved once)."""
    module = sharded.module
    non_persistent = {(id(m), n) for m in module.modules() for n in getattr(m, "_non_persistent_buffers_set", ())}
    out = {}
    for mod_name, mod in module.named_modules():
        for attr, buf in mod._buffers.items():
            if buf is not None and (id(mod), attr) not in non_persistent:
                out[f"{mod_name}.{attr}" if mod_name else attr] = buf
    return out


def state_dict_aliases(sharded: ShardedModel) -> dict[str, str]:
    """Every other key ``module.state_dict()`` has for a tensor saved once, and its saved name.

    Tied parameters (``lm_head.weight`` of a tied embedding) and modules reachable by two paths
    appear in a state dict under several keys; the checkpoint stores each tensor once, and a
    consolidated state dict repeats it under every key, so ``load_state_dict`` (strict) works.
    """
    canonical: dict[int, str] = {}
    for unit in sharded.units:
        for slot in unit.slots:
            for holder, attr in slot.holders:
                canonical[id(holder._parameters[attr])] = slot.name
    names = set(canonical.values())
    tensors = {**{id(t): n for n, t in buffers(sharded).items()}, **canonical}
    aliases = {}
    module = sharded.module  # the state dict's keys, without calling state_dict() (refused on a parked model)
    for key, value in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        saved = tensors.get(id(value))
        if saved is not None and key != saved and key not in names:
            aliases[key] = saved
    return aliases


def model_entries(sharded: ShardedModel, trainable_only: bool = False) -> list[Entry]:
    return [Entry(MODEL_PREFIX + name, shape, piece.dtype, piece.detach().reshape(-1), start)
            for name, piece, shape, start in local_pieces(sharded, trainable_only)]


def optimizer_entries(sharded: ShardedModel, optimizer: torch.optim.Optimizer, prefix: str) -> SavedOptimizer:
    """One optimizer over the sharded model's local pieces, as DCP entries and plain info."""
    by_param = {id(p): (name, p, shape, start) for name, p, shape, start in local_pieces(sharded)}
    saved = SavedOptimizer()
    groups, scalars = [], {}
    for group in optimizer.param_groups:
        names = []
        for p in group["params"]:
            if id(p) not in by_param:
                raise CheckpointError("the optimizer holds a parameter that is not a local piece of the sharded model")
            name, piece, shape, start = by_param[id(p)]
            names.append(name)
            for key, value in optimizer.state.get(p, {}).items():
                fqn = f"{prefix}.state.{name}.{key}"
                if torch.is_tensor(value) and value.shape == piece.shape and key != "step":
                    saved.entries.append(Entry(fqn, shape, value.dtype, value.detach().reshape(-1), start))
                elif torch.is_tensor(value):
                    saved.replicated[fqn] = value.detach()  # replicated (Adam's step): same on every rank
                else:
                    scalars[f"{name}.{key}"] = value
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    saved.info = {"param_groups": groups, "scalars": scalars}
    return saved


def replicated_entries(tensors: dict[str, torch.Tensor], rank: int) -> list[Entry]:
    """Tensors every rank holds whole: the group's first rank (``rank`` 0 within the model's
    process group) writes them, one chunk covering everything."""
    if rank != 0:
        return []
    return [Entry(fqn, tuple(t.shape), t.dtype, t.detach().reshape(-1).cpu(), 0) for fqn, t in tensors.items()]

