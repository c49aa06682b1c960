"""Timing one compute region the way the runtime runs it: under the device emulator.

CPU: wall clock less the time the thread waited for a CPU
(:class:`~cephalo_lightning.runtime.timing.ContentionClock`: on a shared host, other ranks' and
programs' load is not this device's speed). CUDA: events recorded around the region with the device
synchronized on both sides, so the figure is kernel time; the emulator's wait happens between the
events and therefore counts, exactly as it delays the real schedule.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator
from cephalo_lightning.runtime.timing import ContentionClock

T = TypeVar("T")


STATISTICS = ("min", "median")


def median(values: Sequence[float]) -> float:
    """The median: robust to the odd slow repeat (a page fault, another rank's burst)."""
    if not values:
        raise ValueError("median of no measurements")
    return float(statistics.median(values))


def summarize(values: Sequence[float], statistic: str) -> float:
    """Reduce repeats to one figure: ``"min"`` or ``"median"``."""
    if not values:
        raise ValueError("no measurements to summarize")
    if statistic == "min":
        return float(min(values))
    if statistic == "median":
        return median(values)
    raise ConfigurationError(f"statistic must be one of {STATISTICS}, got {statistic!r}")


def default_statistic(device: torch.device) -> str:
    """``"min"`` on CPU, ``"median"`` on CUDA.

    On a CPU host shared with other ranks and programs, interference (cache and SMT sharing that
    no scheduler counter shows) only ever adds time, so the fastest repeat is the best estimate of
    the device's own speed (as ``timeit`` recommends). GPU kernel times have symmetric jitter: the
    median.
    """
    return "median" if device.type == "cuda" else "min"


class RegionTimer:
    """Times callables on one device, each wrapped in the emulator's compute region."""

    def __init__(self, device: torch.device, emulator: DeviceEmulator | None = None) -> None:
        self.device = torch.device(device)
        self.emulator = emulator or DeviceEmulator()
        self.cuda = self.device.type == "cuda"

    def time(self, fn: Callable[[], T]) -> tuple[T, float]:
        """Run ``fn`` once inside ``begin_compute() / end_compute()``; return (result, milliseconds)."""
        if self.cuda:  # pragma: no cover - CUDA only
            return self._time_cuda(fn)
        start = ContentionClock.now()
        self.emulator.begin_compute()
        try:
            result = fn()
        finally:
            self.emulator.end_compute()
        return result, ContentionClock.now().since(start) * 1e3

    def _time_cuda(self, fn: Callable[[], T]) -> tuple[T, float]:  # pragma: no cover - CUDA only
        torch.cuda.synchronize(self.device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        self.emulator.begin_compute()
        try:
            result = fn()
            # the emulator reads the host clock: let it see the kernels, not just their launch
            torch.cuda.synchronize(self.device)
        finally:
            self.emulator.end_compute()
        end.record()
        torch.cuda.synchronize(self.device)
        return result, float(start.elapsed_time(end))

    def synchronize(self) -> None:
        if self.cuda:  # pragma: no cover - CUDA only
            torch.cuda.synchronize(self.device)
