"""Cephalo for PyTorch Lightning: heterogeneous-GPU training with per-rank batches and uneven sharding.

``import cephalo_lightning`` registers ``Trainer(strategy="cephalo")``. The planner
(:mod:`cephalo_lightning.planner`) is torch-free and importable on its own.
"""

from importlib.util import find_spec

from cephalo_lightning.planner import Cluster, Plan, PlanningError, load_cluster, plan

__all__ = ["Cluster", "Plan", "PlanningError", "load_cluster", "plan"]
__version__ = "0.1.0"


def _lightning_available() -> bool:
    try:
        return find_spec("torch") is not None and find_spec("lightning") is not None
    except (ImportError, ValueError):  # a module blocked in sys.modules
        return False


if _lightning_available():
    from lightning.pytorch.strategies import StrategyRegistry

    from cephalo_lightning.callback import CephaloCallback
    from cephalo_lightning.strategy import CephaloStrategy

    # Lightning has no entry points for strategies: the name exists once this package is imported.
    CephaloStrategy.register_strategies(StrategyRegistry)
    __all__ += ["CephaloCallback", "CephaloStrategy"]
