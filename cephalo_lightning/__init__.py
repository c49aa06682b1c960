"""Cephalo for PyTorch Lightning: heterogeneous-GPU training with per-rank batches and uneven sharding.

``import cephalo_lightning`` registers ``Trainer(strategy="cephalo")`` and ``Fabric(strategy="cephalo")``
(before or after ``import lightning``) without importing torch or Lightning itself;
``CephaloStrategy`` and ``CephaloCallback`` are imported on first use. The planner (:mod:`cephalo_lightning.planner`)
is torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cephalo_lightning import _registration
from cephalo_lightning.planner import Cluster, Plan, PlanningError, load_cluster, plan

__all__ = ["CephaloCallback", "CephaloStrategy", "Cluster", "Layer", "Plan", "PlanningError", "consolidated",
           "full_shape", "load_cluster", "plan"]
__version__ = "0.1.0"

_LAZY = {
    "CephaloStrategy": "cephalo_lightning.lightning.strategy.cephalo_strategy",
    "CephaloCallback": "cephalo_lightning.lightning.callback.cephalo_callback",
    "consolidated": "cephalo_lightning.lightning.fit.checkpoint_io",
    "Layer": "cephalo_lightning.runtime.layered",
    "full_shape": "cephalo_lightning.runtime.sharding.flat_unit",
}

if TYPE_CHECKING:
    from cephalo_lightning.lightning.callback.cephalo_callback import CephaloCallback
    from cephalo_lightning.lightning.fit.checkpoint_io import consolidated
    from cephalo_lightning.lightning.strategy.cephalo_strategy import CephaloStrategy
    from cephalo_lightning.runtime.layered import Layer
    from cephalo_lightning.runtime.sharding.flat_unit import full_shape

_registration.register()


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
