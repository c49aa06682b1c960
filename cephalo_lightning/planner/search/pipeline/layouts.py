"""Which ranks compute which stage: candidate layouts from the node structure, cut at slow links first.

With N nodes (each node's ranks in rank order) and k sub-stages per node, every node splits into k
blocks of D = min_j(c_j) // k ranks (c_j: node j's ranks; the ranks beyond k D of a node stay idle)
and the stages are the blocks, node by node::

    S = N k,   stage (j, q) = node order[j]'s ranks [q D, (q + 1) D),   pipeline d = rank d of every block

so the cut between nodes (the slow link) is a stage boundary, a stage's shard group stays inside
one node (its collectives on the fast link), and k > 1 adds cuts inside nodes. The node orders
weighed: every order for up to three nodes, the given one and its reverse beyond. One node: its
ranks split into k >= 2 blocks, in rank order and reversed.

[Note: layouts not searched] A stage's group spanning nodes, blocks of unequal size, a stage mixing
blocks of two nodes, and more than :data:`MAX_ORDERS` node orders are not weighed; the plan's
certificate covers the layouts listed here only.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations

from cephalo_lightning.planner.schema.cluster_spec import Cluster

MAX_ORDERS = 6  # node orders weighed (3! for three nodes)


@dataclass(frozen=True)
class StageLayout:
    """Pipelines as chains of ranks (stage 0 first) and the ranks left idle."""

    chains: tuple[tuple[int, ...], ...]
    idle: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.chains[0])

    @property
    def num_pipelines(self) -> int:
        return len(self.chains)

    def describe(self) -> str:
        return f"{self.num_pipelines} pipeline(s) x {self.num_stages} stages"


def node_ranks(cluster: Cluster) -> list[tuple[int, ...]]:
    """Every node's ranks, nodes in order of their first rank."""
    found: dict[int, list[int]] = {}
    for rank, node in enumerate(cluster.nodes):
        found.setdefault(node, []).append(rank)
    return [tuple(r) for r in found.values()]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def stage_layouts(cluster: Cluster) -> list[StageLayout]:
    """Every layout weighed (see the module), at most ``model.num_layers`` stages."""
    nodes = node_ranks(cluster)
    layers = cluster.model.num_layers
    if len(nodes) == 1:
        orders = [nodes]
        size = len(nodes[0])
        splits = [k for k in _divisors(size) if k >= 2]
    else:
        orders = [list(o) for o in permutations(nodes)] if len(nodes) <= 3 else [nodes, nodes[::-1]]
        size = min(len(n) for n in nodes)
        splits = _divisors(size)
    out: list[StageLayout] = []
    seen: set[tuple[tuple[int, ...], ...]] = set()
    for order in orders[:MAX_ORDERS]:
        for k in splits:
            D = size // k
            blocks = [node[q * D:(q + 1) * D] for node in order for q in range(k)]
            if len(blocks) > layers or len(blocks) < 2:
                continue
            chains = tuple(tuple(block[d] for block in blocks) for d in range(D))
            for candidate in (chains, tuple(c[::-1] for c in chains)) if len(nodes) == 1 else (chains,):
                if candidate in seen:
                    continue
                seen.add(candidate)
                used = {r for c in candidate for r in c}
                out.append(StageLayout(candidate, tuple(r for r in range(cluster.world_size) if r not in used)))
    return out
