"""``strategy="cephalo"`` in Lightning's strategy registries (the Trainer's and Fabric's), without
importing Lightning here.

See the comment in :func:`register` for how and why.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

NAME = "cephalo"
DESCRIPTION = "Cephalo: heterogeneous GPUs, uneven sharding"
STRATEGIES_MODULE = "lightning.pytorch.strategies"
FABRIC_STRATEGIES_MODULE = "lightning.fabric.strategies"


def cephalo_strategy(**init_params: Any) -> Any:
    """What the registry calls for ``"cephalo"``: the strategy is imported only when a Trainer asks for it."""
    from cephalo_lightning.lightning.strategy.cephalo_strategy import CephaloStrategy

    return CephaloStrategy(**init_params)


def cephalo_fabric_strategy(**init_params: Any) -> Any:
    """The same for ``Fabric(strategy="cephalo")``: an even plan of the loader's batch unless given one."""
    from cephalo_lightning.lightning.strategy.fabric import CephaloFabricStrategy

    return CephaloFabricStrategy(**init_params)


REGISTRIES = {STRATEGIES_MODULE: ("StrategyRegistry", cephalo_strategy),
              FABRIC_STRATEGIES_MODULE: ("STRATEGY_REGISTRY", cephalo_fabric_strategy)}


def add_to(strategies: ModuleType) -> None:
    """Put the name into the registry of Lightning's (executed) strategies module, Trainer's or Fabric's."""
    registry, factory = REGISTRIES[strategies.__name__]
    getattr(strategies, registry).register(NAME, factory, description=DESCRIPTION, override=True)


class _AddAfterExec(importlib.abc.Loader):
    """Runs the real loader, then registers; the module ends up with its own spec and loader."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__.loader = module.__loader__ = self.loader  # as if this hook did not exist
        self.loader.exec_module(module)
        add_to(module)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in REGISTRIES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _AddAfterExec(spec.loader)
                return spec
        return None


def register() -> None:
    # Lightning has no entry points for strategies and ``import lightning.pytorch`` takes seconds,
    # which the torch-free planner must not pay. So: if Lightning's strategies module has already
    # run, add the name to its StrategyRegistry now; otherwise a meta-path finder waits for that
    # module, lets Lightning's own loader execute it unchanged (same spec and loader afterwards) and
    # adds the name right after, touching nothing but the just-built registry (lightning.pytorch may
    # still be half-initialised then). The registered callable is a factory that imports
    # CephaloStrategy only when a Trainer asks for "cephalo". Fabric's registry
    # (lightning.fabric.strategies' STRATEGY_REGISTRY) gets CephaloFabricStrategy the same way. The
    # finder stays installed, so a reload of either module registers again; it answers no other module.
    for name, (registry, _) in REGISTRIES.items():
        strategies = sys.modules.get(name)
        if strategies is not None and hasattr(strategies, registry):
            add_to(strategies)
    if not any(isinstance(f, _RegisterOnImport) or type(f).__name__ == _RegisterOnImport.__name__ for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
