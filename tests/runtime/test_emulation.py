"""Device emulation: per-rank specs, the slowdown, the emulated memory capacity."""

from __future__ import annotations

import threading

import pytest
import torch

from cephalo_lightning.planner.schema.cluster_spec import Emulation
from cephalo_lightning.runtime.emulation.emulator import (
    DeviceEmulator,
    EmulationSpecError,
    emulator_for_rank,
    parse_emulation,
    parse_emulation_specs,
)
from cephalo_lightning.runtime.emulation.memory import EmulatedOutOfMemoryError
from cephalo_lightning.runtime.observers import Observers
from cephalo_lightning.runtime.timing import BusyTime, ContentionClock
from tests.fake_clock import FakeClock

# ---------------------------------------------------------------------------------------------
# specs


def test_specs_parse_dicts_emulations_and_none() -> None:
    specs = parse_emulation_specs([None, {}, {"slowdown": 3}, Emulation(2.0, 0.5), {"memory_gb": 1}], 5)
    assert specs == [None, Emulation(1.0, None), Emulation(3.0, None), Emulation(2.0, 0.5), Emulation(1.0, 1.0)]
    assert parse_emulation_specs(None, 3) == [None, None, None]


@pytest.mark.parametrize(
    ("specs", "world", "fragments"),
    [
        ([{"slowdown": 1}], 2, ["1 spec(s)", "2 rank(s)", "one per rank"]),
        ([{"slowdown": 1}, {"slowdown": 0.5}], 2, ["emulate[1] (rank 1).slowdown", ">= 1", "fastest device"]),
        ([{"slowdown": "fast"}], 1, ["emulate[0] (rank 0).slowdown", "finite number"]),
        ([{"memory_gb": 0}], 1, ["rank 0", "memory_gb must be > 0"]),
        ([{"memory": 2}], 1, ["rank 0", "unknown key", "memory_gb"]),
        ([3.0], 1, ["rank 0", "mapping"]),
        ({"slowdown": 3}, 1, ["a list with one spec per rank"]),
    ],
)
def test_bad_specs_name_the_rank_and_the_fix(specs: object, world: int, fragments: list[str]) -> None:
    with pytest.raises(EmulationSpecError) as err:
        parse_emulation_specs(specs, world)  # type: ignore[arg-type]
    for fragment in fragments:
        assert fragment in str(err.value)


def test_emulator_for_rank_validates_every_rank() -> None:
    with pytest.raises(EmulationSpecError, match="rank 1"):
        emulator_for_rank([{"slowdown": 2}, {"slowdown": -1}], rank=0, world_size=2)
    emulator = emulator_for_rank([{"slowdown": 1}, {"slowdown": 3, "memory_gb": 0.25}], rank=1, world_size=2)
    assert (emulator.slowdown, emulator.memory_gb, emulator.label) == (3.0, 0.25, "rank 1")


def test_from_spec_describe_and_round_trip() -> None:
    emulator = DeviceEmulator.from_spec({"slowdown": 3, "memory_gb": 0.05})
    assert emulator.is_emulated and emulator.active
    assert emulator.spec == Emulation(3.0, 0.05)
    assert parse_emulation(emulator) == Emulation(3.0, 0.05)
    assert emulator.capacity_bytes == int(0.05 * 2**30)
    assert "emulated" in emulator.describe() and "x3" in emulator.describe()
    assert emulator.name_suffix() == " (emulated x3.0, 0.05 GiB)"
    # full speed, but still a stand-in device: marked emulated
    plain = DeviceEmulator.from_spec({})
    assert plain.is_emulated and not plain.active and plain.spec == Emulation(1.0, None)
    assert plain.name_suffix() == " (emulated x1.0)"
    real = DeviceEmulator.from_spec(None)
    assert not real.is_emulated and real.spec is None and real.name_suffix() == ""
    assert "not emulated" in real.describe()


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ValueError, match="slowdown"):
        DeviceEmulator(slowdown=0.5)
    with pytest.raises(ValueError, match="memory_gb"):
        DeviceEmulator(memory_gb=0.0)


# ---------------------------------------------------------------------------------------------
# slowdown


# [Note: a clock the test controls] The emulator reads ContentionClock and sleeps with
# time.sleep; on a loaded machine real sleeps wake arbitrarily late, so these tests run the
# emulator on a fake clock: "work" and the emulator's waits advance it exactly, and a wake-up's
# lateness is a number the test chooses. What is tested is the emulator's arithmetic, exactly.


