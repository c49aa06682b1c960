"""An independent brute-force planner for small clusters, to check the real one against.

It enumerates every local batch split (b_i), every micro-batch count n_i and, for one-micro-batch
ranks whose graph memory is known, both recompute choices. Shares: without an optimizer cost the
step time grows only with the largest share, so exact water-filling under the memory caps is
optimal; with one, every largest share rho on a fine grid (refined around the best) gets the
smallest step that shares <= min(memory cap, rho, the time left for the optimizer) can reach. The
cost formulas are written out again here from the design brief and the README, not taken from the
planner.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from cephalo_lightning.planner.cost.collective_prices import UNEVEN_SLOPE  # a constant of the model, not the solver
from cephalo_lightning.planner.schema.cluster_spec import Cluster

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
        rs = rs or moved * cluster.model.grad_bytes_per_param / (s.link_bandwidth_gbps * 1e9) * 1e3
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
    keep: tuple[bool, ...] = ()
    groups: tuple[int, ...] = ()  # every rank's shard group (brute_force_groups)


def _overlapped(comm: float, compute: float, overlap: float) -> float:
    return max(comm, compute) + (1 - overlap) * min(comm, compute)


def _optimizer_ms(cluster: Cluster, device) -> float:
    """Milliseconds of the optimizer step over the whole state on this device."""
    ns = device.optimizer_ns_per_param
    if ns is None:
        ns = cluster.settings.optimizer_ns_per_param or 0.0
    return ns * cluster.model.parameters / 1e6


def layer_times(cluster: Cluster, batch, micro, rho: float, keep=None, mode: str = "layered",
                collectives: list[tuple[float, float]] | None = None, per_pass: bool = False) -> list:
    """Each rank's step time (ms) without the optimizer, collectives priced at largest share rho (or
    every rank's own (all-gather, reduce-scatter) per layer: ``collectives``); ``per_pass``: each
    rank's (forward passes, backward passes and what follows them) instead of their sum."""
    ag0, rs0 = collective_ms(cluster)
    s = cluster.settings
    w = cluster.world_size
    slope = s.uneven_slope if s.uneven_slope is not None else UNEVEN_SLOPE[s.collective]
    factor = 1.0 + slope * max(0.0, w * rho - 1.0)
    ag, rs = ag0 * factor, rs0 * factor
    overlap = 0.0 if s.overlap is None else s.overlap  # unmeasured: serial, as docs/cluster.md documents
    c = s.micro_batch_overhead_ms
    stash = cluster.model.stash_bytes_per_sample
    if stash is None and cluster.model.hidden_size and cluster.model.seq_len:
        stash = cluster.model.hidden_size * cluster.model.seq_len * cluster.model.compute_bytes_per_param
    keep = keep or [False] * len(batch)
    out = []
    for rank, (d, b, n, kept) in enumerate(zip(cluster.devices, batch, micro, keep)):
        exposed = 0.0  # after the backward pass, not overlapped (data parallelism's last bucket)
        if collectives is not None:
            ag, rs, *rest = collectives[rank]
            exposed = rest[0] if rest else 0.0
        sizes = near_equal(b, n)
        f = sum(profile_value(d.layer_fwd_ms, x) for x in sizes)
        back = sum(profile_value(d.layer_bwd_ms, x) for x in sizes)
        over = max(0, len(sizes) - 1) * c
        if mode == "uniform":  # the first gather of a layer's pass, then n - 1 repeats at their fraction
            gathered = ag + (n - 1) * s.repeated_gather_fraction * ag
            fwd, bwd = _overlapped(gathered, f, overlap), _overlapped(gathered + rs, back + over, overlap)
        elif kept:
            fwd, bwd = _overlapped(ag, f, overlap), _overlapped(ag + rs, back, overlap)
        else:
            copy = 0.0
            if s.offload_stash and stash is not None:
                copy = b * stash / ((d.host_copy_gbps or s.host_copy_gbps) * 1e9) * 1e3
            fwd = _overlapped(ag, f + copy, overlap)
            bwd = _overlapped(ag + rs, f + back + copy + over, overlap)
        layers = cluster.model.num_layers
        out.append((layers * fwd, layers * (bwd + exposed)) if per_pass else layers * (fwd + bwd + exposed))
    return out


