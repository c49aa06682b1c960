"""Turn an assignment (batches, micro-batch counts, shares) into priced RankPlans."""

from __future__ import annotations

from collections.abc import Sequence

from cephalo_lightning.planner.cluster import Cluster
from cephalo_lightning.planner.cost import evaluate, split_sizes
from cephalo_lightning.planner.plan import RankPlan


def rank_plans(
    cluster: Cluster, batch: Sequence[int], micro: Sequence[int], shares: Sequence[float]
) -> tuple[tuple[RankPlan, ...], float]:
    """Every rank's plan priced by the cost model, and the predicted step time (s)."""
    costs = evaluate(cluster, batch, micro, shares)
    fraction = cluster.settings.usable_memory_fraction
    ranks = []
    for rank, (device, b, n, r, cost) in enumerate(zip(cluster.devices, batch, micro, shares, costs)):
        n = int(n) if b else 1
        ranks.append(RankPlan(
            rank=rank,
            device=device.name,
            batch_size=int(b),
            num_micro_batches=n,
            micro_batch_size=split_sizes(int(b), n)[0] if b else 0,
            state_share=float(r),
            predicted_step_s=cost.step_s,
            predicted_memory_gb=cost.memory_gb,
            source=device.source,
            memory_limit_gb=fraction * device.memory_gb,
            memory_capacity_gb=device.memory_gb,
        ))
    return tuple(ranks), max(c.step_s for c in costs)


def model_summary(cluster: Cluster) -> dict[str, object]:
    """What the plan records about the model and settings it was made for."""
    m = cluster.model
    return {"name": m.name, "parameters": m.parameters, "num_layers": m.num_layers,
            "state_bytes_per_param": m.state_bytes_per_param}
