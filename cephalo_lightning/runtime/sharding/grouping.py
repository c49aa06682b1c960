"""Which parameters and buffers belong to which unit, and under what names.

The units are groups of modules (:func:`unit_groups`); every parameter goes to the one unit whose
modules hold it, or to the root unit (index 0) when no unit's modules hold it or two units' do
(:func:`group_slots`); every buffer goes to the unit whose modules hold it (:func:`buffers_by_unit`).
Everything here is a pure function of the model's structure, so every rank groups alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from cephalo_lightning.runtime.sharding.flat_unit import ParamSlot
from cephalo_lightning.runtime.sharding.layout import ParamSpan
from cephalo_lightning.runtime.sharding.wrap_policy import WrapPolicy, find_units

ROOT = "<root>"

Units = Sequence[nn.Module | Sequence[nn.Module]]  # a unit is a module or a group of modules
Buffer = tuple[str, nn.Module, str]  # a buffer's canonical name, its module and its attribute


def unit_groups(module: nn.Module, units: WrapPolicy | Units) -> list[list[nn.Module]]:
    """The modules of every unit: ``units`` given as groups, or found by the wrap policy."""
    if units is not None and all(isinstance(u, (list, tuple)) for u in units) and units:
        return [list(g) for g in units]
    return [[m] for m in find_units(module, units)]  # type: ignore[arg-type]


def _unit_of_module(groups: list[list[nn.Module]]) -> dict[int, int]:
    """Every module (by identity) inside a unit, mapped to the unit's index (from 1)."""
    unit_of: dict[int, int] = {}
    for index, group in enumerate(groups, start=1):
        for top in group:
            for mod in top.modules():
                unit_of.setdefault(id(mod), index)
    return unit_of


def _holders(module: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every parameter (by identity) and every (module, attr) that registers it; each module once.

    A module reachable by two paths (an adapter that wraps a submodule) is one holder.
    """
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in module.modules():  # each module object once
        for attr, param in mod._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((mod, attr))
    return holders


def group_slots(module: nn.Module, groups: list[list[nn.Module]]) -> list[list[ParamSlot]]:
    """The parameter slots of the root unit and of every unit, in registration order.

    A parameter goes to the unit whose modules hold it; held from two units (tied), to the root.
    Names are the canonical ones (``named_parameters()``'s, also ``state_dict()``'s).
    """
    names = {id(p): n for n, p in module.named_parameters()}
    unit_of = _unit_of_module(groups)
    holders = _holders(module)
    slots: list[list[ParamSlot]] = [[] for _ in range(len(groups) + 1)]
    for pid in names:  # registration order
        held = holders[pid]
        owners = {unit_of.get(id(mod), 0) for mod, _ in held}
        target = owners.pop() if len(owners) == 1 else 0
        slots[target].append(ParamSlot(names[pid], tuple(held)))
    return slots


def unit_names(module: nn.Module, groups: list[list[nn.Module]]) -> list[str]:
    """The root's name and every unit's: its modules' qualified names, joined by ``+``."""
    names = {id(m): n for n, m in module.named_modules()}
    return [ROOT] + ["+".join(names.get(id(m)) or type(m).__name__ for m in group) for group in groups]


def unit_spans(slots: list[ParamSlot]) -> list[ParamSpan]:
    """Where each of a unit's parameters sits in its flat buffer, one after another."""
    spans, offset = [], 0
    for slot in slots:
        p = slot.current
        spans.append(ParamSpan(slot.name, tuple(p.shape), offset, p.numel()))
        offset += p.numel()
    return spans


def buffers_by_unit(module: nn.Module, groups: list[list[nn.Module]]) -> list[list[Buffer]]:
    """Every buffer as (name, module, attr), grouped by the unit whose modules hold it (root: 0)."""
    unit_of = _unit_of_module(groups)
    out: list[list[Buffer]] = [[] for _ in range(len(groups) + 1)]
    for mod_name, mod in module.named_modules():  # each module once
        for attr, buf in mod._buffers.items():
            if buf is not None:
                out[unit_of.get(id(mod), 0)].append((f"{mod_name}.{attr}" if mod_name else attr, mod, attr))
    return out
