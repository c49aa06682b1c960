"""How long a rank computes: the contention-free CPU clock and the busy-time observer.

Production timing, used with or without emulation: :class:`BusyTime` is what the callback's
drift check and the benchmarks compare with the planner's predicted busy time, and
:class:`ContentionClock` is the clock both it and the emulator read on CPU.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

from cephalo_lightning.runtime.observers import Observer

__all__ = ["BusyTime", "ContentionClock"]

_PAIRING_TRIES = 4  # a thread descheduled at every one of them is on a host that no reading can help


class ContentionClock:
    """Wall time minus the time this thread spent runnable but waiting for a CPU (Linux).

    A CPU "cluster" shares its host's cores with other ranks and other programs. Time a thread
    waits in the run queue is the host's contention, not the emulated device's compute: the
    emulator scales only the rest, and the profiler measures only the rest, so neither amplifies
    (nor reports) a neighbour's load. The run-queue wait comes from ``/proc/thread-self/schedstat``
    (second field, nanoseconds); where it is unavailable (not Linux) this is the plain wall clock.
    Readings from different threads are not comparable: :meth:`since` then falls back to wall time.

    [Note: covered run-queue wait] An emulated slow device waits after each compute region until
    the region has lasted ``slowdown`` times its compute
    (:class:`~cephalo_lightning.runtime.emulation.emulator.DeviceEmulator`), so time its thread spent
    in the run queue inside the region is covered by that wait: the emulated device was still
    computing then, as a GPU would be whatever its host's other processes do. The emulator reports
    what it covered (:meth:`cover`, per thread) and every later reading leaves it out of the
    run-queue wait, so a reader around the region still reads the device's ``slowdown`` x compute,
    no more and no less, while the region's wall time no longer grows with the host's load.
    """

    _local = threading.local()
    _available: bool | None = None

    __slots__ = ("wall", "waited", "thread")

    def __init__(self, wall: float, waited: float | None, thread: int) -> None:
        self.wall = wall
        self.waited = waited
        self.thread = thread

    @classmethod
    def _runqueue_wait(cls) -> float | None:
        if cls._available is False:
            return None
        fd = getattr(cls._local, "fd", None)
        try:
            if fd is None:
                fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
                cls._local.fd = fd
            fields = os.pread(fd, 128, 0).split()
            cls._available = True
            return int(fields[1]) * 1e-9
        except (OSError, IndexError, ValueError):
            cls._available = False
            return None

    @staticmethod
    def _wall() -> float:
        return time.perf_counter()

    @classmethod
    def covered(cls) -> float:
        """Seconds of this thread's run-queue wait an emulated device's waits have covered so far."""
        return getattr(cls._local, "covered", 0.0)

    @classmethod
    def cover(cls, seconds: float) -> None:
        """Count ``seconds`` of this thread's run-queue wait as the emulated device's time, not contention."""
        if seconds > 0.0:
            cls._local.covered = cls.covered() + seconds

    @classmethod
    def now(cls) -> ContentionClock:
        """This instant: the wall clock and the run-queue wait read with no wait between them.

        A thread descheduled between the two reads would pair a wall time with a wait that came
        after it, and a short region ending there would read as zero (a profiler sizing its work
        by such a reading would then size it without bound). The wait is read on both sides of the
        wall clock, again until the two agree.
        """
        waited = cls._runqueue_wait()
        for _ in range(_PAIRING_TRIES):
            wall = cls._wall()
            after = cls._runqueue_wait()
            if after == waited:
                break
            waited = after
        if waited is not None:
            waited -= cls.covered()
        return cls(wall, waited, threading.get_ident())

    def since(self, earlier: ContentionClock | None) -> float:
        """Seconds from ``earlier`` to this reading, less the run-queue wait in between."""
        if earlier is None:
            return 0.0
        wall = self.wall - earlier.wall
        if self.waited is None or earlier.waited is None or self.thread != earlier.thread:
            return wall
        return max(0.0, wall - (self.waited - earlier.waited))

    def queued_since(self, earlier: ContentionClock) -> float:
        """Seconds from ``earlier`` to this reading spent waiting for a CPU (0 where not measured)."""
        return max(0.0, self.wall - earlier.wall - self.since(earlier))


class BusyTime(Observer):
    """Seconds this rank spends in compute regions, what the profile's figures predict.

    On CPU the contention-free clock (:class:`ContentionClock`); on CUDA a pair of events per
    outermost region, read (and released) whenever :attr:`seconds` is read, and folded into the
    total every ``max_pending`` regions so that nothing grows if nobody reads. Attach it
    OUTSIDE an emulator (``observers.attach(busy, outermost=True)``) so the emulator's waits,
    which delay the real schedule, count as busy time.
    """

    def __init__(self, cuda: bool = False, max_pending: int = 512) -> None:
        self.cuda = cuda
        self.max_pending = max_pending
        self._depth = 0
        self._start: Any = None
        self._total = 0.0
        self._wall = 0.0  # CPU: the same regions on the wall clock, run-queue waits included
        self._pending: list[tuple[Any, Any]] = []

    def compute_begin(self, region: str) -> None:
        if self._depth == 0:
            if self.cuda:  # pragma: no cover - CUDA only
                self._start = torch.cuda.Event(enable_timing=True)
                self._start.record()
            else:
                self._start = ContentionClock.now()
        self._depth += 1

    def compute_end(self, region: str) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth:
            return
        if self.cuda:  # pragma: no cover - CUDA only
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._start, end))
            if len(self._pending) >= self.max_pending:
                self._fold()
        else:
            now = ContentionClock.now()
            self._total += now.since(self._start)
            self._wall += now.wall - self._start.wall
        self._start = None

    def _fold(self) -> None:  # pragma: no cover - CUDA only
        for start, end in self._pending:
            end.synchronize()
            self._total += start.elapsed_time(end) / 1e3
        self._pending.clear()

    @property
    def wall_seconds(self) -> float:
        """CPU: wall seconds in the same regions, waits for a core included (ranks sharing a host);
        CUDA: :attr:`seconds`."""
        return self.seconds if self.cuda else self._wall

    @property
    def seconds(self) -> float:
        """Seconds in compute regions so far (take differences, e.g. per step)."""
        if self._pending:  # pragma: no cover - CUDA only
            self._fold()
        return self._total
