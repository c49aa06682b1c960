"""The assignment planner (torch-free): per-GPU batch, micro-batches and state share."""

from cephalo_lightning.planner.cost.cluster_cost import evaluate
from cephalo_lightning.planner.planning import plan
from cephalo_lightning.planner.schema.cluster import cluster_from_dict, cluster_to_dict, load_cluster, save_cluster
from cephalo_lightning.planner.schema.cluster_spec import Cluster, DeviceProfile, Emulation, ModelSpec, Settings
from cephalo_lightning.planner.schema.plan import BaselineResult, ModelSummary, Plan, RankPlan, split_sizes
from cephalo_lightning.planner.schema.planning_error import PlanningError

__all__ = [
    "BaselineResult", "Cluster", "DeviceProfile", "Emulation", "ModelSpec", "ModelSummary", "Plan", "PlanningError",
    "RankPlan", "Settings", "cluster_from_dict", "cluster_to_dict", "evaluate", "load_cluster", "plan",
    "save_cluster", "split_sizes",
]
