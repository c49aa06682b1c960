"""Time the all-gather and reduce-scatter of one representative unit over the process group.

The cost model charges every layer one all-gather in the forward pass and an all-gather plus a
reduce-scatter in the backward pass (``Settings.allgather_ms`` / ``reduce_scatter_ms``, per layer,
even shares). The figures come from the runtime's own :class:`~cephalo_lightning.runtime.collectives.Collectives`
on a unit of the mean layer size (so ``num_layers x`` the figure is the whole model's traffic):
parameters in the compute dtype for the all-gather, gradients in the reduce dtype (fp32) for the
reduce-scatter, as the runtime moves them. Every rank gets the same (slowest rank's) figures, so
every rank plans from the same cluster.

Two figures describe the cluster's own collectives beyond the even times: the uneven-shard slope
(:func:`uneven_slope`, from the same unit cut unevenly: a collective whose largest shard is rho of
the unit costs ``1 + slope * (W rho - 1)`` times the even one) and the overlap of communication
with compute (:func:`time_overlap`: 1 when an all-gather hides entirely behind compute running
beside it, 0 when the two take as long as one after the other, as on a CPU host whose cores the
ranks already fill).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning._common.vocabulary import Collective, values_of
from cephalo_lightning.profiling.region_timing import RegionTimer, default_statistic, summarize
from cephalo_lightning.runtime.collectives import Collectives, Links
from cephalo_lightning.runtime.distributed import all_reduce_, barrier, is_distributed
from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator
from cephalo_lightning.runtime.sharding.layout import UnitLayout, build_layout


@dataclass(frozen=True)
class CollectiveProfile:
    """Per-layer collective times (ms); ``by_mode`` at ``shares`` for each requested mode."""

    numel: int
    world_size: int
    allgather_ms: float  # even shares (what the cost model's settings hold)
    reduce_scatter_ms: float
    shares: tuple[float, ...] = ()
    by_mode: dict[Collective, tuple[float, float]] = field(default_factory=dict)  # mode -> (all-gather, reduce-scatter)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # pragma: no cover - CUDA only
        torch.cuda.synchronize(device)


def time_op(
    op: Callable[[], object], device: torch.device, group: dist.ProcessGroup | None, warmup: int, repeats: int
) -> float:
    """Milliseconds of ``op`` on this rank (min on CPU, median on CUDA), every repeat started together."""
    samples = []
    for i in range(warmup + repeats):
        _sync(device)
        barrier(group)
        start = time.perf_counter()
        op()
        _sync(device)
        if i >= warmup:
            samples.append((time.perf_counter() - start) * 1e3)
    return summarize(samples, default_statistic(device))


def _time_unit(
    comm: Collectives, unit: UnitLayout, device: torch.device, compute_dtype: torch.dtype, reduce_dtype: torch.dtype,
    warmup: int, repeats: int,
) -> tuple[float, float]:
    lo, hi = unit.shard_range(comm.rank)
    shard = torch.ones(hi - lo, dtype=compute_dtype, device=device)
    full = torch.empty(unit.numel, dtype=compute_dtype, device=device)
    grad = torch.ones(unit.numel, dtype=reduce_dtype, device=device)
    ag = time_op(lambda: comm.all_gather(shard, full, unit).wait(), device, comm.group, warmup, repeats)
    rs = time_op(lambda: comm.reduce_scatter(grad, unit), device, comm.group, warmup, repeats)
    return ag, rs


def time_collectives(
    numel: int,
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    compute_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    modes: Sequence[Collective] = (Collective.PADDED,),
    shares: Sequence[float] | None = None,
    links: Links | None = None,
    warmup: int = 1,
    repeats: int = 5,
) -> CollectiveProfile:
    """All-gather / reduce-scatter time of a ``numel``-element unit; every rank must call it.

    Each figure is this rank's fastest repeat on CPU (a shared host only adds delays) or its median
    on CUDA, then the slowest rank's figure.

    The even-share figures are what the planner's settings take. ``modes`` (``padded`` / ``exact``)
    are additionally timed on a layout cut by ``shares`` (default even, where both modes take the
    same direct path), e.g. the imbalance a plan would create. Single process: all zeros.
    """
    unknown = [m for m in modes if m not in values_of(Collective)]
    if unknown:
        raise ConfigurationError(f"unknown collective mode(s) {unknown}; choose from {values_of(Collective)}")
    modes = tuple(Collective(m) for m in modes)
    if numel < 1:
        raise ConfigurationError(f"numel must be >= 1, got {numel}")
    device = torch.device(device)
    if not is_distributed(group):
        return CollectiveProfile(numel, 1, 0.0, 0.0, (1.0,), {m: (0.0, 0.0) for m in modes})
    world = dist.get_world_size(group)
    if shares is not None and len(shares) != world:
        raise ConfigurationError(f"{len(shares)} shares for a world of {world} ranks: give one per rank")
    even = build_layout([numel], [1.0 / world] * world, ["profiled-unit"]).units[0]
    uneven = even if shares is None else build_layout([numel], list(shares), ["profiled-unit"]).units[0]
    mode = modes[0] if modes else Collective.PADDED
    ag, rs = _time_unit(Collectives(group, mode, links=links), even, device, compute_dtype, reduce_dtype, warmup, repeats)
    by_mode = {
        mode: _time_unit(Collectives(group, mode, links=links), uneven, device, compute_dtype, reduce_dtype, warmup, repeats)
        if shares is not None else (ag, rs)
        for mode in modes
    }
    # every rank must plan from the same figures: take the slowest rank's
    flat = [ag, rs] + [v for mode in modes for v in by_mode[mode]]
    agreed = torch.tensor(flat, dtype=torch.float64, device=device if dist.get_backend(group) == "nccl" else "cpu")
    values = all_reduce_(agreed, "max", group).tolist()
    by_mode = {mode: (values[2 + 2 * i], values[3 + 2 * i]) for i, mode in enumerate(modes)}
    used = tuple(float(s) for s in shares) if shares is not None else tuple([1.0 / world] * world)
    return CollectiveProfile(numel, world, values[0], values[1], used, by_mode)


def skewed_shares(world_size: int) -> list[float]:
    """Rank 0 holds rho = min(0.9, 2 / W) of the unit (twice an even share from W = 3), the rest evenly."""
    rho = min(0.9, 2.0 / world_size)
    return [rho] + [(1.0 - rho) / (world_size - 1)] * (world_size - 1)


def uneven_slope(profile: CollectiveProfile, mode: Collective) -> float | None:
    """The slope s of ``1 + s (W rho - 1)`` through the even and the uneven timing of ``mode``
    (all-gather and reduce-scatter together), or None when the profile has no uneven timing."""
    if profile.world_size < 2 or mode not in profile.by_mode or not profile.shares:
        return None
    excess = profile.world_size * max(profile.shares) - 1.0
    even = profile.allgather_ms + profile.reduce_scatter_ms
    if excess <= 1e-9 or even <= 0:
        return None
    ag, rs = profile.by_mode[mode]
    return max(0.0, ((ag + rs) / even - 1.0) / excess)


def _busy(device: torch.device, size: int) -> Callable[[], object]:
    a = torch.randn(size, size, device=device)
    return lambda: a @ a


def _repeat(step: Callable[[], object], calls: int) -> None:
    for _ in range(calls):
        step()  # nothing kept: a long region holds one result at a time


MAX_OVERLAP_CALLS = 2**16  # a 128 x 128 product: some 4-6 s of one CPU core here, far past any probed all-gather


def calls_lasting(block_ms: Callable[[int], float], target_ms: float, max_calls: int = MAX_OVERLAP_CALLS) -> int:
    """How many back-to-back calls of a step last ``target_ms``, given ``block_ms(n)``: n calls' time.

    The block doubles until it lasts the target or 1 ms, whichever is less (one call is too short
    to time on its own), and the count is scaled from it; at least 1 and at most ``max_calls``,
    even where the block reads as no time at all.
    """
    calls = 1
    while True:
        ms = block_ms(calls)
        if ms >= min(target_ms, 1.0) or calls >= max_calls:
            break
        calls = min(2 * calls, max_calls)
    if ms <= 0:
        return max_calls
    return int(min(max_calls, max(1, round(target_ms * calls / ms))))


def time_overlap(
    numel: int,
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    emulator: DeviceEmulator | None = None,
    links: Links | None = None,
    compute_dtype: torch.dtype = torch.float32,
    mode: Collective = Collective.PADDED,
    repeats: int = 5,
) -> float:
    """How much of an all-gather hides behind compute running beside it, in [0, 1]; every rank must call it.

    Times, with every rank together: the unit's all-gather alone (a), compute alone (c, a matrix
    product repeated to about a's length, in the emulator's compute region, as a layer runs), and the
    all-gather started asynchronously with the same compute before waiting for it (both). The overlap
    is ``(a + c - both) / min(a, c)``, the smallest over the ranks (the least hiding decides the
    step). Single process: 1 (there is nothing to hide).
    """
    if not is_distributed(group):
        return 1.0
    device = torch.device(device)
    world = dist.get_world_size(group)
    comm = Collectives(group, mode, links=links)
    unit = build_layout([numel], [1.0 / world] * world, ["profiled-unit"]).units[0]
    lo, hi = unit.shard_range(comm.rank)
    shard = torch.ones(hi - lo, dtype=compute_dtype, device=device)
    full = torch.empty(unit.numel, dtype=compute_dtype, device=device)
    statistic = default_statistic(device)
    timer = RegionTimer(device, emulator)
    gather = time_op(lambda: comm.all_gather(shard, full, unit).wait(), device, comm.group, 1, repeats)
    step = _busy(device, 128)
    calls = calls_lasting(lambda n: summarize([timer.time(lambda: _repeat(step, n))[1] for _ in range(3)], statistic),
                          gather)

    def compute() -> None:
        timer.time(lambda: _repeat(step, calls))

    alone = time_op(compute, device, comm.group, 1, repeats)

    def both() -> None:
        pending = comm.all_gather(shard, full, unit, async_op=True)
        compute()
        pending.wait()

    together = time_op(both, device, comm.group, 1, repeats)
    hidden = (gather + alone - together) / max(min(gather, alone), 1e-9)
    serial = torch.tensor([1.0 - min(1.0, max(0.0, hidden))], dtype=torch.float64,
                          device=device if dist.get_backend(group) == "nccl" else "cpu")
    return round(1.0 - float(all_reduce_(serial, "max", group).item()), 3)
