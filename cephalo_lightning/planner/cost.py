"""The cost model: predicted step time and memory of every rank for a given assignment.

Per transformer layer, with F(m), B(m) one layer's forward (no grad) and backward time at
micro-batch size m (the profiler's B is recompute-with-grad plus backward minus F), AG / RS the
all-gather and reduce-scatter of one layer, c the overhead of one extra micro-batch, X the host
copy of one sample's stashed layer input (zero unless ``settings.offload_stash``), and
``comb(comm, compute) = max + (1 - overlap) * min`` (overlap 1: communication hides behind
compute, ``max``; overlap 0: serial, ``comm + compute``)::

    layered, recomputing (the default):
        fwd_i = comb(AG,      sum_k F(s_k) + b X)
        bwd_i = comb(AG + RS, sum_k (F(s_k) + B(s_k)) + b X + (n_i - 1) c)
    layered, one micro-batch keeping its autograd graph (RankPlan.recompute = False):
        fwd_i = comb(AG, F(b)),   bwd_i = comb(AG + RS, B(b))
    uniform (micro-batch-major: every micro-batch gathers every layer, graph kept, one RS):
        fwd_i = comb(G_i AG,      sum_k F(s_k))
        bwd_i = comb(G_i AG + RS, sum_k B(s_k) + (n_i - 1) c)
        G_i = 1 + (n_i - 1) q    (q: settings.repeated_gather_fraction, 1 unless calibrated: a
                                  layer's first gather in a pass also holds the ranks' wait for
                                  each other, its repeats only the transfer)
    step_i = contention * (num_layers * (fwd_i + bwd_i) + optimizer_ns_per_param_i * r_i * trainable) + step_overhead
    step   = max_i step_i

With ``settings.sync_passes`` (the profiler sets it) every layer's pass ends together on the ranks of
one shard group, as its collectives wait for the group's slowest rank, so a rank's step is at least
its group's::

    step_g = contention * (num_layers * (max_{i in g} fwd_i + max_{i in g} bwd_i) + max_{i in g} opt_i) + step_overhead

which exceeds the slowest rank's sum where ranks split their time between the passes differently
(one recomputes, another keeps its graph; kinds whose forward and backward scale apart). The solve
prices ranks alone (a lower bound of this), and the plan's price and certified gap include it.

A cluster's ``calibration:`` block (terms measured on a run) is folded in first
(:func:`cephalo_lightning.planner.calibration.calibrated`); ``step_overhead`` is zero and
``contention`` one without one.

where s_1..s_n are rank i's near-equal micro-batch sizes and r_i its state share (the optimizer
updates only the rank's own share). AG and RS grow with the largest share rho by
``1 + slope * (W rho - 1)`` (``settings.uneven_slope`` when measured, else :data:`UNEVEN_SLOPE`).
Memory of rank i::

    compute_memory_i(m_i) [+ activation_memory_i(m_i) when the graph is kept]
        [+ compute_bytes_per_param * trainable in uniform mode with n_i > 1: the whole model's
           unsharded gradient accumulates, in the compute dtype, until the last micro-batch]
        [+ b_i * model.kept_bytes in layered mode, recomputing, with ``settings.stash_on_device``:
           the stash (every layer's input of every sample, and the last layer's outputs until the
           loss) held between the two passes; measured by the profiler]
        + reserved + state_bytes * r_i  <=  usable_memory_fraction * memory_i

    state_bytes = state_bytes_per_param * trainable + weight_bytes_per_param * frozen

(:class:`~cephalo_lightning.planner.cluster.ModelSpec`): every parameter's stored weight, and the
gradient and optimizer moments of the trainable ones only (LoRA: the frozen base costs its weights).
The all-gathers and reduce-scatters move every parameter of a layer (frozen ones included: the
runtime reduces a unit's flat gradient whole).

Ranks sharing one host (``settings.host_cores`` = K, CPU ranks and emulated clusters) compete for
its cores: an emulated slow rank sleeps through (1 - 1/slowdown) of its compute, and only its real
compute needs a core. The step is then at least every rank's real compute spread over the cores::

    step >= step_overhead + sum_i busy_i / slowdown_i / K      (busy_i: layers and optimizer step)

(:func:`shared_host_floor_ms`); without ``host_cores`` (one device per rank) there is no such term.

Profiles are piecewise linear between measured sizes; beyond the last measured size each series is
extrapolated on its own, linearly through its last two points (one point: proportionally,
f(m) = m f(1)). Series are made non-decreasing (a running maximum): a larger micro-batch never
costs less time or memory, which keeps noisy profiles from producing absurd plans.

Memory is in GiB (2**30 bytes), as ``torch.cuda`` reports it; times in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

from cephalo_lightning._common.units import GIB
from cephalo_lightning.planner.calibration import calibrated
from cephalo_lightning.planner.cluster import Cluster, DeviceProfile, Settings
from cephalo_lightning.planner.errors import PlanningError

if TYPE_CHECKING:
    from cephalo_lightning.planner.plan import Plan


# Extra time of an uneven collective per unit of imbalance: a collective whose largest shard is
# rho of the unit costs 1 + slope * (W * rho - 1) times the even one. The bottleneck rank moves
# W * rho times the even bytes in both implementations; these slopes are what
# ``benchmarks/bench_runtime.py`` measured for the two runtime implementations on gloo
# (a 4 MiB fp32 unit, W = 2, 3, 4 ranks on one CPU host, rho from 1/W to 1, all-gather and
# reduce-scatter fitted together through the even point). CPU loopback figures: on one host,
# exact (all_to_all_single) moves the same total bytes at any imbalance, so its slope is ~0 there;
# across a real network the busiest rank's link is the bottleneck and both should approach 1.
# A cluster's own measurement (``settings.uneven_slope``, written by the profiler) replaces them.
UNEVEN_SLOPE = {"padded": 0.97, "exact": 0.01}

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

MODES = ("layered", "uniform")


def split_sizes(batch_size: int, num_micro_batches: int) -> list[int]:
    """Near-equal micro-batch sizes, largest first; an empty batch has no micro-batches."""
    if batch_size == 0:
        return []
    if num_micro_batches < 1 or num_micro_batches > batch_size:
        raise PlanningError(f"cannot split {batch_size} samples into {num_micro_batches} micro-batches; use 1 to "
                            f"{max(batch_size, 1)} micro-batches")
    q, rem = divmod(batch_size, num_micro_batches)
    return [q + 1] * rem + [q] * (num_micro_batches - rem)


def _monotone(series: Sequence[float]) -> np.ndarray:
    return np.maximum.accumulate(np.asarray(series, dtype=float))


class PiecewiseLinear:
    """f(m) for integer m >= 0 from measured f(1..k): linear between points, linear beyond."""

    def __init__(self, measured: Sequence[float], at_zero: str = "zero") -> None:
        self.points = _monotone(measured)
        k = len(self.points)
        self.slope = float(self.points[-1] - self.points[-2]) if k >= 2 else float(self.points[0])
        if at_zero == "zero":
            self.zero = 0.0
        elif k >= 2:  # memory at m=0: the intercept (gathered layer, workspace), never negative
            self.zero = float(max(0.0, min(self.points[0], 2 * self.points[0] - self.points[1])))
        else:
            self.zero = float(self.points[0])

    def __call__(self, m: int | np.ndarray) -> np.ndarray:
        m_arr = np.asarray(m, dtype=np.int64)
        k = len(self.points)
        inside = np.clip(m_arr, 1, k)
        values = self.points[inside - 1] + self.slope * np.maximum(m_arr - k, 0)
        values = np.where(m_arr <= 0, self.zero, values)
        return values if values.ndim else float(values)

    def largest_within(self, limit: float, top: int) -> int:
        """The largest m in 0..top with f(m) <= limit (-1 when even f(0) is above it)."""
        if float(self(0)) > limit:
            return -1
        k = len(self.points)
        inside = int(np.searchsorted(self.points, limit, side="right"))  # f(1..inside) <= limit
        if inside < k or self.slope <= 0:
            return min(top, inside) if inside < k else top
        m = min(top, k + int(np.floor((limit - self.points[-1]) / self.slope)) + 1)
        while m > 0 and float(self(m)) > limit:  # floating-point overshoot of the division
            m -= 1
        return m


def combine(comm: np.ndarray | float, compute: np.ndarray | float, overlap: float) -> np.ndarray:
    """Time of communication and compute that overlap by ``overlap`` (1: max, 0: sum)."""
    return np.maximum(comm, compute) + (1.0 - overlap) * np.minimum(comm, compute)


@dataclass(frozen=True)
class Communication:
    """Per-layer collective times (ms) for even shares, how unevenness scales them, the overlap."""

    allgather_ms: float
    reduce_scatter_ms: float
    world_size: int
    uneven_slope: float
    overlap: float = 1.0

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
              ) -> tuple[float, float, float]:
        """(all-gather, reduce-scatter plus the cross-group reduction, exposed) of one layer for one
        group (ms); ``far``: the grouping's :func:`far_fraction`. The exposed part follows the
        backward pass instead of overlapping it: :func:`collective_ms`."""
        ag, rs, exposed = self._per_group(np.array(size), np.array(crosses), np.array(rho), groups, far)
        return float(ag), float(rs), float(exposed)

    def ranks(self, group_of: np.ndarray, nodes: np.ndarray, shares: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every rank's (all-gather, reduce-scatter + cross-group, exposed) per layer under a grouping."""
        G = int(group_of.max()) + 1 if len(group_of) else 0
        size = np.bincount(group_of, minlength=G)
        rho = np.zeros(G)
        np.maximum.at(rho, group_of, shares)
        low = np.full(G, np.iinfo(np.int64).max)
        high = np.full(G, -1)
        np.minimum.at(low, group_of, nodes)
        np.maximum.at(high, group_of, nodes)
        ag, rs, exposed = self._per_group(size, low != high, rho, G, far_fraction(group_of, nodes))
        return ag[group_of], rs[group_of], exposed[group_of]


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


