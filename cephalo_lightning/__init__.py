"""Cephalo for PyTorch Lightning: heterogeneous-GPU training with per-rank batches and uneven sharding.

``import cephalo_lightning`` registers ``Trainer(strategy="cephalo")``. The planner
(:mod:`cephalo_lightning.planner`) is torch-free and importable on its own.
"""

from cephalo_lightning.planner import Cluster, Plan, PlanningError, load_cluster, plan

__all__ = ["Cluster", "Plan", "PlanningError", "load_cluster", "plan"]
__version__ = "0.1.0"
