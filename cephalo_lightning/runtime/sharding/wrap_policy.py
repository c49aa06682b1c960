"""Which modules become units: the wrap policy."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from cephalo_lightning._common.errors import CephaloError

WrapPolicy = Sequence[type[nn.Module]] | Sequence[nn.Module] | None


class WrapPolicyError(CephaloError, ValueError):
    """The model has no units the runtime can shard by, or its units overlap."""


def _largest_module_list(model: nn.Module) -> nn.ModuleList | None:
    best, best_size = None, 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = module, size
    return best


def find_units(model: nn.Module, policy: WrapPolicy = None) -> list[nn.Module]:
    """The unit modules, in registration order (the root unit holds everything else).

    ``policy`` is ``None`` (every block of the largest ``nn.ModuleList``: the usual transformer
    stack), a list of module classes (every outermost instance), or a list of modules.
    """
    if policy is None:
        blocks = _largest_module_list(model)
        if blocks is None:
            raise WrapPolicyError(
                f"found no units in {type(model).__name__}: it has no nn.ModuleList of blocks. Pass "
                "units=[YourBlockClass] (module classes) or units=[model.a, model.b] (modules)"
            )
        return list(blocks)
    policy = list(policy)
    if not policy:
        raise WrapPolicyError("units=[] selects nothing; pass module classes or modules, or None for the default")
    if all(isinstance(p, type) for p in policy):
        classes = tuple(policy)
        found: list[nn.Module] = []
        skip: set[int] = set()
        for module in model.modules():
            if id(module) in skip:
                continue
            if module is not model and isinstance(module, classes):
                found.append(module)
                skip.update(id(m) for m in module.modules())
        if not found:
            names = [c.__name__ for c in classes]
            raise WrapPolicyError(f"found no units in {type(model).__name__}: no submodule is one of {names}")
        return found
    if all(isinstance(p, nn.Module) for p in policy):
        members = {id(m) for m in model.modules()}
        for p in policy:
            if id(p) not in members:
                raise WrapPolicyError(f"unit {type(p).__name__} is not a submodule of {type(model).__name__}")
        return policy
    raise WrapPolicyError("units must be all module classes or all modules")


def check_units_disjoint(groups: Sequence[Sequence[nn.Module]]) -> None:
    """No module may sit in two units (a module selected inside another unit, say).

    Tied weights are fine: a parameter held by modules of two units is sharded once, in the root
    unit (see :mod:`.grouping`). One module reachable by two paths is one module.
    """
    owner: dict[int, int] = {}
    for index, group in enumerate(groups):
        for top in group:
            for mod in top.modules():
                if owner.setdefault(id(mod), index) != index:
                    raise WrapPolicyError(
                        f"units overlap: {type(mod).__name__} is inside units {owner[id(mod)]} and {index}; "
                        "give each module to one unit"
                    )
