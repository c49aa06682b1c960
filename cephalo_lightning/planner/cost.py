"""The cost model: predicted step time and memory of every rank for a given assignment.

Per transformer layer, with F(m), B(m) one layer's forward and backward time at micro-batch size
m, AG / RS the all-gather and reduce-scatter time of one layer and c the overhead of one extra
micro-batch (design brief, "Cost model")::

    fwd_i  = max(AG, sum_k F(s_k))
    bwd_i  = max(AG + RS, sum_k (F(s_k) + B(s_k)) + (n_i - 1) * c)   # forward recomputed
    step   = num_layers * max_i (fwd_i + bwd_i)

where s_1..s_n are rank i's near-equal micro-batch sizes. Memory of rank i::

    compute_memory_i(m_i) + reserved + state_bytes_per_param * parameters * r_i
        <= usable_memory_fraction * memory_i

Profiles are piecewise linear between measured sizes and extrapolated linearly beyond them.
Measured series are made non-decreasing (a running maximum): a larger micro-batch never costs
less time or memory, which keeps noisy profiles from producing absurd plans.

Memory is in GiB (2**30 bytes), as ``torch.cuda`` reports it; times in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cephalo_lightning.planner.cluster import Cluster, DeviceProfile

GIB = float(2**30)

# Extra time of an uneven collective per unit of imbalance: a collective whose largest shard is
# rho of the unit costs 1 + slope * (W * rho - 1) times the even one. The bottleneck rank moves
# W * rho times the even bytes in both implementations; these slopes are what
# ``benchmarks/bench_runtime.py`` measured for the two runtime implementations on gloo.
# Measured 2026-11-30 with `python benchmarks/bench_runtime.py` (twice, and `--parts collectives`
# twice): 4 MiB fp32 unit, W = 2, 3, 4 gloo ranks on one 2-core CPU host, rho from 1/W to 1,
# all-gather and reduce-scatter fitted together through the even point; mean of the 4 runs (padded
# 0.87 / 0.94 / 1.01 / 1.05, exact -0.02 / 0.02 / 0.04 / -0.01). CPU loopback figures: on one host,
# exact (all_to_all_single) moves the same total bytes at any imbalance, so its slope is ~0 there;
# across a real network the busiest rank's link is the bottleneck and both should approach 1.
UNEVEN_SLOPE = {"padded": 0.97, "exact": 0.01}


def split_sizes(batch_size: int, num_micro_batches: int) -> list[int]:
    """Near-equal micro-batch sizes, largest first; an empty batch has no micro-batches."""
    if batch_size == 0:
        return []
    if num_micro_batches < 1 or num_micro_batches > batch_size:
        raise ValueError(f"cannot split {batch_size} samples into {num_micro_batches} micro-batches")
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


@dataclass(frozen=True)
class Communication:
    """Per-layer collective times (ms) for even shares, and how unevenness scales them."""

    allgather_ms: float
    reduce_scatter_ms: float
    world_size: int
    uneven_slope: float

    def factor(self, max_share: float) -> float:
        return 1.0 + self.uneven_slope * max(0.0, self.world_size * max_share - 1.0)

    def allgather(self, max_share: float) -> float:
        return self.allgather_ms * self.factor(max_share)

    def reduce_scatter(self, max_share: float) -> float:
        return self.reduce_scatter_ms * self.factor(max_share)


def communication(cluster: Cluster) -> Communication:
    """Price the collectives: given per-layer times, or bytes over the link bandwidth."""
    s, model, world = cluster.settings, cluster.model, cluster.world_size
    ag, rs = s.allgather_ms, s.reduce_scatter_ms
    if s.link_bandwidth_gbps and world > 1:
        moved = (world - 1) / world * model.layer_parameters
        bandwidth = s.link_bandwidth_gbps * 1e9  # bytes/s
        ag = ag or moved * model.compute_bytes_per_param / bandwidth * 1e3
        rs = rs or moved * 4.0 / bandwidth * 1e3  # gradients are reduced in fp32
    if world == 1:
        ag = rs = 0.0
    return Communication(ag, rs, world, UNEVEN_SLOPE[s.collective])


class DeviceCost:
    """One device's cost functions under a cluster's settings."""

    def __init__(self, device: DeviceProfile, cluster: Cluster) -> None:
        self.device = device
        self.fwd = PiecewiseLinear(device.layer_fwd_ms)
        self.bwd = PiecewiseLinear(device.layer_bwd_ms)
        self.compute_memory = PiecewiseLinear(device.compute_memory_gb, at_zero="intercept")
        s = cluster.settings
        self.overhead_ms = s.micro_batch_overhead_ms
        self.num_layers = cluster.model.num_layers
        self.budget_gb = s.usable_memory_fraction * device.memory_gb - s.reserved_memory_gb
        self.state_gb = cluster.model.state_bytes / GIB

    def compute_ms(self, batch_size: int, num_micro_batches: int) -> tuple[float, float]:
        """Per-layer (sum of forwards, sum of forward+backward+overheads) for one step."""
        if batch_size == 0:
            return 0.0, 0.0
        if not 1 <= num_micro_batches <= batch_size:
            split_sizes(batch_size, num_micro_batches)  # raises the usual ValueError
        # near-equal split: `rem` micro-batches of q + 1 and the rest of q (O(1), not O(n))
        q, rem = divmod(batch_size, num_micro_batches)
        groups = [(c, s) for c, s in ((rem, q + 1), (num_micro_batches - rem, q)) if c]
        f = sum(c * float(self.fwd(s)) for c, s in groups)
        b = sum(c * float(self.bwd(s)) for c, s in groups)
        return f, f + b + (num_micro_batches - 1) * self.overhead_ms

    def step_s(self, batch_size: int, num_micro_batches: int, ag_ms: float, rs_ms: float) -> float:
        fwd, bwd = self.compute_ms(batch_size, num_micro_batches)
        return self.num_layers * (max(ag_ms, fwd) + max(ag_ms + rs_ms, bwd)) / 1e3

    def memory_gb(self, micro_batch_size: int, share: float, reserved_gb: float) -> float:
        return float(self.compute_memory(micro_batch_size)) + reserved_gb + self.state_gb * share

    def max_share(self, micro_batch_size: int) -> float:
        """Largest state share that fits beside compute at this micro-batch size (may be < 0)."""
        return (self.budget_gb - float(self.compute_memory(micro_batch_size))) / self.state_gb


@dataclass(frozen=True)
class RankCost:
    step_s: float
    memory_gb: float
    fits: bool


def evaluate(
    cluster: Cluster,
    batch_sizes: Sequence[int],
    num_micro_batches: Sequence[int],
    shares: Sequence[float],
) -> list[RankCost]:
    """The cost model applied to one assignment: every rank's predicted step time and memory."""
    comm = communication(cluster)
    rho = max(shares)
    ag, rs = comm.allgather(rho), comm.reduce_scatter(rho)
    reserved = cluster.settings.reserved_memory_gb
    out: list[RankCost] = []
    for device, b, n, r in zip(cluster.devices, batch_sizes, num_micro_batches, shares):
        cost = DeviceCost(device, cluster)
        m = split_sizes(b, n)[0] if b else 0
        memory = cost.memory_gb(m, r, reserved)
        limit = cluster.settings.usable_memory_fraction * device.memory_gb
        out.append(RankCost(cost.step_s(b, n, ag, rs), memory, memory <= limit * (1 + 1e-9)))
    return out


def water_fill(caps: Sequence[float]) -> list[float] | None:
    """Shares r_i <= caps_i summing to 1 with the smallest possible maximum, or None.

    r_i = min(cap_i, level) for the level at which they sum to 1: every rank keeps the same share
    until its memory is full, which also keeps collectives as even as the memory allows.
    """
    caps_arr = np.maximum(np.asarray(caps, dtype=float), 0.0)
    if caps_arr.sum() < 1.0 - 1e-12:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(200):
        level = (lo + hi) / 2
        if np.minimum(caps_arr, level).sum() >= 1.0:
            hi = level
        else:
            lo = level
    shares = np.minimum(caps_arr, hi)
    shares /= shares.sum()
    return [float(s) for s in shares]
