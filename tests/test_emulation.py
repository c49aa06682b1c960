"""Device emulation: per-rank specs, the slowdown, the emulated memory capacity."""

from __future__ import annotations

import time

import pytest
import torch

from cephalo_lightning.planner.cluster import Emulation
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


def _timed_region(emulator: DeviceEmulator, work_s: float) -> float:
    start = time.perf_counter()
    emulator.begin_compute()
    time.sleep(work_s)  # stands for compute; immune to CPU contention, so the test is about the emulator
    emulator.end_compute()
    return time.perf_counter() - start


def test_slowdown_scales_a_region() -> None:
    for slowdown in (1.0, 3.0):
        emulator = DeviceEmulator(slowdown)
        elapsed = min(_timed_region(emulator, 0.02) for _ in range(3))
        assert elapsed == pytest.approx(0.02 * slowdown, rel=0.15)


def test_nested_regions_count_once() -> None:
    emulator = DeviceEmulator(2.0)
    start = time.perf_counter()
    emulator.begin_compute()
    emulator.begin_compute()
    time.sleep(0.01)
    emulator.end_compute()  # inner: no wait yet
    inner = time.perf_counter() - start
    time.sleep(0.01)
    emulator.end_compute()
    total = time.perf_counter() - start
    assert inner < 0.015
    assert total == pytest.approx(0.04, rel=0.2)
    emulator.end_compute()  # unmatched end: ignored


def _short_regions(emulator: DeviceEmulator, work: float, regions: int) -> float:
    start = ContentionClock.now()
    for _ in range(regions):
        emulator.begin_compute()
        end = time.perf_counter() + work
        while time.perf_counter() < end:  # busy work of a known duration
            pass
        emulator.end_compute()
    return ContentionClock.now().since(start)


def test_short_regions_do_not_accumulate_oversleep() -> None:
    """Sub-millisecond regions: the OS's late wake-ups are paid back, so the total stays ~3x."""
    work, regions = 0.0003, 60
    plain = _short_regions(DeviceEmulator(1.0), work, regions)
    slowed = _short_regions(DeviceEmulator(3.0), work, regions)
    assert slowed / plain == pytest.approx(3.0, rel=0.15)


def test_busy_time_counts_regions_and_the_emulated_waits() -> None:
    for slowdown in (1.0, 3.0):
        observers = Observers()
        observers.attach(DeviceEmulator(slowdown))
        busy = observers.attach(BusyTime(), outermost=True)  # outside the emulator: its waits count
        before = busy.seconds
        for _ in range(3):
            with observers.compute("layer_forward"):
                time.sleep(0.01)
        time.sleep(0.01)  # outside any region: not busy
        assert busy.seconds - before == pytest.approx(0.03 * slowdown, rel=0.2)


def test_contention_clock_is_wall_time_without_load() -> None:
    start = ContentionClock.now()
    time.sleep(0.01)  # sleeping is not waiting for a CPU: it counts
    assert ContentionClock.now().since(start) == pytest.approx(0.01, abs=0.005)
    assert ContentionClock.now().since(None) == 0.0


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


def test_cuda_cap() -> None:
    assert DeviceEmulator().cap_cuda_memory() is None  # nothing to cap
    if torch.cuda.is_available():  # pragma: no cover - needs a GPU
        pytest.skip("the CUDA cap is checked on GPU machines only")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        DeviceEmulator(memory_gb=1.0).cap_cuda_memory()