def compute_ms(cluster: Cluster, batch, micro, shares, keep=None, mode: str = "layered") -> list[float]:
    """Each rank's compute per step (ms, no collectives, no contention): num_layers x (forward pass +
    backward pass) + its optimizer step, as the README's formulas write them."""
    s = cluster.settings
    keep = keep or [False] * len(batch)
    stash = cluster.model.stash_bytes_per_sample
    if stash is None and cluster.model.hidden_size and cluster.model.seq_len:
        stash = cluster.model.hidden_size * cluster.model.seq_len * cluster.model.compute_bytes_per_param
    out = []
    for d, b, n, kept, r in zip(cluster.devices, batch, micro, keep, shares):
        sizes = near_equal(b, n)
        f = sum(profile_value(d.layer_fwd_ms, x) for x in sizes)
        back = sum(profile_value(d.layer_bwd_ms, x) for x in sizes)
        over = max(0, len(sizes) - 1) * s.micro_batch_overhead_ms
        if mode == "uniform":
            layer = f + back + over
        elif kept:
            layer = f + back
        else:
            copy = 0.0
            if s.offload_stash and stash is not None:
                copy = b * stash / ((d.host_copy_gbps or s.host_copy_gbps) * 1e9) * 1e3
            layer = 2 * f + back + 2 * copy + over
        out.append(cluster.model.num_layers * layer + _optimizer_ms(cluster, d) * r)
    return out


def shared_host_floor_s(cluster: Cluster, batch, micro, shares, keep=None, mode: str = "layered") -> float:
    """Ranks on one host of K cores: the step is at least their real compute (compute over each rank's
    emulated slowdown) over K, plus the fixed per-step overhead; 0 without a core count."""
    cores = cluster.settings.host_cores
    if not cores:
        return 0.0
    slow = [1.0 if d.emulate is None else d.emulate.slowdown for d in cluster.devices]
    real = sum(c / k for c, k in zip(compute_ms(cluster, batch, micro, shares, keep, mode), slow))
    return (real / cores + cluster.settings.step_overhead_ms) / 1e3


def rank_times(cluster: Cluster, batch, micro, shares, keep=None, mode: str = "layered") -> list[float]:
    """Each rank's step time (s) by the brief's formulas, the optimizer step, the fixed per-step
    overhead, the shared-host bound and (``settings.sync_passes``, one shard group of every rank)
    every pass ending together on every rank included."""
    layers = layer_times(cluster, batch, micro, max(shares), keep, mode)
    fixed, contention = cluster.settings.step_overhead_ms, cluster.settings.host_contention
    floor = shared_host_floor_s(cluster, batch, micro, shares, keep, mode)
    optimizer = [_optimizer_ms(cluster, d) * r for d, r in zip(cluster.devices, shares)]
    if cluster.settings.sync_passes:  # the slowest forward, then the slowest backward, then the slowest optimizer
        passes = layer_times(cluster, batch, micro, max(shares), keep, mode, per_pass=True)
        synced = max(f for f, _ in passes) + max(b for _, b in passes) + max(optimizer)
        floor = max(floor, (contention * synced + fixed) / 1e3)
    return [max(floor, (contention * (t + o) + fixed) / 1e3) for t, o in zip(layers, optimizer)]


