"""An independent brute-force planner for small clusters, to check the real one against.

It enumerates every local batch split (b_i), every micro-batch count n_i and gives the shares by
exact water-filling (for fixed batches the step time grows with the largest share, so the smallest
largest share under the memory caps is optimal). The cost formulas are written out again here from
the design brief, not taken from the planner.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from cephalo_lightning.planner.cluster import Cluster
from cephalo_lightning.planner.cost import UNEVEN_SLOPE  # a constant of the model, not the solver

GIB = 2.0**30


def profile_value(measured: tuple[float, ...], m: int, memory: bool = False) -> float:
    """The profile at integer m: running max, exact at 1..k, linear beyond k; 0 (or the intercept) at 0."""
    points = []
    top = -math.inf
    for v in measured:
        top = max(top, v)
        points.append(top)
    k = len(points)
    if m <= 0:
        if not memory:
            return 0.0
        return max(0.0, min(points[0], 2 * points[0] - points[1])) if k >= 2 else points[0]
    if m <= k:
        return points[m - 1]
    slope = points[-1] - points[-2] if k >= 2 else points[0]
    return points[-1] + slope * (m - k)


def near_equal(b: int, n: int) -> list[int]:
    return [b // n + (1 if i < b % n else 0) for i in range(n)] if b else []


def collective_ms(cluster: Cluster) -> tuple[float, float]:
    s, w = cluster.settings, cluster.world_size
    if w == 1:
        return 0.0, 0.0
    ag, rs = s.allgather_ms, s.reduce_scatter_ms
    if s.link_bandwidth_gbps:
        moved = (w - 1) / w * cluster.model.parameters / cluster.model.num_layers
        ag = ag or moved * cluster.model.compute_bytes_per_param / (s.link_bandwidth_gbps * 1e9) * 1e3
        rs = rs or moved * 4.0 / (s.link_bandwidth_gbps * 1e9) * 1e3
    return ag, rs


def water_fill_exact(caps: list[float]) -> list[float] | None:
    if any(c < 0 for c in caps) or sum(caps) < 1 - 1e-12:
        return None
    order = sorted(range(len(caps)), key=lambda i: caps[i])
    shares = [0.0] * len(caps)
    remaining, left = 1.0, len(caps)
    for pos, i in enumerate(order):
        level = remaining / left
        if caps[i] >= level:
            for j in order[pos:]:
                shares[j] = level
            return shares
        shares[i] = caps[i]
        remaining -= caps[i]
        left -= 1
    return shares


@dataclass(frozen=True)
class Best:
    step_s: float
    batch: tuple[int, ...]
    micro: tuple[int, ...]
    shares: tuple[float, ...]


def rank_times(cluster: Cluster, batch, micro, shares) -> list[float]:
    """Each rank's step time (s) by the brief's formulas."""
    ag0, rs0 = collective_ms(cluster)
    w = cluster.world_size
    factor = 1.0 + UNEVEN_SLOPE[cluster.settings.collective] * max(0.0, w * max(shares) - 1.0)
    ag, rs = ag0 * factor, rs0 * factor
    c = cluster.settings.micro_batch_overhead_ms
    out = []
    for d, b, n in zip(cluster.devices, batch, micro):
        sizes = near_equal(b, n)
        f = sum(profile_value(d.layer_fwd_ms, s) for s in sizes)
        tot = f + sum(profile_value(d.layer_bwd_ms, s) for s in sizes) + max(0, len(sizes) - 1) * c
        out.append(cluster.model.num_layers * (max(ag, f) + max(ag + rs, tot)) / 1e3)
    return out


def memory_ok(cluster: Cluster, batch, micro, shares, slack: float = 1e-9) -> list[bool]:
    s = cluster.settings
    state = cluster.model.state_bytes_per_param * cluster.model.parameters / GIB
    out = []
    for d, b, n, r in zip(cluster.devices, batch, micro, shares):
        m = -(-b // n) if b else 0
        used = profile_value(d.compute_memory_gb, m, memory=True) + s.reserved_memory_gb + state * r
        out.append(used <= s.usable_memory_fraction * d.memory_gb * (1 + slack))
    return out


def _compositions(total: int, parts: int, minimum: int):
    if parts == 1:
        if total >= minimum:
            yield (total,)
        return
    for first in range(minimum, total - minimum * (parts - 1) + 1):
        for rest in _compositions(total - first, parts - 1, minimum):
            yield (first, *rest)


def brute_force(cluster: Cluster, global_batch: int, mode: str = "layered") -> Best | None:
    """The optimal assignment by enumeration, or None when nothing fits."""
    s = cluster.settings
    state = cluster.model.state_bytes_per_param * cluster.model.parameters / GIB
    w = cluster.world_size
    best: Best | None = None

    def cap(d, m: int) -> float:
        room = s.usable_memory_fraction * d.memory_gb - s.reserved_memory_gb
        return (room - profile_value(d.compute_memory_gb, m, memory=True)) / state

    if mode == "layered":
        splits = _compositions(global_batch, w, 0)
    else:
        splits = _compositions(global_batch, w, 1)
    for batch in splits:
        if mode == "layered":
            counts = itertools.product(*[range(1, b + 1) if b else (1,) for b in batch])
        else:
            counts = ((n,) * w for n in range(1, min(batch) + 1))
        for micro in counts:
            caps = [cap(d, -(-b // n) if b else 0) for d, b, n in zip(cluster.devices, batch, micro)]
            shares = water_fill_exact(caps)
            if shares is None:
                continue
            step = max(rank_times(cluster, batch, micro, shares))
            if best is None or step < best.step_s:
                best = Best(step, batch, tuple(micro), tuple(shares))
    return best
