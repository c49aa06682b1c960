"""A clock the test controls, for the device emulator and everything timed through it.

The emulator measures a region on :class:`ContentionClock` and sleeps; on this clock, work inside a
region and the emulator's sleeps advance time by exactly what the test says, whatever the load of
the machine running the suite.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from cephalo_lightning.runtime.emulation import emulator as emulator_module
from cephalo_lightning.runtime.timing import ContentionClock


class FakeClock:
    def __init__(self, lateness: float = 0.0) -> None:
        self.t = 0.0
        self.waited = 0.0  # run-queue wait so far
        self.lateness = lateness  # how late every sleep of the emulator wakes up

    def now(self) -> ContentionClock:
        return ContentionClock(self.t, self.waited - ContentionClock.covered(), threading.get_ident())

    def work(self, seconds: float) -> None:  # compute inside a region
        self.t += seconds

    def queue(self, seconds: float) -> None:  # runnable, waiting for a CPU another process holds
        self.t += seconds
        self.waited += seconds

    def sleep(self, seconds: float) -> None:  # the emulator's wait
        self.t += seconds + self.lateness


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(ContentionClock, "now", classmethod(lambda cls: fake.now()))
    monkeypatch.setattr(emulator_module, "time", SimpleNamespace(sleep=fake.sleep, perf_counter=lambda: fake.t))
    return fake
