"""A plan builder for tests: ``plan_of(batches=[9, 3], micro=[3, 1], shares=[0.25, 0.75])`` is the
layered plan whose rank r takes ``batches[r]`` samples in ``micro[r]`` micro-batches (the largest
ceil(b / n)) and ``shares[r]`` of the sharded state, over the global batch sum(batches); a cluster
whose pipelined plan wins (:func:`slow_link_cluster`) and the lines the planning says (:func:`setup_lines`)."""

from __future__ import annotations

import logging
import string
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from cephalo_lightning.planner import Cluster, Plan, RankPlan, cluster_from_dict


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


FWD, BWD = [0.05, 0.09, 0.13], [0.1, 0.18, 0.26]  # one layer's ms at micro-batch 1, 2, 3


def slow_link_cluster(nodes: tuple[int, ...] = (2, 2)) -> Cluster:
    """The tiny Llama of tests/library_models (4 layers, 6224 parameters) on CPU ranks whose nodes are
    joined by 1 Mbit/s: a pipelined plan is predicted about 3x faster than any shard grouping (a margin
    no measured timing enters: the cluster file fixes every figure)."""
    device = {"name": "cpu", "memory_gb": 16.0, "layer_fwd_ms": FWD, "layer_bwd_ms": BWD,
              "compute_memory_gb": [0.01, 0.01, 0.01]}
    return cluster_from_dict({
        "model": {"name": "llama", "num_layers": 4, "parameters": 6224, "hidden_size": 16, "seq_len": 12},
        "settings": {"link_bandwidth": "16 GB/s per rank", "inter_node_bandwidth": "1 Mbit/s per link",
                     "reserved_memory_gb": 0.5},
        "nodes": [{"devices": [device] * n} for n in nodes]})


@contextmanager
def setup_lines() -> Iterator[list[str]]:
    """The lines the planning says while the block runs (Lightning's rank-zero logger: global rank 0's)."""
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
