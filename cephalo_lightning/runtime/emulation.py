"""CPU emulation of a slower device (memory capacity emulation: see :class:`MemoryCap`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class DeviceEmulator:
    """Makes this rank's compute take ``slowdown`` times as long, by waiting after each region.

    The engine and the layered schedule call :meth:`begin_compute` / :meth:`end_compute` around
    every unit's forward and backward; nested regions count once.
    """

    slowdown: float = 1.0
    _depth: int = field(default=0, repr=False)
    _start: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if self.slowdown < 1.0:
            raise ValueError(f"slowdown must be >= 1 (1 = full speed), got {self.slowdown}")

    @property
    def active(self) -> bool:
        return self.slowdown > 1.0

    def begin_compute(self) -> None:
        if self._depth == 0:
            self._start = time.perf_counter()
        self._depth += 1

    def end_compute(self) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0 and self.active:
            elapsed = time.perf_counter() - self._start
            time.sleep(elapsed * (self.slowdown - 1.0))