def _timed_region(clock: FakeClock, emulator: DeviceEmulator, work_s: float) -> float:
    start = clock.t
    emulator.begin_compute()
    clock.work(work_s)
    emulator.end_compute()
    return clock.t - start


def test_slowdown_scales_a_region(clock: FakeClock) -> None:
    for slowdown in (1.0, 3.0):
        emulator = DeviceEmulator(slowdown)
        assert _timed_region(clock, emulator, 0.02) == pytest.approx(0.02 * slowdown, rel=1e-9)


def test_nested_regions_count_once(clock: FakeClock) -> None:
    emulator = DeviceEmulator(2.0)
    start = clock.t
    emulator.begin_compute()
    emulator.begin_compute()
    clock.work(0.01)
    emulator.end_compute()  # inner: no wait yet
    assert clock.t - start == pytest.approx(0.01, rel=1e-9)
    clock.work(0.01)
    emulator.end_compute()  # outer: waits (2 - 1) x 0.02
    assert clock.t - start == pytest.approx(0.04, rel=1e-9)
    emulator.end_compute()  # unmatched end: ignored
    assert clock.t - start == pytest.approx(0.04, rel=1e-9)


def _short_regions(clock: FakeClock, emulator: DeviceEmulator, work: float, regions: int) -> float:
    start = clock.t
    for _ in range(regions):
        _timed_region(clock, emulator, work)
    return clock.t - start


def test_short_regions_do_not_accumulate_oversleep(clock: FakeClock) -> None:
    """Sub-millisecond regions whose waits each wake 50 us late: the lateness is paid back from the
    next wait, so the total stays 3x the plain one plus one wake-up's lateness (carried over
    nothing, 60 wake-ups would add 60 x 50 us: 3.17x)."""
    work, regions, clock.lateness = 0.0003, 60, 5e-5
    plain = _short_regions(clock, DeviceEmulator(1.0), work, regions)
    slowed = _short_regions(clock, DeviceEmulator(3.0), work, regions)
    assert plain == pytest.approx(regions * work, rel=1e-9)
    assert slowed == pytest.approx(3 * regions * work + clock.lateness, rel=1e-9)


def test_busy_time_counts_regions_and_the_emulated_waits(clock: FakeClock) -> None:
    for slowdown in (1.0, 3.0):
        observers = Observers()
        observers.attach(DeviceEmulator(slowdown))
        busy = observers.attach(BusyTime(), outermost=True)  # outside the emulator: its waits count
        before = busy.seconds
        for _ in range(3):
            with observers.compute("layer_forward"):
                clock.work(0.01)
        clock.work(0.01)  # outside any region: not busy
        assert busy.seconds - before == pytest.approx(0.03 * slowdown, rel=1e-9)


@pytest.mark.parametrize(("slowdown", "queued", "wall"), [
    (3.0, 0.005, 0.030),  # 5 ms waiting for a CPU, inside the 20 ms wait: the region lasts 3 x 10 ms
    (3.0, 0.020, 0.030),  # exactly the wait: nothing left to sleep
    (3.0, 0.025, 0.035),  # more than the wait covers: the region stretches by the 5 ms beyond it
    (1.0, 0.005, 0.015),  # no wait to cover anything with: the host's load shows, as before
])
def test_a_slowed_region_lasts_its_slowdown_times_its_compute_whatever_the_run_queue_wait_inside_it(
    clock: FakeClock, slowdown: float, queued: float, wall: float,
) -> None:
    """The emulated device computes 10 ms; its thread also waits ``queued`` for a CPU inside the region
    (other ranks on the host's cores). The region's wall time is the emulated device's, slowdown x 10 ms,
    as far as the wait after the compute covers the queueing, and the busy time read around it (what
    the profile and the calibration read) is slowdown x 10 ms in every case."""
    observers = Observers()
    observers.attach(DeviceEmulator(slowdown))
    busy = observers.attach(BusyTime(), outermost=True)
    before, start = busy.seconds, clock.t
    with observers.compute("layer_forward"):
        clock.work(0.004)
        clock.queue(queued)
        clock.work(0.006)
    assert clock.t - start == pytest.approx(wall, rel=1e-9)
    assert busy.seconds - before == pytest.approx(0.010 * slowdown, rel=1e-9)
    outside = ContentionClock.now()
    clock.queue(0.003)  # waiting for a CPU outside any region: never covered
    assert ContentionClock.now().since(outside) == pytest.approx(0.0, abs=1e-12)


