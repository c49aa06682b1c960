"""Which modules become units: the wrap policy."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

WrapPolicy = Sequence[type[nn.Module]] | Sequence[nn.Module] | None


class WrapPolicyError(ValueError):
    """The model has no units the runtime can shard by, or shares a parameter between units."""


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


def check_no_shared_parameters(model: nn.Module, units: Sequence[nn.Module]) -> None:
    """A parameter held by two modules (tied weights) cannot be owned by one shard; say which.

    One module reachable by two paths (an adapter wrapping a submodule) is not tying: it is the
    same module, and its parameters are sharded once.
    """
    holders: dict[int, tuple[str, int]] = {}
    for mod_name, mod in model.named_modules():
        for attr, param in mod._parameters.items():
            if param is None:
                continue
            name = f"{mod_name}.{attr}" if mod_name else attr
            first = holders.setdefault(id(param), (name, id(mod)))
            if first[1] != id(mod):
                raise WrapPolicyError(
                    f"parameters {first[0]!r} and {name!r} are the same tensor (tied weights). Cephalo "
                    "shards each unit's parameters separately: untie them (give the head its own weight)"
                )
    owners: dict[int, int] = {}
    for i, unit in enumerate(units):
        for param in unit.parameters():
            if owners.setdefault(id(param), i) != i:
                raise WrapPolicyError("units overlap: a module was selected inside another unit")
