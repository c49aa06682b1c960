"""The profiler's figures for the newer cost terms, and a cache that checks the capacity it holds."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
import yaml

from cephalo_lightning.demo.gpt import GPT, GPTConfig
from cephalo_lightning.planner import Settings, plan
from cephalo_lightning.profiling import ClusterProfiler, ProfileOptions, profile_cluster
from cephalo_lightning.profiling.collective_timing import CollectiveProfile, calls_lasting, skewed_shares, uneven_slope
from cephalo_lightning.profiling.optimizer import time_optimizer_step
from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator
from tests.distributed import run_distributed
from tests.fake_clock import FakeClock

QUICK = ProfileOptions(max_micro_batch=2, warmup=0, repeats=1, min_region_ms=0.0, collective_repeats=2)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread, as each CPU rank has


def tiny() -> tuple[list[torch.nn.Module], torch.Tensor]:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig.preset("tiny", seq_len=32))
    return gpt.layers(), torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))


class _ClockedStep(torch.optim.Optimizer):
    """An optimizer whose step costs exactly 1 ns per parameter on the test's clock."""

    def __init__(self, params: Iterable[torch.nn.Parameter], clock: FakeClock) -> None:
        super().__init__(params, {})
        self.clock = clock

    def step(self, closure: object = None) -> None:
        self.clock.work(sum(p.numel() for group in self.param_groups for p in group["params"]) * 1e-9)


def test_optimizer_step_is_timed_per_parameter_inside_the_emulators_region(clock: FakeClock) -> None:
    def optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return _ClockedStep(params, clock)

    plain = time_optimizer_step(numel=2**10, repeats=3, optimizer=optimizer)
    assert plain.ns_per_param == pytest.approx(1.0, rel=1e-9)
    assert plain.ns_per_param == pytest.approx(plain.step_ms * 1e6 / 2**10, rel=1e-12)
    slow = time_optimizer_step(numel=2**10, repeats=3, optimizer=optimizer, emulator=DeviceEmulator(3.0))
    assert slow.ns_per_param == pytest.approx(3.0, rel=1e-9)  # the emulator's x3 applies to the step
    with pytest.raises(ValueError, match="numel >= 1"):
        time_optimizer_step(numel=0)


def test_uneven_slope_from_even_and_skewed_timings() -> None:
    assert skewed_shares(2) == [0.9, pytest.approx(0.1)] and skewed_shares(4) == [0.5, 0.5 / 3, 0.5 / 3, 0.5 / 3]
    even = CollectiveProfile(1000, 4, 2.0, 2.0, tuple(skewed_shares(4)), {"padded": (3.0, 3.0)})
    assert uneven_slope(even, "padded") == pytest.approx(0.5)  # 1.5x the time at W rho - 1 = 1
    assert uneven_slope(even, "exact") is None
    faster = CollectiveProfile(1000, 4, 2.0, 2.0, tuple(skewed_shares(4)), {"padded": (1.0, 1.0)})
    assert uneven_slope(faster, "padded") == 0.0  # never negative


def test_the_overlaps_compute_is_sized_from_a_timed_block_and_bounded_when_the_clock_reads_nothing() -> None:
    timed: list[int] = []

    def linear(n: int) -> float:  # 0.05 ms a call
        timed.append(n)
        return 0.05 * n

    assert calls_lasting(linear, 10.0) == 200  # the block grew to 1 ms (20 calls), then was scaled
    assert timed == [1, 2, 4, 8, 16, 32]
    assert calls_lasting(linear, 0.2) == 4  # a short target: the block stops at the target itself
    timed.clear()
    # a clock that reads no time (a host that descheduled the thread at the wrong instant): bounded
    assert calls_lasting(lambda n: timed.append(n) or 0.0, 10.0, max_calls=64) == 64
    assert timed == [1, 2, 4, 8, 16, 32, 64]
    assert calls_lasting(lambda n: 50.0 * n, 10.0) == 1  # one call already outlasts the target


def test_cache_with_a_capacity_the_device_does_not_have_is_profiled_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    layers, sample = tiny()
    kwargs = dict(options=QUICK, cache_dir=tmp_path, quiet=True, emulate=[{"memory_gb": 0.5}])
    first = ClusterProfiler(layers, sample, **kwargs).run()
    assert first.cluster.devices[0].optimizer_ns_per_param > 0  # measured with the layers, cached with them
    assert ClusterProfiler(layers, sample, **kwargs).run().from_cache
    data = yaml.safe_load(first.cache_file.read_text())
    data["devices"][0]["memory_gb"] = 1000  # a hand edit: 1000 GiB on a 0.5 GiB (emulated) device
    first.cache_file.write_text(yaml.safe_dump(data))
    with caplog.at_level(logging.WARNING):
        again = ClusterProfiler(layers, sample, **kwargs).run()
    assert not again.from_cache and again.cluster.devices[0].memory_gb == 0.5
    assert "rank 0" in caplog.text and "0.5 GiB of memory but the cache says 1e+03 GiB" in caplog.text


def _profile_pair(rank: int, world_size: int, overlaps: list[float | None]) -> list:
    """The emulated pair profiled once per ``overlap`` setting, in the same two ranks."""
    layers, sample = tiny()
    clusters = []
    for overlap in overlaps:
        settings = Settings(reserved_memory_gb=0.0, micro_batch_overhead_ms=0.0, overlap=overlap)
        clusters.append(profile_cluster(layers, sample, emulate=[{"slowdown": 1}, {"slowdown": 2}], options=QUICK,
                                        settings=settings, quiet=True))
    return clusters


@pytest.mark.multiprocess
def test_two_ranks_measure_slope_overlap_and_optimizer() -> None:
    measured, pinned = run_distributed(_profile_pair, 2, [None, 0.25])[0]  # 0.25: a value the caller set is kept
    s = measured.settings
    assert s.uneven_slope is not None and s.uneven_slope >= 0
    assert s.overlap is not None and 0.0 <= s.overlap <= 1.0
    # the emulator's scaling of the step is checked exactly on a test clock above; measured here,
    # the two ranks' figures only say that each was timed (a loaded host can invert their order)
    assert all(device.optimizer_ns_per_param > 0 for device in measured.devices)
    assert plan(measured, 8).global_batch_size == 8
    assert pinned.settings.overlap == 0.25
