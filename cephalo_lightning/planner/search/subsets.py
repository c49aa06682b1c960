"""Leaving devices out: the subsets of the ranks weighed as plans of their own.

A plan over a subset gives the ranks outside it nothing (``RankPlan.idle``: no samples, no state,
in no shard group); it is faster where those ranks' share of the collectives or the slow link they
sit behind costs more than their compute brings. Weighed:

* up to :data:`EVERY_SUBSET_RANKS` ranks: every non-empty proper subset (identical devices on one
  node counted once: a subset is known by how many ranks of each (device, node) it keeps);
* beyond: every non-empty proper union of nodes, and the cluster with every rank of one device
  kind left out.

[Note: subsets not searched] Beyond :data:`EVERY_SUBSET_RANKS` ranks, single devices left out of a
node (and any subset other than those above) are not weighed.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations

from cephalo_lightning.planner.schema.cluster_spec import Cluster

EVERY_SUBSET_RANKS = 4


def _signature(cluster: Cluster, ranks: tuple[int, ...]) -> tuple:
    """What makes two subsets the same plan: how many ranks of each (device, node) they keep."""
    counts: dict[tuple, int] = {}
    for r in ranks:
        key = (cluster.devices[r], cluster.nodes[r])
        counts[key] = counts.get(key, 0) + 1
    return tuple(sorted(counts.items(), key=repr))


def candidate_subsets(cluster: Cluster) -> list[tuple[int, ...]]:
    """The subsets weighed (see the module), each in rank order, smallest first, one per signature."""
    W = cluster.world_size
    found: list[tuple[int, ...]] = []
    if W <= EVERY_SUBSET_RANKS:
        found = [c for k in range(1, W) for c in combinations(range(W), k)]
    else:
        nodes: dict[int, list[int]] = {}
        for rank, node in enumerate(cluster.nodes):
            nodes.setdefault(node, []).append(rank)
        groups = list(nodes.values())
        for k in range(1, len(groups)):
            for chosen in combinations(groups, k):
                found.append(tuple(sorted(r for g in chosen for r in g)))
        for name in sorted({d.name for d in cluster.devices}):
            kept = tuple(r for r, d in enumerate(cluster.devices) if d.name != name)
            if 0 < len(kept) < W:
                found.append(kept)
    seen: set[tuple] = set()
    out = []
    for subset in found:
        key = _signature(cluster, subset)
        if key not in seen:
            seen.add(key)
            out.append(subset)
    return out


def sub_cluster(cluster: Cluster, ranks: tuple[int, ...]) -> Cluster:
    """The cluster of the ranks kept (their devices and nodes, in rank order)."""
    return replace(cluster, devices=tuple(cluster.devices[r] for r in ranks))