def calibrated_by_hand(data: dict, calibration: dict, groups=None) -> Cluster:
    """A cluster file with a calibration block written out as a plain cluster file: each rank its own
    device entry, its times scaled, the measured terms as settings (the block's documented meaning:
    the collective terms only for plans of the block's ``shard_groups``, where it names them, and a
    uniform pass's gathers after a layer's first at the profiled gather, at most the fitted one)."""
    from cephalo_lightning.planner import cluster_from_dict

    entries = [dict(e, count=1) for e in data["devices"] for _ in range(e.get("count", 1))]
    settings = dict(data.get("settings", {}))
    for entry, scale in zip(entries, calibration["compute_scale"]):
        entry["layer_fwd_ms"] = [v * scale for v in entry["layer_fwd_ms"]]
        entry["layer_bwd_ms"] = [v * scale for v in entry["layer_bwd_ms"]]
        ns = entry.get("optimizer_ns_per_param", settings.get("optimizer_ns_per_param"))
        if ns is not None:
            entry["optimizer_ns_per_param"] = ns * scale
    settings.update({k: calibration[k] for k in ("step_overhead_ms", "micro_batch_overhead_ms")})
    fitted_groups = calibration.get("shard_groups")
    if fitted_groups is None or groups is None or list(groups) == list(fitted_groups):
        world = len(entries)
        profiled = settings.get("allgather_ms") or 0.0
        if not profiled and settings.get("link_bandwidth_gbps") and world > 1:  # one node: bytes over the link
            model = data["model"]
            moved = (world - 1) / world * model["parameters"] / model["num_layers"]
            profiled = moved * model.get("compute_bytes_per_param", 2) / (settings["link_bandwidth_gbps"] * 1e9) * 1e3
        fitted = calibration["allgather_ms"]
        settings["repeated_gather_fraction"] = min(1.0, profiled / fitted) if fitted > 0 else 1.0
        settings.pop("link_bandwidth_gbps", None)
        settings.update({k: calibration[k] for k in ("allgather_ms", "reduce_scatter_ms", "overlap")})
        settings.pop("free_links", None)  # the calibration prices the collectives
    settings["host_contention"] = calibration.get("host_contention", 1.0)
    return cluster_from_dict({"model": data["model"], "settings": settings, "devices": entries})


def share_gb(cluster: Cluster) -> float:
    """GiB one whole state share costs: every parameter's full state (the reference trains them all)
    and the reduce-scatter's two shards of the largest unit in the gradient dtype."""
    m = cluster.model
    assert m.frozen == 0, "the reference prices fully trainable models"
    unit = m.largest_unit_parameters if m.largest_unit_parameters is not None else m.parameters / m.num_layers
    return (m.state_bytes_per_param * m.parameters + 2 * unit * m.grad_bytes_per_param) / GIB


