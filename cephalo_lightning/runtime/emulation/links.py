"""Emulated links between nodes: collectives that cross emulated nodes are slowed to a given bandwidth.

A CPU "cluster" of gloo processes has one fast link between every pair of ranks. To show what a
slow link between nodes does (10-100 Gb/s Ethernet between GPU boxes), each rank's emulation spec
may name its ``node`` and the ``inter_node_gbps`` of the link between nodes
(:class:`~cephalo_lightning.planner.schema.cluster_spec.Emulation`). :class:`EmulatedLinks` prices a collective
for one rank: the bytes it sends to peers on *other* nodes, over that bandwidth, plus a latency
when any byte crosses. The runtime's collectives (``Collectives(..., links=...)``) then make the
collective complete no earlier than that after it was issued; bytes between ranks of one node
travel at the host's own speed, as an intra-node link does.

The bandwidth is per rank and per direction (each rank's sends cross its own link, as with one NIC
per GPU), in GB/s of 10**9 bytes, like the cluster file's ``link_bandwidth_gbps``. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cephalo_lightning.planner.schema.cluster import EmulationSpecError
from cephalo_lightning.planner.schema.cluster_spec import Emulation

__all__ = ["EmulatedLinks", "links_from_emulation"]

GB = 1e9  # bytes per GB in a GB/s bandwidth


@dataclass(frozen=True)
class EmulatedLinks:
    """The emulated topology: every global rank's node, and the link between nodes.

    ``nodes[r]`` is global rank r's node; ``inter_node_gbps`` the bandwidth (GB/s per direction per
    rank) of a send to a rank on another node; ``latency_ms`` added once per collective in which
    any byte crosses nodes.
    """

    nodes: tuple[int, ...]
    inter_node_gbps: float
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.nodes:
            raise EmulationSpecError("EmulatedLinks needs the node of every rank (nodes is empty)")
        bad = [(r, n) for r, n in enumerate(self.nodes) if isinstance(n, bool) or not isinstance(n, int) or n < 0]
        if bad:
            rank, node = bad[0]
            raise EmulationSpecError(f"EmulatedLinks.nodes[{rank}] (rank {rank}) must be a node index >= 0, got {node!r}")
        for name, value, positive in (("inter_node_gbps", self.inter_node_gbps, True),
                                      ("latency_ms", self.latency_ms, False)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (positive and value == 0):
                bound = "> 0" if positive else ">= 0"
                raise EmulationSpecError(f"EmulatedLinks.{name} must be a finite number {bound}, got {value!r}")

    @property
    def world_size(self) -> int:
        return len(self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))

    def crossing_bytes(self, rank: int, peer_bytes: Mapping[int, int]) -> int:
        """The bytes ``rank`` sends to peers on other nodes (``peer_bytes``: global peer -> bytes sent)."""
        self._check_rank(rank, "rank")
        crossing = 0
        for peer, count in peer_bytes.items():
            self._check_rank(peer, "peer")
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"bytes sent to peer {peer} must be a whole number >= 0, got {count!r}")
            if self.nodes[peer] != self.nodes[rank]:
                crossing += count
        return crossing

    def seconds(self, rank: int, peer_bytes: Mapping[int, int]) -> float:
        """How long ``rank``'s sends to peers on other nodes take over the emulated link: their bytes
        over the bandwidth, plus the latency if any byte crosses; 0 when none crosses."""
        crossing = self.crossing_bytes(rank, peer_bytes)
        if crossing == 0:
            return 0.0
        return crossing / (self.inter_node_gbps * GB) + self.latency_ms / 1e3

    def describe(self) -> str:
        """One line for logs; says plainly that the links are emulated."""
        members = ", ".join(
            f"node {node}: ranks {[r for r, n in enumerate(self.nodes) if n == node]}"
            for node in sorted(set(self.nodes)))
        latency = f" + {self.latency_ms:g} ms per collective" if self.latency_ms else ""
        return (f"emulated links: {self.num_nodes} nodes ({members}); sends between nodes at "
                f"{self.inter_node_gbps:g} GB/s per direction per rank{latency} (emulated, not a real network)")

    def _check_rank(self, rank: int, what: str) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(self.nodes):
            raise ValueError(f"{what} {rank!r} is not a global rank of the emulated topology (0..{len(self.nodes) - 1})")


def links_from_emulation(specs: Sequence[Emulation | None], latency_ms: float = 0.0) -> EmulatedLinks | None:
    """The emulated links of every rank's (parsed) spec, or ``None`` when fewer than two nodes are named.

    Checked over all ranks, so every rank fails alike: once any spec names a ``node`` every rank's
    must (a rank outside every node has no link to price); ``inter_node_gbps`` is the one link
    between nodes, so every spec that gives it gives the same figure, and with two or more nodes
    at least one must.
    """
    named = [(rank, spec.node) for rank, spec in enumerate(specs) if spec is not None and spec.node is not None]
    if not named:
        stray = [rank for rank, spec in enumerate(specs) if spec is not None and spec.inter_node_gbps is not None]
        if stray:
            raise EmulationSpecError(
                f"emulate[{stray[0]}] (rank {stray[0]}) gives inter_node_gbps but no rank names its node: give every "
                "rank a node (e.g. node: 0 / node: 1), or drop inter_node_gbps")
        return None
    missing = [rank for rank, spec in enumerate(specs) if spec is None or spec.node is None]
    if missing:
        raise EmulationSpecError(
            f"emulate names the node of rank(s) {[r for r, _ in named]} but not of rank(s) {missing}: give every rank "
            "a node (an int >= 0; ranks of one node share the fast link), or none")
    given = {(rank, spec.inter_node_gbps) for rank, spec in enumerate(specs)
             if spec is not None and spec.inter_node_gbps is not None}
    figures = sorted({gbps for _, gbps in given})
    if len(figures) > 1:
        per_rank = ", ".join(f"rank {r}: {g:g}" for r, g in sorted(given))
        raise EmulationSpecError(
            f"emulate gives different inter_node_gbps ({per_rank}): the link between emulated nodes has one "
            f"bandwidth; give the same figure on every rank (e.g. {figures[0]:g}), or on one rank only")
    nodes = tuple(node for _, node in named)
    if len(set(nodes)) < 2:
        return None
    if not figures:
        raise EmulationSpecError(
            f"emulate puts the ranks on {len(set(nodes))} nodes {sorted(set(nodes))} but gives no inter_node_gbps: "
            "add the emulated link's bandwidth (GB/s per direction per rank, e.g. inter_node_gbps: 1.25) to the "
            "ranks' specs")
    return EmulatedLinks(nodes=nodes, inter_node_gbps=figures[0], latency_ms=latency_ms)