def link_prices(cluster: Cluster) -> LinkPrices:
    """The cluster's link classes and the world group's collective figures (see :class:`LinkPrices`)."""
    cluster = calibrated(cluster)
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
    cluster = calibrated(cluster)
    prices = link_prices(cluster)
    ag, rs = prices.allgather_ms, prices.reduce_scatter_ms
    if prices.world_crosses and cluster.world_size > 1:
        ag, rs = ag + prices.latency_ms, rs + prices.latency_ms
    overlap = cluster.settings.overlap
    return Communication(ag, rs, cluster.world_size, prices.uneven_slope, 1.0 if overlap is None else overlap)


def single_group(shard_groups: Sequence[int] | np.ndarray | None) -> bool:
    """Whether a per-rank group index names one group of every rank (None: yes)."""
    if shard_groups is None:
        return True
    g = np.asarray(shard_groups)
    return not len(g) or bool((g == g[0]).all())


def slowdown_of(device: DeviceProfile) -> float:
    """A device's emulated slowdown (1: not emulated): the share 1 / slowdown of its compute is real."""
    return 1.0 if device.emulate is None else float(device.emulate.slowdown)


def shared_host_floor_ms(cluster: Cluster, busy_ms: np.ndarray) -> float:
    """The shared-host bound on the step (ms; 0 without ``settings.host_cores``): the ranks' real compute
    (``busy_ms`` per rank, contention-free, divided by each rank's emulated slowdown) over the host's
    cores, plus the fixed per-step overhead."""
    cores = cluster.settings.host_cores
    if not cores:
        return 0.0
    real = np.asarray(busy_ms, dtype=float) / np.array([slowdown_of(d) for d in cluster.devices])
    return float(real.sum()) / cores + cluster.settings.step_overhead_ms