def memory_used(cluster: Cluster, d, b: int, n: int, share: float, kept: bool = False, mode: str = "layered") -> float:
    s = cluster.settings
    state = share_gb(cluster)
    m = -(-b // n) if b else 0
    used = profile_value(d.compute_memory_gb, m, memory=True)
    graph = d.activation_memory_gb is not None and (kept or mode == "uniform")
    if graph:
        used += profile_value(d.activation_memory_gb, m)
    if mode == "uniform" and n > 1:
        used += cluster.model.compute_bytes_per_param * cluster.model.parameters / GIB  # full grads accumulate
    if mode == "layered" and not kept and s.stash_on_device:  # every sample's stash, held between the passes
        per_sample = cluster.model.kept_bytes_per_sample
        if per_sample is None:  # estimated: every layer's input, seq_len x hidden_size in the compute dtype
            m_ = cluster.model
            per_sample = (m_.num_layers * m_.hidden_size * m_.seq_len * m_.compute_bytes_per_param
                          if m_.hidden_size and m_.seq_len else 0.0)
        used += b * per_sample / GIB
    return used + s.reserved_memory_gb + state * share


def memory_ok(cluster: Cluster, batch, micro, shares, keep=None, mode: str = "layered", slack: float = 1e-9) -> list[bool]:
    keep = keep or [False] * len(batch)
    return [memory_used(cluster, d, b, n, r, k, mode) <= cluster.settings.usable_memory_fraction * d.memory_gb * (1 + slack)
            for d, b, n, r, k in zip(cluster.devices, batch, micro, shares, keep)]


def _compositions(total: int, parts: int, minimum: int):
    if parts == 1:
        if total >= minimum:
            yield (total,)
        return
    for first in range(minimum, total - minimum * (parts - 1) + 1):
        for rest in _compositions(total - first, parts - 1, minimum):
            yield (first, *rest)


def _shares_with_optimizer(cluster: Cluster, batch, micro, keep, caps, mode) -> tuple[float, list[float]] | None:
    """The smallest step (s) over shares, for an optimizer cost (see module docstring)."""
    w = cluster.world_size
    kappa = [_optimizer_ms(cluster, d) for d in cluster.devices]
    if sum(caps) < 1 - 1e-12:
        return None

    def at(rho: float) -> tuple[float, list[float]] | None:
        base = layer_times(cluster, batch, micro, rho, keep, mode)
        lim = [min(c, rho) for c in caps]
        if sum(lim) < 1 - 1e-12:
            return None

        def shares(t: float) -> list[float]:
            return [min(li, max(0.0, (t - bi) / k)) if k > 0 else li for li, bi, k in zip(lim, base, kappa)]

        # the least t whose shares sum to 1: their sum is linear in t between the points where a
        # rank's share starts (t = b_i) or reaches its limit (t = b_i + l_i k_i); find the piece, solve it
        points = sorted({max(base), *(b + li * k for li, b, k in zip(lim, base, kappa) if k > 0)})
        points = [t for t in points if t >= max(base)]
        below = max(base)
        for t in points:
            if sum(shares(t)) >= 1 - 1e-12:
                low, high = sum(shares(below)), sum(shares(t))
                hi = t if high == low else below + (t - below) * (1 - low) / (high - low)
                break
            below = t
        r = shares(hi)
        total = sum(r)
        r = [x / total for x in r]
        return max(rank_times(cluster, batch, micro, r, keep, mode)), r

    ag, rs = collective_ms(cluster)
    slope = cluster.settings.uneven_slope
    slope = UNEVEN_SLOPE[cluster.settings.collective] if slope is None else slope
    if ag + rs == 0 or slope == 0 or w == 1:  # collectives do not grow with rho: no share limit but memory
        return at(1.0)
    grid = [1 / w + (1 - 1 / w) * i / 80 for i in range(81)]
    results = [(at(rho), rho) for rho in grid]
    found = [(res, rho) for res, rho in results if res is not None]
    if not found:
        return None
    (best, rho0) = min(found, key=lambda x: x[0][0])
    step = (1 - 1 / w) / 80
    for rho in [rho0 + step * (j / 20 - 1) for j in range(41)]:
        if 1 / w <= rho <= 1:
            res = at(rho)
            if res is not None and res[0] < best[0]:
                best = res
    return best


def brute_force(cluster: Cluster, global_batch: int, mode: str = "layered") -> Best | None:
    """The optimal assignment by enumeration, or None when nothing fits."""
    s = cluster.settings
    w = cluster.world_size
    best: Best | None = None
    with_optimizer = any(_optimizer_ms(cluster, d) > 0 for d in cluster.devices)

    def cap(d, b: int, n: int, kept: bool) -> float:
        state = share_gb(cluster)
        room = s.usable_memory_fraction * d.memory_gb - memory_used(cluster, d, b, n, 0.0, kept, mode)
        return room / state

    splits = _compositions(global_batch, w, 0 if mode == "layered" else 1)
    for batch in splits:
        if mode == "layered":
            counts = itertools.product(*[range(1, b + 1) if b else (1,) for b in batch])
        else:
            counts = ((n,) * w for n in range(1, min(batch) + 1))
        for micro in counts:
            choices = [(False, True) if mode == "layered" and n == 1 and b > 0 and d.activation_memory_gb is not None
                       else (False,) for d, b, n in zip(cluster.devices, batch, micro)]
            for keep in itertools.product(*choices):
                caps = [cap(d, b, n, k) for d, b, n, k in zip(cluster.devices, batch, micro, keep)]
                if any(c < 0 for c in caps):
                    continue
                # no assignment of shares beats the cheapest collectives and a free optimizer step
                if best is not None and max(layer_times(cluster, batch, micro, 1 / w, list(keep), mode)) / 1e3 \
                        >= best.step_s:
                    continue
                if with_optimizer:
                    found = _shares_with_optimizer(cluster, batch, micro, list(keep), caps, mode)
                    if found is None:
                        continue
                    step, shares = found
                else:
                    shares = water_fill_exact(caps)
                    if shares is None:
                        continue
                    step = max(rank_times(cluster, batch, micro, shares, list(keep), mode))
                if best is None or step < best.step_s:
                    best = Best(step, batch, tuple(micro), tuple(shares), tuple(keep))
    return best


# ----------------------------------------------------------------------------- shard groups


def candidate_groupings(cluster: Cluster) -> list[tuple[int, ...]]:
    """The groupings the README says the planner weighs, as every rank's group label: one group, one per
    node, the halves and the pairs of every node of an even four or more ranks, one per rank."""
    nodes = [0 if d.node is None else d.node for d in cluster.devices]
    members: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        members.setdefault(node, []).append(rank)
    halves, pairs = list(nodes), list(nodes)
    for node, ranks in members.items():
        if len(ranks) >= 4 and len(ranks) % 2 == 0:
            for position, rank in enumerate(ranks):
                halves[rank] = (node, position // (len(ranks) // 2))
                pairs[rank] = (node, position // 2)
    out: list[tuple[int, ...]] = []
    for labels in ([0] * len(nodes), nodes, halves, pairs, list(range(len(nodes)))):
        first: dict[Any, int] = {}
        numbered = tuple(first.setdefault(label, len(first)) for label in labels)
        if numbered not in out:
            out.append(numbered)
    return out


def group_collectives(cluster: Cluster, groups, shares) -> list[tuple[float, float]]:
    """Every rank's (all-gather, reduce-scatter + cross-group reduction) of one layer (ms), as the README's
    "Topology and shard groups" describes: bytes over the link bandwidths or, with measured per-layer
    times (one node), those times scaled by the bytes a group of k moves against the world's."""
    s, model = cluster.settings, cluster.model
    nodes = [0 if d.node is None else d.node for d in cluster.devices]
    w = len(nodes)
    intra = s.link_bandwidth_gbps
    inter = s.inter_node_bandwidth_gbps or intra
    measured = bool(s.allgather_ms or s.reduce_scatter_ms)
    assert not measured or len(set(nodes)) == 1, "the reference scales measured times on one node only"
    slope = s.uneven_slope if s.uneven_slope is not None else UNEVEN_SLOPE[s.collective]
    layer = model.parameters / model.num_layers
    G = len(set(groups))
    spans = len(set(nodes)) > 1

    def seconds_ms(fraction: float, bytes_per_param: float, crosses: bool, measured_ms: float) -> float:
        if measured:  # a fraction of a layer against the world's (w - 1) / w
            return measured_ms * fraction / ((w - 1) / w)
        if not intra:
            return 0.0
        latency = s.inter_node_latency_ms if crosses else 0.0
        return fraction * layer * bytes_per_param / ((inter if crosses else intra) * 1e9) * 1e3 + latency

    out = []
    for rank in range(len(groups)):
        members = [i for i, g in enumerate(groups) if g == groups[rank]]
        k = len(members)
        crosses = len({nodes[i] for i in members}) > 1
        rho = max(shares[i] for i in members)
        factor = 1 + slope * max(0.0, k * rho - 1)
        ag = rs = 0.0
        if k > 1:
            ag = seconds_ms((k - 1) / k, model.compute_bytes_per_param, crosses, s.allgather_ms) * factor
            rs = seconds_ms((k - 1) / k, model.grad_bytes_per_param, crosses, s.reduce_scatter_ms) * factor
        if G > 1:
            sent = 2 * (G - 1) / G * rho  # of a layer's gradient, per rank
            if spans and s.inter_node_bandwidth_gbps:  # the part sent to other nodes over the slow link, at once
                far = far_part(groups, nodes)
                across = sent * far * layer * model.grad_bytes_per_param / (inter * 1e9) * 1e3
                across += s.inter_node_latency_ms if far > 0 else 0.0
                within = sent * (1 - far) * layer * model.grad_bytes_per_param / (intra * 1e9) * 1e3 if intra else 0.0
                rs += max(across, within)
            else:
                rs += seconds_ms(sent, model.grad_bytes_per_param, spans, s.reduce_scatter_ms)
        exposed = 0.0
        if G == w and w > 1:  # groups of one rank: the last bucket's all-reduce follows the backward pass
            # beyond the one layer every schedule reduces after the backward (which the model leaves out)
            exposed = rs * (last_bucket_layers(model.num_layers, layer * model.grad_bytes_per_param) - 1) / model.num_layers
        out.append((ag, rs - exposed, exposed))
    return out


def last_bucket_layers(num_layers: int, layer_bytes: float) -> int:
    """The layers in the last of DDP's buckets (1 MiB, then 25 MiB; the last layer first)."""
    buckets, open_bytes, open_layers = 0, 0.0, 0
    for _ in range(num_layers):
        open_bytes += layer_bytes
        open_layers += 1
        if open_bytes >= (25 if buckets else 1) * 2**20:
            buckets, last, open_bytes, open_layers = buckets + 1, open_layers, 0.0, 0
    return open_layers if open_layers else last


def far_part(groups, nodes) -> float:
    """The most, over the ranks, of the mean over the other groups of the fraction of that group's
    ranks on another node than the rank's."""
    labels = sorted(set(groups))
    worst = 0.0
    for rank, g in enumerate(groups):
        fractions = []
        for other in labels:
            if other == g:
                continue
            members = [i for i, h in enumerate(groups) if h == other]
            fractions.append(sum(nodes[i] != nodes[rank] for i in members) / len(members))
        worst = max(worst, sum(fractions) / len(fractions))
    return worst


def group_rank_times(cluster: Cluster, batch, micro, shares, groups, mode: str = "layered") -> list[float]:
    """Each rank's step time (s) under shard groups (no optimizer cost, no kept graphs)."""
    layers = layer_times(cluster, batch, micro, 1.0, None, mode, group_collectives(cluster, groups, shares))
    fixed, contention = cluster.settings.step_overhead_ms, cluster.settings.host_contention
    floor = shared_host_floor_s(cluster, batch, micro, shares, None, mode)
    return [max(floor, (contention * t + fixed) / 1e3) for t in layers]


def brute_force_groups(cluster: Cluster, global_batch: int, mode: str = "layered",
                       groupings: list[tuple[int, ...]] | None = None) -> Best | None:
    """The optimal grouping and assignment by enumeration over the candidate groupings (no optimizer
    cost, no kept graphs). Each group's collectives grow only with its own largest share, so within
    every group the exact water-filling under the memory caps is optimal."""
    assert all(_optimizer_ms(cluster, d) == 0 and d.activation_memory_gb is None for d in cluster.devices)
    s = cluster.settings
    w = cluster.world_size
    state = share_gb(cluster)
    best: Best | None = None
    for groups in groupings or candidate_groupings(cluster):
        members = [[i for i in range(w) if groups[i] == g] for g in sorted(set(groups))]
        even = [0.0] * w
        for m in members:
            for i in m:
                even[i] = 1 / len(m)
        for batch in _compositions(global_batch, w, 0 if mode == "layered" else 1):
            if mode == "layered":
                counts = itertools.product(*[range(1, b + 1) if b else (1,) for b in batch])
            else:
                counts = ((n,) * w for n in range(1, min(batch) + 1))
            for micro in counts:
                caps = [(s.usable_memory_fraction * d.memory_gb - memory_used(cluster, d, b, n, 0.0, False, mode))
                        / state for d, b, n in zip(cluster.devices, batch, micro)]
                if any(c < 0 for c in caps):
                    continue
                if best is not None and max(group_rank_times(cluster, batch, micro, even, groups, mode)) >= best.step_s:
                    continue  # even the cheapest collectives do not beat the best
                shares = [0.0] * w
                for m in members:
                    filled = water_fill_exact([caps[i] for i in m])
                    if filled is None:
                        break
                    for i, r in zip(m, filled):
                        shares[i] = r
                else:
                    step = max(group_rank_times(cluster, batch, micro, shares, groups, mode))
                    if best is None or step < best.step_s:
                        best = Best(step, tuple(batch), tuple(micro), tuple(shares), groups=tuple(groups))
    return best
