"""A rank's device, and how the measured devices become the planner's device profiles.

What a rank is (:class:`RankIdentity`: host, device, emulation, memory) is gathered before
anything is measured; after the measurements, :func:`device_profiles` turns each rank's (or its
leader's) :class:`~.model.ModelProfile` into the cluster file's device entry, with the capacity
the planner may fill (:func:`capacity_gb`), and :func:`measured_settings` folds the measured
collectives into the cost model's settings.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from cephalo_lightning._common.units import GIB
from cephalo_lightning._common.vocabulary import Collective, ProfileSource
from cephalo_lightning.planner.schema.cluster_spec import DeviceProfile, Emulation, Settings
from cephalo_lightning.profiling.collective_timing import CollectiveProfile, uneven_slope
from cephalo_lightning.profiling.model import ModelProfile
from cephalo_lightning.profiling.profiling_error import ProfilingError
from cephalo_lightning.profiling.topology import LinkProfile
from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator

MIN_MS = 1e-5  # the planner needs strictly positive times; a layer can take less than a microsecond


def default_device() -> torch.device:
    """The current CUDA device if there is one, else the CPU."""
    if torch.cuda.is_available():  # pragma: no cover - CUDA only
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_name(device: torch.device, emulator: DeviceEmulator | None = None) -> str:
    """The CUDA device's name, or ``"cpu"``, plus an emulation suffix such as ``" (emulated x3.0, 0.05 GiB)"``."""
    base = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return base + (emulator.name_suffix() if emulator is not None else "")


def host_memory_gb() -> float | None:
    """Physical RAM of this host in GiB, or ``None`` where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None


def _cuda_total_gb(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory / GIB  # pragma: no cover - CUDA only


def default_settings(device: torch.device) -> Settings:
    """The cost model's settings for this kind of device.

    :class:`Settings`' default 2 GB reserve (CUDA context, allocator slack) and 10 ms per extra
    micro-batch (kernel launches) are GPU figures; a CPU process has neither, and its per-call overheads are
    already inside the measured layer times. On both, the ranks of a shard group wait for each other
    at every layer's collectives (``sync_passes``).
    """
    if device.type == "cuda":  # pragma: no cover - CUDA only
        return Settings(sync_passes=True)
    return Settings(reserved_memory_gb=0.0, micro_batch_overhead_ms=0.0, sync_passes=True)


@dataclass(frozen=True)
class RankIdentity:
    """What a rank tells the others about its device before anything is measured."""

    rank: int
    host: str
    name: str
    emulate: Emulation | None
    device_type: str
    cuda_total_gb: float | None
    host_memory_gb: float | None


def capacity_gb(ident: RankIdentity, ids: Sequence[RankIdentity]) -> float:
    """What the planner may fill on a rank: its emulated capacity, its GPU, or its share of the host's RAM."""
    if ident.emulate is not None and ident.emulate.memory_gb is not None:
        return ident.emulate.memory_gb
    if ident.cuda_total_gb is not None:
        return ident.cuda_total_gb
    if ident.host_memory_gb is None:
        raise ProfilingError(
            f"rank {ident.rank}: cannot tell this host's memory; give the rank an emulated memory_gb"
        )
    on_host = sum(1 for other in ids if other.host == ident.host and other.device_type == "cpu")
    return ident.host_memory_gb / max(1, on_host)


def affine_fit(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, ...]:
    """The least-squares line ``a + b*m`` (a, b >= 0) through measured times, at the same sizes.

    On a shared CPU host each size is measured at a different moment, and a few percent of noise
    makes one micro-batch size look faster per sample than its neighbours; the planner would then
    split batches into micro-batches that are slower in fact. Layer times grow about linearly with
    the micro-batch size, so the line keeps what is real and drops the noise.
    """
    n = len(sizes)
    if n < 2:
        return tuple(times)
    mean_m, mean_t = sum(sizes) / n, sum(times) / n
    var = sum((m - mean_m) ** 2 for m in sizes)
    slope = max(0.0, sum((m - mean_m) * (t - mean_t) for m, t in zip(sizes, times)) / var)
    intercept = max(0.0, mean_t - slope * mean_m)
    return tuple(intercept + slope * m for m in sizes)


def device_profiles(ids: Sequence[RankIdentity], leaders: Sequence[int], profiles: Sequence[ModelProfile | None],
                    optimizer: Sequence[float | None] | None, smooth: bool) -> tuple[DeviceProfile, ...]:
    """Every rank's device entry, from the measurement of the rank that measured for it."""
    devices = []
    for ident, leader in zip(ids, leaders):
        profile = profiles[leader]
        assert profile is not None, f"rank {leader} did not measure"
        fwd, bwd = profile.layer_fwd_ms, profile.layer_bwd_ms
        if smooth:
            fwd, bwd = affine_fit(profile.sizes, fwd), affine_fit(profile.sizes, bwd)
        devices.append(DeviceProfile(
            name=ident.name,
            memory_gb=round(capacity_gb(ident, ids), 6),
            layer_fwd_ms=tuple(max(MIN_MS, round(v, 5)) for v in fwd),
            layer_bwd_ms=tuple(max(MIN_MS, round(v, 5)) for v in bwd),
            compute_memory_gb=tuple(round(b / GIB, 9) for b in profile.compute_memory_bytes),
            activation_memory_gb=tuple(round(b / GIB, 9) for b in profile.activation_memory_bytes)
            if profile.activation_memory_bytes and any(profile.activation_memory_bytes) else None,
            source=ProfileSource.EMULATED if ident.emulate is not None else ProfileSource.MEASURED,
            emulate=ident.emulate,
            optimizer_ns_per_param=None if optimizer is None or optimizer[leader] is None
            else round(optimizer[leader], 6),
        ))
    return tuple(devices)


def measured_settings(settings: Settings, comm: CollectiveProfile | None, mode: Collective,
                      overlap: float | None, links: LinkProfile | None = None) -> Settings:
    """``settings`` with the measured collective times, their uneven slope and overlap, and the links'
    bandwidths within and between nodes (a value the caller set explicitly wins over a measured
    slope, overlap or bandwidth)."""
    if comm is None:
        return settings
    if links is not None:
        if settings.link_bandwidth_gbps is None and links.intra_node_gbps is not None:
            settings = replace(settings, link_bandwidth_gbps=float(f"{links.intra_node_gbps:.4g}"))
        if settings.inter_node_bandwidth_gbps is None:
            settings = replace(settings, inter_node_bandwidth_gbps=float(f"{links.inter_node_gbps:.4g}"))
    settings = replace(settings, allgather_ms=round(comm.allgather_ms, 5),
                       reduce_scatter_ms=round(comm.reduce_scatter_ms, 5), collective=mode)
    slope = uneven_slope(comm, mode)
    if settings.uneven_slope is None and slope is not None:
        settings = replace(settings, uneven_slope=round(slope, 4))
    if settings.overlap is None and overlap is not None:
        settings = replace(settings, overlap=overlap)
    return settings


def shared_host_cores(ids: Sequence[RankIdentity]) -> float | None:
    """The cores every rank shares when all are CPU processes on one host (the cores this process may
    run on, as the OS reports them), else None: ranks with devices of their own share no cores."""
    if not ids or any(i.device_type != "cpu" for i in ids) or len({i.host for i in ids}) != 1:
        return None
    try:
        return float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not on every platform
        count = os.cpu_count()
        return float(count) if count else None