def step_ms(settings: Settings, work_ms: np.ndarray | float) -> np.ndarray | float:
    """A step's time from its work (``work_ms``: the layers' passes and the optimizer step): stretched
    by the host's contention, plus the fixed per-step overhead (the module's ``step_i``)."""
    return settings.host_contention * work_ms + settings.step_overhead_ms


def synced_group_ms(cluster: Cluster, fwd: np.ndarray, bwd: np.ndarray, optimizer: np.ndarray,
                    shard_groups: Sequence[int] | np.ndarray | None) -> np.ndarray:
    """Every rank's step (ms) if each layer's pass ended together on its shard group: the group's
    slowest forward plus its slowest backward per layer (``fwd``, ``bwd``: per-layer pass times with
    their collectives) and its slowest optimizer step (``settings.sync_passes``; see the module)."""
    s = cluster.settings
    groups = np.zeros(len(fwd), np.int64) if shard_groups is None else np.asarray(shard_groups, dtype=np.int64)
    out = np.empty(len(fwd))
    for g in np.unique(groups):
        at = groups == g
        out[at] = step_ms(s, cluster.model.num_layers * (fwd[at].max() + bwd[at].max()) + optimizer[at].max())
    return out


def predicted_busy_s(cluster: Cluster, plan: Plan) -> list[float]:
    """Each rank's predicted compute seconds per step: its layers' forward and backward passes (with
    any recompute) and its optimizer step, which is what the runtime counts as busy (everything
    but collectives and waiting)."""
    cluster = calibrated(cluster)
    out = []
    for device, rank in zip(cluster.devices, plan.ranks):
        cost = DeviceCost(device, cluster, plan.mode)
        fwd, bwd = cost.compute_ms(rank.batch_size, rank.num_micro_batches, rank.recompute)
        out.append((cost.num_layers * (fwd + bwd) + float(cost.optimizer_ms(rank.state_share))) / 1e3)
    return out