def test_contention_clock_subtracts_the_run_queue_wait_of_one_thread() -> None:
    me, other = threading.get_ident(), threading.get_ident() + 1
    earlier = ContentionClock(10.0, 2.0, me)
    assert ContentionClock(10.5, 2.1, me).since(earlier) == pytest.approx(0.4)  # 0.1 s waited for a CPU
    assert ContentionClock(10.5, 2.1, me).queued_since(earlier) == pytest.approx(0.1)
    assert ContentionClock(10.5, 2.1, other).queued_since(earlier) == 0.0  # not measured across threads
    assert ContentionClock(10.5, 2.1, other).since(earlier) == pytest.approx(0.5)  # another thread: wall time
    assert ContentionClock(10.5, None, me).since(earlier) == pytest.approx(0.5)  # no schedstat: wall time
    assert ContentionClock(10.5, 3.0, me).since(earlier) == 0.0  # never negative
    assert ContentionClock.now().since(None) == 0.0
    first = ContentionClock.now()
    assert 0.0 <= ContentionClock.now().since(first)  # the real clock reads, and moves forward


class _PreemptedHost(ContentionClock):
    """A host where every read of either clock takes 1 us and, once, the thread is descheduled for
    5 ms right after a given wall-clock read (a timer tick landing between the two reads)."""

    t, waited, reads, preempt_after = 0.0, 0.0, 0, -1

    @staticmethod
    def _wall() -> float:
        host = _PreemptedHost
        host.t += 1e-6
        reading, host.reads = host.t, host.reads + 1
        if host.reads == host.preempt_after:
            host.t += 5e-3
            host.waited += 5e-3
        return reading

    @classmethod
    def _runqueue_wait(cls) -> float:
        _PreemptedHost.t += 1e-6
        return _PreemptedHost.waited


@pytest.mark.parametrize("preempted_at", ["start", "end"])
def test_a_preemption_between_the_two_reads_neither_hides_nor_adds_a_regions_compute(preempted_at: str) -> None:
    host = _PreemptedHost
    host.t, host.waited, host.reads = 0.0, 0.0, 0
    host.preempt_after = 1 if preempted_at == "start" else 2  # the first wall read of a reading, or the second's
    start = host.now()
    host.t += 40e-6  # the region's compute: a small matrix product
    end = host.now()
    # the region ran 40 us, plus the clock reads inside it; the 5 ms in the run queue is not its compute
    assert 40e-6 <= end.since(start) <= 50e-6, (preempted_at, end.since(start))


# ---------------------------------------------------------------------------------------------
# memory


def test_memory_tracker_enforces_the_emulated_capacity() -> None:
    emulator = DeviceEmulator.from_spec({"memory_gb": 1 / 1024}, label="rank 1")  # 1 MiB
    with emulator.memory_tracker(baseline_bytes=256 * 1024) as tracker:
        kept = torch.empty(512 * 1024, dtype=torch.uint8)  # 0.25 + 0.5 MiB: fits
        assert tracker.current_bytes == 768 * 1024
        with pytest.raises(EmulatedOutOfMemoryError) as err:
            torch.empty(512 * 1024, dtype=torch.uint8)  # would reach 1.25 MiB
    assert isinstance(err.value, torch.OutOfMemoryError)  # caught like a CUDA OOM
    message = str(err.value)
    assert "Emulated out of memory on rank 1" in message
    assert "0.001 GiB" in message and "memory_gb" in message
    del kept


def test_memory_tracker_without_capacity_only_counts() -> None:
    with DeviceEmulator().memory_tracker() as tracker:
        x = torch.ones(1000)
        y = x * 2
    assert tracker.capacity_bytes is None
    assert tracker.peak_bytes >= 8000
    del x, y


def test_cuda_cap_without_cuda_is_refused() -> None:
    assert DeviceEmulator().cap_cuda_memory() is None  # nothing to cap
    if torch.cuda.is_available():  # pragma: no cover - needs a GPU
        pytest.skip("this test covers the refusal without CUDA; no test sets the cap on a GPU")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        DeviceEmulator(memory_gb=1.0).cap_cuda_memory()
