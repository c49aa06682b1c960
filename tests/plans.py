"""A plan builder for tests: ``plan_of(batches=[9, 3], micro=[3, 1], shares=[0.25, 0.75])`` is the
layered plan whose rank r takes ``batches[r]`` samples in ``micro[r]`` micro-batches (the largest
ceil(b / n)) and ``shares[r]`` of the sharded state, over the global batch sum(batches)."""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

from cephalo_lightning.planner import Plan, RankPlan


def plan_of(*, batches: Sequence[int], micro: Sequence[int], shares: Sequence[float], mode: str = "layered",
            devices: Sequence[str] | None = None, groups: Sequence[int] | None = None, **per_rank: Sequence[Any]) -> Plan:
    """Rank r on device ``devices[r]`` ("a", "b", ... by default) in shard group ``groups[r]`` (0 by default);
    each of ``per_rank`` is another ``RankPlan`` field, one value a rank (``memory_capacity_gb=[0.5, 0.25]``)."""
    if not len(batches) == len(micro) == len(shares):
        raise ValueError(f"one batch, micro-batch count and share per rank: {batches}, {micro}, {shares}")
    devices = devices or string.ascii_lowercase[: len(batches)]
    groups = groups or [0] * len(batches)
    ranks = tuple(RankPlan(rank=r, device=device, batch_size=b, num_micro_batches=n, micro_batch_size=-(-b // n),
                           state_share=share, shard_group=g, **{field: values[r] for field, values in per_rank.items()})
                  for r, (device, b, n, share, g) in enumerate(zip(devices, batches, micro, shares, groups)))
    return Plan(sum(batches), mode, ranks)