class DeviceCost:
    """One device's cost functions under a cluster's settings, in one mode (layered | uniform)."""

    def __init__(self, device: DeviceProfile, cluster: Cluster, mode: str = "layered") -> None:
        if mode not in MODES:
            raise PlanningError(f"mode must be one of {MODES}, got {mode!r}; choose one of those")
        self.device = device
        self.mode = mode
        self.fwd = PiecewiseLinear(device.layer_fwd_ms)
        self.bwd = PiecewiseLinear(device.layer_bwd_ms)
        self.compute_memory = PiecewiseLinear(device.compute_memory_gb, at_zero="intercept")
        self.activation_memory = (None if device.activation_memory_gb is None
                                  else PiecewiseLinear(device.activation_memory_gb))
        s, model = cluster.settings, cluster.model
        self.overhead_ms = s.micro_batch_overhead_ms
        self.settings = s
        self.overlap = 1.0 if s.overlap is None else s.overlap
        self.num_layers = model.num_layers
        self.budget_gb = s.usable_memory_fraction * device.memory_gb - s.reserved_memory_gb
        self.state_gb = model.state_bytes / GIB
        self.grad_gb = model.compute_bytes_per_param * model.trainable / GIB  # uniform accumulation
        ns = device.optimizer_ns_per_param
        if ns is None:
            ns = s.optimizer_ns_per_param or 0.0
        self.optimizer_ms_per_share = ns * model.trainable / 1e6  # the whole state's step (trainable only), ms
        stash = model.stash_bytes
        gbps = device.host_copy_gbps or s.host_copy_gbps
        copies = s.offload_stash and mode == "layered" and stash is not None
        self.copy_ms_per_sample = stash / (gbps * 1e9) * 1e3 if copies else 0.0  # one direction, one layer
        # a recomputing layered rank keeps every sample's stash on the device between the passes
        self.kept_gb_per_sample = model.kept_bytes / GIB if s.stash_on_device and mode == "layered" else 0.0
        self.slowdown = slowdown_of(device)
        # keeping the graph is priced only where its memory was measured
        self.can_keep = mode == "layered" and self.activation_memory is not None

    # ------------------------------------------------------------------ time

    def sums(self, b: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer sums over n near-equal micro-batches of F and of B (b >= n >= 1)."""
        q, rem = np.divmod(b, n)
        f, bw = self.fwd, self.bwd
        f_sum = (n - rem) * f(q) + rem * f(q + 1)
        b_sum = (n - rem) * bw(q) + rem * bw(q + 1)
        return f_sum, b_sum

    def compute_parts(self, b: np.ndarray, n: np.ndarray, keep: np.ndarray | bool = False
                      ) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer compute (forward pass, backward pass incl. overheads) of b samples in n micro-batches."""
        b = np.asarray(b, dtype=np.int64)
        n = np.maximum(np.asarray(n, dtype=np.int64), 1)
        f_sum, b_sum = self.sums(np.maximum(b, n), n)
        over = (n - 1) * self.overhead_ms
        if self.mode == "uniform":
            fwd, bwd = f_sum, b_sum + over
        else:
            copy = self.copy_ms_per_sample * b
            fwd, bwd = f_sum + copy, f_sum + b_sum + copy + over
            kept = np.asarray(keep, dtype=bool) & (n == 1)
            if kept.any():
                fwd = np.where(kept, f_sum, fwd)
                bwd = np.where(kept, b_sum, bwd)
        empty = b == 0
        return np.where(empty, 0.0, fwd), np.where(empty, 0.0, bwd)

    def gathers(self, n: np.ndarray | int) -> np.ndarray:
        """Each layer's gathers per pass, in units of its first: uniform mode gathers once per
        micro-batch, each repeat at ``settings.repeated_gather_fraction``; layered mode once."""
        n = np.asarray(n, dtype=float)
        if self.mode != "uniform":
            return np.ones_like(n)
        return 1.0 + (np.maximum(n, 1.0) - 1.0) * self.settings.repeated_gather_fraction

    def collectives(self, n: np.ndarray, ag: float, rs: float) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer communication of the forward and the backward pass."""
        gathers = self.gathers(n)
        return gathers * ag, gathers * ag + rs

    def layer_ms(self, b: np.ndarray, n: np.ndarray, ag: float, rs: float,
                 keep: np.ndarray | bool = False) -> np.ndarray:
        """Per-layer time of b samples in n micro-batches (b = 0: the collectives alone)."""
        fwd, bwd = self.pass_ms(b, n, ag, rs, keep)
        return fwd + bwd

    def pass_ms(self, b: np.ndarray, n: np.ndarray, ag: float, rs: float,
                keep: np.ndarray | bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer time of the forward and of the backward pass, each with its collectives."""
        fwd, bwd, a1, a2 = self._passes(b, n, ag, rs, keep)
        return combine(a1, fwd, self.overlap), combine(a2, bwd, self.overlap)

    def _passes(self, b: np.ndarray, n: np.ndarray, ag: float, rs: float, keep: np.ndarray | bool
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per-layer (forward compute, backward compute, forward communication, backward communication)."""
        n = np.maximum(np.asarray(n, dtype=np.int64), 1)
        return (*self.compute_parts(b, n, keep), *self.collectives(n, ag, rs))

    def blocked_ms(self, b: np.ndarray, n: np.ndarray, ag: float, rs: float,
                   keep: np.ndarray | bool = False) -> np.ndarray:
        """Per-layer time spent in collectives beyond the compute they overlap (what a host
        blocked in them measures)."""
        fwd, bwd, a1, a2 = self._passes(b, n, ag, rs, keep)
        return combine(a1, fwd, self.overlap) - fwd + combine(a2, bwd, self.overlap) - bwd

    def optimizer_ms(self, share: np.ndarray | float) -> np.ndarray:
        return self.optimizer_ms_per_share * np.asarray(share, dtype=float)

    def compute_ms(self, batch_size: int, num_micro_batches: int, recompute: bool = True) -> tuple[float, float]:
        """Per-layer compute for one step: (forward pass, backward pass incl. any recompute and overheads)."""
        fwd, bwd = self.compute_parts(np.array([batch_size]), np.array([num_micro_batches]), not recompute)
        return float(fwd[0]), float(bwd[0])

    def step_s(self, batch_size: int, num_micro_batches: int, ag_ms: float, rs_ms: float,
               share: float = 0.0, recompute: bool = True) -> float:
        layer = float(self.layer_ms(np.array([batch_size]), np.array([num_micro_batches]), ag_ms, rs_ms,
                                    not recompute)[0])
        return step_ms(self.settings, self.num_layers * layer + float(self.optimizer_ms(share))) / 1e3

    # ------------------------------------------------------------------ memory

    def extra_memory_gb(self, m: np.ndarray, n: np.ndarray | int = 1, keep: np.ndarray | bool = False,
                        b: np.ndarray | int | None = None) -> np.ndarray:
        """Memory beyond compute_memory(m): the kept graph, uniform mode's accumulating gradients and,
        given the batch b, the stash a recomputing layered rank keeps on the device."""
        m = np.asarray(m, dtype=np.int64)
        extra = np.zeros(m.shape)
        if b is not None and self.kept_gb_per_sample:
            extra = extra + self.stash_gb(b, keep)
        graph = self.activation_memory is not None and (self.mode == "uniform" or np.any(keep))
        if graph:
            act = self.activation_memory(m)
            extra = extra + (act if self.mode == "uniform" else np.where(keep, act, 0.0))
        if self.mode == "uniform":
            extra = extra + np.where(np.asarray(n) > 1, self.grad_gb, 0.0)
        return extra

    def stash_gb(self, b: np.ndarray | int, keep: np.ndarray | bool = False) -> np.ndarray:
        """The stash b samples keep on the device between the passes (0 when kept graphs replace it)."""
        return np.where(np.asarray(keep, dtype=bool), 0.0, np.asarray(b, dtype=float) * self.kept_gb_per_sample)

    def memory_gb(self, micro_batch_size: int, share: float, reserved_gb: float, num_micro_batches: int = 1,
                  recompute: bool = True, batch_size: int | None = None) -> float:
        m = np.array([micro_batch_size])
        extra = float(self.extra_memory_gb(m, num_micro_batches, not recompute, batch_size)[0])
        return float(self.compute_memory(micro_batch_size)) + extra + reserved_gb + self.state_gb * share

    def room(self, m: np.ndarray, n: np.ndarray | int = 1, keep: np.ndarray | bool = False,
             b: np.ndarray | int | None = None) -> np.ndarray:
        """Largest state share that fits beside compute at micro-batch size m (may be < 0); with the
        batch b, beside its stash too (without: the room before the stash, an upper bound)."""
        m = np.asarray(m, dtype=np.int64)
        used = self.compute_memory(m) + self.extra_memory_gb(m, n, keep, b)
        return (self.budget_gb - used) / self.state_gb

    def max_share(self, micro_batch_size: int, num_micro_batches: int = 1, recompute: bool = True,
                  batch_size: int | None = None) -> float:
        """Largest state share that fits beside compute at this micro-batch size (may be < 0)."""
        return float(self.room(np.array([micro_batch_size]), num_micro_batches, not recompute, batch_size)[0])


@dataclass(frozen=True)
class RankCost:
    step_s: float
    memory_gb: float
    fits: bool


_KIND_FIELDS = tuple(f.name for f in fields(DeviceProfile) if f.name != "node")


def _without_node(device: DeviceProfile) -> tuple:
    """What makes a device kind: everything but its node (cheaper than a replaced profile)."""
    return tuple(getattr(device, name) for name in _KIND_FIELDS)


def kind_costs(cluster: Cluster, mode: str = "layered") -> tuple[list[DeviceCost], np.ndarray]:
    """One DeviceCost per distinct device profile, and each rank's index into them."""
    cluster = calibrated(cluster)
    index: dict[DeviceProfile, int] = {}
    costs: list[DeviceCost] = []
    of_rank = np.empty(cluster.world_size, dtype=np.int64)
    known: dict[int, int] = {}  # id(device) -> kind: ranks of one entry share one profile object
    for rank, device in enumerate(cluster.devices):
        k = known.get(id(device))
        if k is None:
            key = device if device.node is None else _without_node(device)  # one kind across nodes
            k = index.get(key)
            if k is None:
                k = index[key] = len(costs)
                costs.append(DeviceCost(device, cluster, mode))
            known[id(device)] = k
        of_rank[rank] = k
    return costs, of_rank


def collective_ms(cluster: Cluster, shares: Sequence[float] | np.ndarray,
                  shard_groups: Sequence[int] | np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every rank's per-layer (all-gather, reduce-scatter plus the cross-group reduction, exposed) in
    ms, under ``shard_groups`` (None: one group of all; ``shares`` within each group). The exposed part
    (groups of one rank: the last gradient bucket's all-reduce, which starts when the backward ends)
    adds to the layer's time after :meth:`DeviceCost.layer_ms` instead of overlapping its compute. A
    cluster that still carries its calibration is folded for these groups."""
    cluster = calibrated(cluster, np.zeros(len(shares), np.int64) if shard_groups is None else shard_groups)
    r = np.asarray(shares, dtype=float)
    if single_group(shard_groups):
        comm = communication(cluster)
        rho = float(r.max()) if len(r) else 0.0
        return np.full(len(r), comm.allgather(rho)), np.full(len(r), comm.reduce_scatter(rho)), np.zeros(len(r))
    groups = np.unique(np.asarray(shard_groups, dtype=np.int64), return_inverse=True)[1]
    return link_prices(cluster).ranks(groups, np.asarray(cluster.nodes, dtype=np.int64), r)


def evaluate_arrays(
    cluster: Cluster,
    batch_sizes: Sequence[int] | np.ndarray,
    num_micro_batches: Sequence[int] | np.ndarray,
    shares: Sequence[float] | np.ndarray,
    recompute: Sequence[bool] | np.ndarray | None = None,
    mode: str = "layered",
    kinds: tuple[list[DeviceCost], np.ndarray] | None = None,
    shard_groups: Sequence[int] | np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every rank's predicted step time (s), memory (GiB) and whether it fits, vectorised by kind.

    ``shard_groups``: every rank's shard group (None: one group of all); ``shares`` are then within
    each group, and each group's collectives are priced by :class:`LinkPrices`.
    """
    cluster = calibrated(cluster, np.zeros(len(batch_sizes), np.int64) if shard_groups is None else shard_groups)
    b = np.asarray(batch_sizes, dtype=np.int64)
    n = np.maximum(np.asarray(num_micro_batches, dtype=np.int64), 1)
    r = np.asarray(shares, dtype=float)
    keep = np.zeros(len(b), bool) if recompute is None else ~np.asarray(recompute, dtype=bool)
    ag, rs, exposed = collective_ms(cluster, r, shard_groups)
    costs, of_rank = kinds if kinds is not None else kind_costs(cluster, mode)
    step = np.empty(len(b))
    memory = np.empty(len(b))
    limit = np.empty(len(b))
    m = np.where(b > 0, -(-b // n), 0)
    reserved = cluster.settings.reserved_memory_gb
    busy = np.zeros(len(b))  # contention-free compute ms, for the shared-host bound
    passes = np.empty((2, len(b)))  # per-layer forward and backward with collectives, for settings.sync_passes
    optimizer = np.empty(len(b))
    for k, cost in enumerate(costs):
        at = np.nonzero(of_rank == k)[0]
        if not len(at):
            continue
        passes[:, at] = cost.pass_ms(b[at], n[at], ag[at], rs[at], keep[at])
        passes[1, at] += exposed[at]
        optimizer[at] = cost.optimizer_ms(r[at])
        step[at] = step_ms(cluster.settings, cost.num_layers * (passes[0, at] + passes[1, at]) + optimizer[at]) / 1e3
        if cluster.settings.host_cores:
            fwd, bwd = cost.compute_parts(b[at], n[at], keep[at])
            busy[at] = cost.num_layers * (fwd + bwd) + optimizer[at]
        used = cost.compute_memory(m[at]) + cost.extra_memory_gb(m[at], n[at], keep[at], b[at])
        memory[at] = used + reserved + cost.state_gb * r[at]
        limit[at] = cluster.settings.usable_memory_fraction * cost.device.memory_gb
    if cluster.settings.sync_passes:
        step = np.maximum(step, synced_group_ms(cluster, passes[0], passes[1], optimizer, shard_groups) / 1e3)
    if cluster.settings.host_cores:
        step = np.maximum(step, shared_host_floor_ms(cluster, busy) / 1e3)
    return step, memory, memory <= limit * (1 + 1e-9)


def evaluate(
    cluster: Cluster,
    batch_sizes: Sequence[int],
    num_micro_batches: Sequence[int],
    shares: Sequence[float],
    recompute: Sequence[bool] | None = None,
    mode: str = "layered",
    shard_groups: Sequence[int] | None = None,
) -> list[RankCost]:
    """The cost model applied to one assignment: every rank's predicted step time and memory
    (``shard_groups``: each rank's group, shares within it; None: one group)."""
    step, memory, fits = evaluate_arrays(cluster, batch_sizes, num_micro_batches, shares, recompute, mode,
                                         shard_groups=shard_groups)
    return [RankCost(float(s), float(m), bool(f)) for s, m, f in zip(step, memory, fits)]


def water_fill(caps: Sequence[float], counts: Sequence[int] | None = None) -> list[float] | None:
    """Shares r_i <= caps_i summing to 1 with the smallest possible maximum, or None.

    r_i = min(cap_i, level) for the level at which they sum to 1: every rank keeps the same share
    until its memory is full, which also keeps collectives as even as the memory allows. With
    ``counts``, entry i stands for counts[i] ranks that each take r_i.
    """
    caps_arr = np.maximum(np.asarray(caps, dtype=float), 0.0)
    weight = np.ones(len(caps_arr)) if counts is None else np.asarray(counts, dtype=float)
    if (caps_arr * weight).sum() < 1.0 - 1e-12:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(200):
        level = (lo + hi) / 2
        if (np.minimum(caps_arr, level) * weight).sum() >= 1.0:
            hi = level
        else:
            lo = level
    shares = np.minimum(caps_arr, hi)
    shares /= (shares * weight).sum()
    return [float(s) for s in shares]
