"""Per-layer collective prices: what one layer's all-gather (AG) and reduce-scatter (RS) cost, for
one group of every rank or for any shard group, over the cluster's link classes.

A group of every rank pays the world's figures, given per layer (``settings.allgather_ms`` /
``reduce_scatter_ms``, measured) or priced as bytes over the link bandwidth, and grows with the
largest share rho::

    AG = (W - 1) / W x layer_parameters x compute_bytes_per_param / bandwidth   (+ latency across nodes)
    RS = (W - 1) / W x layer_parameters x grad_bytes_per_param / bandwidth
    AG(rho) = AG x (1 + slope x (W rho - 1)),  RS(rho) likewise

(``settings.uneven_slope`` when measured, else :data:`UNEVEN_SLOPE`). Other shard groups are
priced from the same figures by :class:`LinkPrices`. The cluster is priced as it stands: a
cluster's ``calibration:`` is folded into its settings first
(:func:`cephalo_lightning.planner.cost.calibration.calibrated`), which the cost model does.

[Note: no free links by default] A cluster of several ranks is priced only where its collectives
have a price: a link bandwidth (the world's own link: ``link_bandwidth`` on one node,
``inter_node_bandwidth`` across nodes), measured ``allgather_ms`` and ``reduce_scatter_ms``, or a
calibration. Without one the collectives would cost 0 s and the plan would trade memory and compute
as if communication were free, which a person reading its samples/s cannot see; so the cluster is
refused (:func:`check_priced`) unless ``settings.free_links`` says a person chose exactly that, and
the plan's output then names it (:mod:`cephalo_lightning.planner.assumptions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cephalo_lightning._common.vocabulary import Collective
from cephalo_lightning.planner.cost.prices import Prices
from cephalo_lightning.planner.schema.cluster_spec import UNMEASURED_OVERLAP, Cluster
from cephalo_lightning.planner.schema.planning_error import PlanningError

# Extra time of an uneven collective per unit of imbalance: a collective whose largest shard is
# rho of the unit costs 1 + slope * (W * rho - 1) times the even one. The bottleneck rank moves
# W * rho times the even bytes in both implementations; these slopes are what
# ``benchmarks/bench_runtime.py`` measured for the two runtime implementations on gloo
# (a 4 MiB fp32 unit, W = 2, 3, 4 ranks on one CPU host, rho from 1/W to 1, all-gather and
# reduce-scatter fitted together through the even point). CPU loopback figures: on one host,
# exact (all_to_all_single) moves the same total bytes at any imbalance, so its slope is ~0 there;
# across a real network the busiest rank's link is the bottleneck and both should approach 1.
# A cluster's own measurement (``settings.uneven_slope``, written by the profiler) replaces them.
UNEVEN_SLOPE = {Collective.PADDED: 0.97, Collective.EXACT: 0.01}

# Data parallelism's gradient buckets (runtime/sharding/replicas.py cuts them by these): DDP's first
# bucket, closed early so the backward's last units start reducing, then bucket_cap_mb.
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


def bucket_layers(num_layers: int, layer_bytes: float) -> list[int]:
    """Layers per data-parallel gradient bucket, in reduction order (the last layer first): layers of
    ``layer_bytes`` each, cut as the runtime cuts its buckets."""
    sizes, held, count = [], 0.0, 0
    for _ in range(num_layers):
        held += layer_bytes
        count += 1
        if held >= (BUCKET_BYTES if sizes else FIRST_BUCKET_BYTES):
            sizes.append(count)
            held, count = 0.0, 0
    return sizes + [count] if count else sizes


def exposed_bucket_fraction(num_layers: int, layer_bytes: float) -> float:
    """Of a data-parallel step's gradient all-reduce, the part its buckets leave after the backward
    pass beyond one layer's: the last bucket closes with the backward's last layer, so its all-reduce
    starts when no compute is left to hide it. One layer's reduction is left after the backward by
    every schedule (a sharded group's last reduce-scatter too), and the cost model leaves it out
    alike; the layers the last bucket holds beyond that one are exposed."""
    sizes = bucket_layers(num_layers, layer_bytes)
    return (sizes[-1] - 1) / num_layers if sizes else 0.0

@dataclass(frozen=True)
class Communication:
    """Per-layer collective times (ms) for even shares, how unevenness scales them, the overlap."""

    allgather_ms: float
    reduce_scatter_ms: float
    world_size: int
    uneven_slope: float
    overlap: float = UNMEASURED_OVERLAP

    def factor(self, max_share: float) -> float:
        return 1.0 + self.uneven_slope * max(0.0, self.world_size * max_share - 1.0)

    def allgather(self, max_share: float) -> float:
        return self.allgather_ms * self.factor(max_share)

    def reduce_scatter(self, max_share: float) -> float:
        return self.reduce_scatter_ms * self.factor(max_share)


@dataclass(frozen=True)
class LinkPrices:
    """Per-layer collective prices of any shard group, from the whole world's figures and the link classes.

    A group of k ranks moves (k - 1) / k of a layer per rank in an all-gather or a reduce-scatter, over
    its slowest link: inside one node the intra-node link, else the inter-node one. The world's
    figures (measured ``allgather_ms`` / ``reduce_scatter_ms``, else bytes over the bandwidth of the
    world's own link class) are scaled by the bytes and by the ratio of the two bandwidths (1 when
    either is unknown). With G > 1 groups the reduced gradient pieces are summed across the replicas:
    each rank sends 2 (G - 1) / G of its gradient shard (at most rho of a layer). When the cluster
    spans nodes and the inter-node bandwidth is known, the fraction ``far`` of that which goes to
    ranks on other nodes (:func:`far_fraction`) is priced over that bandwidth and the rest over the
    intra-node link, the two at once (separate links); else all of it over the world's link.
    ``latency_ms`` is added to every collective that crosses nodes when priced from a bandwidth (a
    measured time includes its own).
    """

    allgather_ms: float  # the world as one group, even shares, without latency
    reduce_scatter_ms: float
    world_size: int
    world_crosses: bool  # the world spans more than one node
    intra_ratio: float  # time per byte on the intra-node link / on the world's link
    inter_ratio: float
    latency_ms: float
    uneven_slope: float
    inter_layer_ms: float | None = None  # a whole layer's gradient over the inter-node link (bandwidth known)
    exposed_fraction: float = 0.0  # groups of one rank: exposed_bucket_fraction

    def _per_group(self, size: np.ndarray, crosses: np.ndarray, rho: np.ndarray, groups: int, far: float
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        size = np.asarray(size, dtype=float)
        crosses = np.asarray(crosses, dtype=bool)
        rho = np.asarray(rho, dtype=float)
        W = self.world_size
        if W == 1:
            zero = np.zeros(np.broadcast(size, rho).shape)
            return zero, zero, zero
        world_fraction = (W - 1) / W
        scale = np.where(size > 1, (size - 1) / np.maximum(size, 1) / world_fraction, 0.0)
        ratio = np.where(crosses, self.inter_ratio, self.intra_ratio)
        latency = np.where(crosses & (size > 1), self.latency_ms, 0.0)
        factor = 1.0 + self.uneven_slope * np.maximum(0.0, size * rho - 1.0)
        ag = (self.allgather_ms * scale * ratio + latency) * factor
        rs = (self.reduce_scatter_ms * scale * ratio + latency) * factor
        if groups > 1:
            sent = 2.0 * (groups - 1) / groups * rho  # of a layer's gradient, per rank
            per_layer = self.reduce_scatter_ms / world_fraction  # a whole layer's gradient over the world's link
            if self.world_crosses and self.inter_layer_ms is not None:
                across = sent * far * self.inter_layer_ms + (self.latency_ms if far > 0 else 0.0)
                within = sent * (1.0 - far) * per_layer * self.intra_ratio
                rs = rs + np.maximum(across, within)
            else:
                cross_ratio = self.inter_ratio if self.world_crosses else self.intra_ratio
                cross_latency = self.latency_ms if self.world_crosses else 0.0
                rs = rs + sent * per_layer * cross_ratio + cross_latency
        exposed = np.zeros(np.broadcast(size, rho).shape)
        if groups == W:  # groups of one rank: the all-reduce of the last bucket follows the backward
            exposed = rs * self.exposed_fraction
            rs = rs - exposed
        return ag, rs, exposed

    def group(self, size: int, crosses: bool, rho: float, groups: int, far: float = 1.0
              ) -> tuple[Prices, float]:
        """(all-gather and reduce-scatter plus the cross-group reduction, exposed) of one layer for one
        group (ms); ``far``: the grouping's :func:`far_fraction`. The exposed part follows the
        backward pass instead of overlapping it: :func:`.cluster_cost.collective_ms`."""
        ag, rs, exposed = self._per_group(np.array(size), np.array(crosses), np.array(rho), groups, far)
        return Prices(float(ag), float(rs)), float(exposed)

    def one_group(self, size: int, crosses: bool, rho: np.ndarray) -> Prices:
        """One layer's all-gather and reduce-scatter of a lone group (no replicas) at each of several
        largest shares ``rho`` (arrays of ``rho``'s shape)."""
        ag, rs, _ = self._per_group(np.array(size), np.array(crosses), np.asarray(rho, dtype=float), 1, 0.0)
        return Prices(ag, rs)

    def ranks(self, group_of: np.ndarray, nodes: np.ndarray, shares: np.ndarray) -> tuple[Prices, np.ndarray]:
        """Every rank's (all-gather and reduce-scatter + cross-group, exposed) per layer under a grouping."""
        G = int(group_of.max()) + 1 if len(group_of) else 0
        size = np.bincount(group_of, minlength=G)
        rho = np.zeros(G)
        np.maximum.at(rho, group_of, shares)
        low = np.full(G, np.iinfo(np.int64).max)
        high = np.full(G, -1)
        np.minimum.at(low, group_of, nodes)
        np.maximum.at(high, group_of, nodes)
        ag, rs, exposed = self._per_group(size, low != high, rho, G, far_fraction(group_of, nodes))
        return Prices(ag[group_of], rs[group_of]), exposed[group_of]


def far_fraction(group_of: np.ndarray, nodes: np.ndarray) -> float:
    """Of what a rank sends in the cross-group reduction, the part that goes to other nodes: the most
    over the ranks (the busiest link decides). A rank exchanges its range with the ranks of every other
    group that own it; each other group counts by the fraction of its ranks on another node."""
    group_of = np.asarray(group_of, dtype=np.int64)
    nodes = np.asarray(nodes, dtype=np.int64)
    G = int(group_of.max()) + 1 if len(group_of) else 0
    if G < 2:
        return 0.0
    node = np.unique(nodes, return_inverse=True)[1].ravel()
    size = np.bincount(group_of, minlength=G).astype(float)
    # sum over every group g of the fraction of g's ranks on each node (O(W), no group x node table)
    here = np.bincount(node, weights=1.0 / size[group_of])
    pair = np.unique(group_of * (int(node.max()) + 1) + node, return_inverse=True, return_counts=True)
    own_here = pair[2][pair[1].ravel()] / size[group_of]  # of the rank's own group, on its node
    per_rank = ((G - here[node]) - (1.0 - own_here)) / (G - 1)
    return float(per_rank.max())


def _check_folded(cluster: Cluster) -> None:
    """Refuses a cluster that still carries its calibration: its settings are not yet the ones to price."""
    if cluster.calibration is not None:
        raise PlanningError("collective prices are read from a cluster's settings as they stand, and this cluster "
                            "still carries its calibration; fold it in first with "
                            "cephalo_lightning.planner.cost.calibration.calibrated(cluster)")


EXAMPLE_LINKS = "link_bandwidth: 16 GB/s per rank, inter_node_bandwidth: 10 Gbit/s per link"


def check_priced(cluster: Cluster) -> None:
    """Refuses a cluster of several ranks whose collectives have no price, naming what to write
    ([Note: no free links by default])."""
    s, world = cluster.settings, cluster.world_size
    given = [name for name, value in (("link_bandwidth", s.link_bandwidth_gbps),
                                      ("inter_node_bandwidth", s.inter_node_bandwidth_gbps),
                                      ("allgather_ms", s.allgather_ms), ("reduce_scatter_ms", s.reduce_scatter_ms))
             if value]
    if s.free_links:
        if given:
            raise PlanningError(f"settings.free_links is true (collectives cost nothing) but settings also give "
                                f"{', '.join(given)}, which price them; keep one: drop free_links to price the "
                                f"collectives, or drop {', '.join(given)} to plan compute and memory alone")
        return
    if world == 1 or cluster.calibration is not None:
        return
    crosses = cluster.num_nodes > 1
    own = s.inter_node_bandwidth_gbps if crosses else s.link_bandwidth_gbps
    measured = bool(s.allgather_ms) and bool(s.reduce_scatter_ms)
    if measured or own:
        return
    if bool(s.allgather_ms) != bool(s.reduce_scatter_ms):
        missing = "reduce_scatter_ms" if s.allgather_ms else "allgather_ms"
        raise PlanningError(f"settings give {'allgather_ms' if s.allgather_ms else 'reduce_scatter_ms'} but not "
                            f"{missing}, so the {missing.split('_ms')[0].replace('_', '-')} would cost 0 s; give "
                            f"{missing} too (as measured), or a link bandwidth to price it ({EXAMPLE_LINKS})")
    if crosses and s.link_bandwidth_gbps:
        raise PlanningError(
            f"the cluster spans {cluster.num_nodes} nodes but settings give only link_bandwidth (the link inside a "
            f"node, {s.link_bandwidth_gbps:g} GB/s per rank), so the network between the nodes would be priced as "
            "fast as that; write its bandwidth, e.g. inter_node_bandwidth: 10 Gbit/s per link (10 GbE), or profile "
            "the cluster (python -m cephalo_lightning profile)")
    where = (f"between its {cluster.num_nodes} nodes: write inter_node_bandwidth, e.g. 10 Gbit/s per link (10 GbE), "
             "and link_bandwidth inside a node, e.g. 16 GB/s per rank (PCIe 4.0)") if crosses else \
        "of one node: write link_bandwidth, e.g. 16 GB/s per rank (PCIe 4.0) or 150 GB/s per rank (NVLink)"
    raise PlanningError(
        f"the cluster's {world} ranks exchange every layer's parameters and gradients, but settings give no link "
        f"bandwidth and no measured allgather_ms / reduce_scatter_ms, so the collectives would cost 0 s; give the "
        f"links {where}; or profile the cluster (python -m cephalo_lightning profile); or set free_links: true "
        "to plan compute and memory alone")


def link_prices(cluster: Cluster) -> LinkPrices:
    """The cluster's link classes and the world group's collective figures (see :class:`LinkPrices`)."""
    _check_folded(cluster)
    s, model, world = cluster.settings, cluster.model, cluster.world_size
    crosses = cluster.num_nodes > 1
    intra = s.link_bandwidth_gbps
    inter = s.inter_node_bandwidth_gbps or intra
    own = inter if crosses else intra
    ag, rs = s.allgather_ms, s.reduce_scatter_ms
    measured_ag, measured_rs = bool(ag), bool(rs)
    if own and world > 1:
        moved = (world - 1) / world * model.layer_parameters
        bandwidth = own * 1e9  # bytes/s
        ag = ag or moved * model.compute_bytes_per_param / bandwidth * 1e3
        rs = rs or moved * model.grad_bytes_per_param / bandwidth * 1e3
    if world == 1:
        ag = rs = 0.0

    def ratio(link: float | None) -> float:
        return own / link if own and link else 1.0

    latency = 0.0 if measured_ag or measured_rs else s.inter_node_latency_ms
    slope = s.uneven_slope if s.uneven_slope is not None else UNEVEN_SLOPE[s.collective]
    inter_layer_ms = (model.layer_parameters * model.grad_bytes_per_param / (s.inter_node_bandwidth_gbps * 1e9) * 1e3
                      if crosses and s.inter_node_bandwidth_gbps else None)
    exposed = exposed_bucket_fraction(model.num_layers, model.layer_parameters * model.grad_bytes_per_param)
    return LinkPrices(ag, rs, world, crosses, ratio(intra), ratio(inter), latency, slope, inter_layer_ms, exposed)


def communication(cluster: Cluster) -> Communication:
    """Price the collectives of one group of every rank: given per-layer times, or bytes over the link bandwidth."""
    _check_folded(cluster)
    prices = link_prices(cluster)
    ag, rs = prices.allgather_ms, prices.reduce_scatter_ms
    if prices.world_crosses and cluster.world_size > 1:
        ag, rs = ag + prices.latency_ms, rs + prices.latency_ms
    return Communication(ag, rs, cluster.world_size, prices.uneven_slope, cluster.settings.priced_overlap)


def single_group(shard_groups: Sequence[int] | np.ndarray | None) -> bool:
    """Whether a per-rank group index names one group of every rank (None: yes)."""
    if shard_groups is None:
        return True
    g = np.asarray(shard_groups)
    return not len(g) or bool((g == g[0]).all())

