"""Emulation of a slower or smaller device, so a CPU process can stand in for a GPU of a mixed cluster.

A rank's emulation is the planner's :class:`~cephalo_lightning.planner.schema.cluster_spec.Emulation`
``(slowdown, memory_gb, node, inter_node_gbps)``:

* ``slowdown`` >= 1: every compute region takes that many times longer. The emulator is a runtime
  observer (:mod:`.observers`): attached to a sharded model it hears each unit's forward and
  backward and each optimizer step as a compute region, measures the region's compute and then
  waits until the region has lasted ``slowdown`` times that. Waiting (not spinning) leaves the cores
  to the other ranks of a CPU "cluster", so a slow emulated rank does not slow down the fast ones.
  Time the rank spends waiting for a CPU (host contention) is left out of the measure on Linux
  (:class:`ContentionClock`), so the emulator slows down the device's compute, not its neighbours'
  load; and that wait counts towards the region's length, so where the wait after the compute is
  long enough to cover it, the region lasts ``slowdown`` x its compute whatever the host's load
  (a GPU's kernels do not wait for a neighbour's; see [Note: covered run-queue wait]). A rank at
  slowdown 1 has no wait to cover anything with: its regions still stretch with the host's load.
* ``memory_gb``: a capacity in GiB (2**30 bytes, as ``torch.cuda`` reports). On CPU it is enforced
  by a :class:`~cephalo_lightning.runtime.emulation.memory.MemoryTracker` (:meth:`DeviceEmulator.memory_tracker`),
  which raises :class:`~cephalo_lightning.runtime.emulation.memory.EmulatedOutOfMemoryError` (a
  ``torch.OutOfMemoryError``) past it. On CUDA it can cap a real GPU with the caching allocator's
  per-process memory fraction (:meth:`DeviceEmulator.cap_cuda_memory`).
* ``node`` and ``inter_node_gbps``: the emulated node the rank is in and the bandwidth of the link
  between nodes; the runtime's collectives slow the sends that cross nodes to it
  (:mod:`.links`, built from every rank's spec by :func:`~.links.links_from_emulation`).

Everything that reports a figure measured under emulation should say so (:meth:`DeviceEmulator.describe`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning._common.units import GIB
from cephalo_lightning.planner.schema.cluster import EmulationSpecError, parse_emulation_spec
from cephalo_lightning.planner.schema.cluster_spec import Emulation
from cephalo_lightning.runtime.emulation.links import links_from_emulation
from cephalo_lightning.runtime.emulation.memory import MemoryTracker
from cephalo_lightning.runtime.observers import Observer
from cephalo_lightning.runtime.timing import ContentionClock

__all__ = [
    "DeviceEmulator", "Emulation", "EmulationSpecError", "EmulationSpec", "emulator_for_rank",
    "parse_emulation", "parse_emulation_specs",
]

EmulationSpec = Emulation | Mapping[str, Any] | None  # what a user may write for one rank


def parse_emulation(spec: EmulationSpec | DeviceEmulator, where: str = "emulate") -> Emulation | None:
    """One rank's spec (``None``, an :class:`Emulation`, a dict or an emulator) as an :class:`Emulation`.

    ``None`` means "a real device, not emulated"; ``{}`` means "emulated, at full speed and with
    unlimited memory" (a CPU rank that stands in for the fastest GPU of the cluster). The checks are
    the cluster file's (:func:`~cephalo_lightning.planner.schema.cluster.parse_emulation_spec`).
    """
    if isinstance(spec, DeviceEmulator):
        return spec.spec
    return parse_emulation_spec(spec, where)


def parse_emulation_specs(specs: Sequence[EmulationSpec] | None, world_size: int) -> list[Emulation | None]:
    """Per-rank specs (one entry per rank, in rank order) validated into :class:`Emulation` or ``None``.

    ``specs=None`` means no rank is emulated. Every error names the rank and how to fix it.
    """
    if world_size < 1:
        raise EmulationSpecError(f"world_size must be >= 1, got {world_size}")
    if specs is None:
        return [None] * world_size
    if isinstance(specs, (str, bytes, Mapping, Emulation)) or not isinstance(specs, Sequence):
        raise EmulationSpecError(
            f"emulate must be a list with one spec per rank (world size {world_size}), e.g. "
            f"[{{slowdown: 1}}, {{slowdown: 3, memory_gb: 0.5}}]; got {type(specs).__name__} {specs!r}"
        )
    if len(specs) != world_size:
        raise EmulationSpecError(
            f"emulate has {len(specs)} spec(s) but the world has {world_size} rank(s): give exactly one per rank "
            "in rank order (null or {} for a rank at full speed with unlimited memory)"
        )
    parsed = [parse_emulation(spec, f"emulate[{rank}] (rank {rank})") for rank, spec in enumerate(specs)]
    links_from_emulation(parsed)  # the ranks' nodes and link agree
    return parsed


@dataclass
class DeviceEmulator(Observer):
    """Makes this rank's compute take ``slowdown`` times as long, and optionally caps its memory.

    Attached to a runtime's :class:`~.observers.Observers`, it hears every unit's compute region
    (nested regions count once), measures it on the contention-free clock and then waits until the
    region has lasted ``slowdown`` times that (the run-queue wait inside the region counts towards
    it, up to ``slowdown - 1`` times the compute). ``memory_gb`` is the emulated capacity (GiB); it is enforced
    where a tracker or a CUDA cap is set up from it (:meth:`memory_tracker`,
    :meth:`cap_cuda_memory`), not by the slowdown regions.

    ``node`` / ``inter_node_gbps``: the emulated node and inter-node link this rank's spec names;
    recorded (in :attr:`spec` and :meth:`describe`) here, priced by :class:`~.links.EmulatedLinks`.

    ``emulated`` marks the rank as an emulated device even at slowdown 1 without a memory cap
    (a CPU process standing in for the fastest GPU of a cluster); figures it reports say so.
    ``synchronize_cuda``: the rank computes on CUDA: a slowdown synchronizes the device before
    reading the clock at the end of a region, so it scales kernel time rather than launch time.
    At slowdown 1 the emulator does nothing at all in a region (attach it or not).
    """

    slowdown: float = 1.0
    memory_gb: float | None = None
    node: int | None = None
    inter_node_gbps: float | None = None
    emulated: bool = False
    synchronize_cuda: bool = False
    label: str = ""
    _depth: int = field(default=0, repr=False)
    _oversleep: float = field(default=0.0, repr=False)
    _start_clock: ContentionClock | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        parse_emulation_spec(Emulation(self.slowdown, self.memory_gb, self.node, self.inter_node_gbps), "DeviceEmulator")

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_spec(cls, spec: EmulationSpec, label: str = "", synchronize_cuda: bool = False) -> DeviceEmulator:
        """The emulator for one rank's spec (``None``: a real device, no emulation)."""
        emulation = parse_emulation(spec, f"emulate{f' ({label})' if label else ''}")
        if emulation is None:
            return cls(label=label, synchronize_cuda=synchronize_cuda)
        return cls(
            slowdown=emulation.slowdown, memory_gb=emulation.memory_gb, node=emulation.node,
            inter_node_gbps=emulation.inter_node_gbps, emulated=True, label=label, synchronize_cuda=synchronize_cuda,
        )

    # ------------------------------------------------------------------ what it emulates

    @property
    def active(self) -> bool:
        """Whether compute regions are slowed down."""
        return self.slowdown > 1.0

    @property
    def is_emulated(self) -> bool:
        """Whether figures measured on this rank come from emulation (not the bare device)."""
        return self.emulated or self.active or self.memory_gb is not None or self.node is not None

    @property
    def spec(self) -> Emulation | None:
        """The planner's record of this emulation (``None`` for a real device)."""
        if not self.is_emulated:
            return None
        return Emulation(self.slowdown, self.memory_gb, self.node, self.inter_node_gbps)

    @property
    def capacity_bytes(self) -> int | None:
        """The emulated capacity in bytes (GiB units), or ``None`` for unlimited."""
        return None if self.memory_gb is None else int(self.memory_gb * GIB)

    def describe(self) -> str:
        """One line for logs and tables; says plainly that the figures are emulated."""
        if not self.is_emulated:
            return "real device (not emulated)"
        memory = f"{self.memory_gb:g} GiB memory" if self.memory_gb is not None else "unlimited memory"
        link = ""
        if self.node is not None:
            speed = f"{self.inter_node_gbps:g} GB/s per direction" if self.inter_node_gbps is not None \
                else "the bandwidth the other ranks' specs give"
            link = f", on emulated node {self.node} (links to other nodes emulated at {speed})"
        return (
            f"emulated device: compute x{self.slowdown:g} slower, {memory}{link} "
            "(times, capacity and links are emulated, not measured on real hardware)"
        )

    def name_suffix(self) -> str:
        """A device-name suffix such as ``" (emulated x3.0, 0.05 GiB)"``; empty for a real device."""
        if not self.is_emulated:
            return ""
        parts = [f"x{self.slowdown:.1f}"]
        if self.memory_gb is not None:
            parts.append(f"{self.memory_gb:g} GiB")
        return f" (emulated {', '.join(parts)})"

    # ------------------------------------------------------------------ slowdown

    def compute_begin(self, region: str = "compute") -> None:
        if not self.active:
            return
        if self._depth == 0:
            self._start_clock = ContentionClock.now()
        self._depth += 1

    def compute_end(self, region: str = "compute") -> None:
        if not self.active or self._depth == 0:
            return
        self._depth -= 1
        if self._depth != 0:
            return
        if self._cuda_timing():  # pragma: no cover - CUDA only
            torch.cuda.synchronize()  # the wait must scale kernel time, not launch time
        now = ContentionClock.now()
        wait = now.since(self._start_clock) * (self.slowdown - 1.0)
        covered = min(now.queued_since(self._start_clock), wait)  # waiting for a CPU inside the region
        ContentionClock.cover(covered)
        self._wait(wait - covered)

    # the names the profiler's timer uses
    begin_compute = compute_begin
    end_compute = compute_end

    def _cuda_timing(self) -> bool:
        return self.synchronize_cuda and torch.cuda.is_available() and torch.cuda.is_initialized()

    def _wait(self, seconds: float) -> None:
        """Sleep ``seconds``, carrying the OS's oversleep over to the next wait.

        ``time.sleep`` wakes tens of microseconds late; on sub-millisecond regions that would bias
        the emulated slowdown upwards, so the lateness is subtracted from the next wait instead.
        Time spent runnable but waiting for a CPU after the wake-up is host contention, not
        oversleep (see :class:`ContentionClock`).
        """
        want = seconds - self._oversleep
        if want <= 0:
            self._oversleep = -want
            return
        before = ContentionClock.now()
        time.sleep(want)
        self._oversleep = max(0.0, ContentionClock.now().since(before) - want)

    # ------------------------------------------------------------------ memory

    def memory_tracker(self, baseline_bytes: int = 0, label: str | None = None) -> MemoryTracker:
        """A CPU :class:`MemoryTracker` capped at the emulated capacity (unlimited without ``memory_gb``).

        ``baseline_bytes``: memory already resident when tracking starts (e.g. this rank's training
        state) that counts against the capacity. Use it as a context manager around the step.
        """
        return MemoryTracker(
            capacity_bytes=self.capacity_bytes, baseline_bytes=baseline_bytes,
            label=self.label if label is None else label,
        )

    def cap_cuda_memory(self, device: torch.device | int | None = None) -> float | None:
        """Cap a real GPU at ``memory_gb`` with the caching allocator's per-process memory fraction.

        Returns the fraction set, or ``None`` when there is nothing to cap (no ``memory_gb``).
        Raises if CUDA is unavailable or the GPU is smaller than the emulated capacity. The cap
        covers PyTorch's allocator only (not the CUDA context, about 0.3-1 GiB, nor other
        libraries' allocations). Not exercised by the CPU test suite.
        """
        if self.memory_gb is None:
            return None
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"cannot cap GPU memory at {self.memory_gb:g} GiB: CUDA is not available. On CPU the emulated "
                "capacity is enforced by DeviceEmulator.memory_tracker()"
            )
        index = _cuda_index(device)  # pragma: no cover - CUDA only from here on
        total = torch.cuda.get_device_properties(index).total_memory
        fraction = self.memory_gb * GIB / total
        if fraction > 1.0:
            raise ConfigurationError(
                f"emulated memory_gb={self.memory_gb:g} GiB is larger than cuda:{index} "
                f"({total / GIB:.1f} GiB): a cap can only emulate a smaller card"
            )
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        return fraction


def _cuda_index(device: torch.device | int | None) -> int:  # pragma: no cover - CUDA only
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ConfigurationError(f"cap_cuda_memory needs a CUDA device, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


def emulator_for_rank(
    specs: Sequence[EmulationSpec] | None, rank: int, world_size: int, synchronize_cuda: bool = False
) -> DeviceEmulator:
    """Validate every rank's spec (so all ranks fail alike) and build this rank's emulator."""
    parsed = parse_emulation_specs(specs, world_size)
    if not 0 <= rank < world_size:
        raise EmulationSpecError(f"rank {rank} is outside the world of {world_size} rank(s)")
    return DeviceEmulator.from_spec(parsed[rank], label=f"rank {rank}", synchronize_cuda=synchronize_cuda)
