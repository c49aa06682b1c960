"""The profiler: layer and model profiles, collectives, the cache, and the gathered emulated cluster."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from cephalo_lightning.demo.gpt import GPT, GPTConfig
from cephalo_lightning.planner import Cluster, load_cluster, plan, save_cluster
from cephalo_lightning.profiling import (
    ClusterProfiler,
    ModelDescription,
    ProfileOptions,
    ProfilingError,
    layer_signature,
    profile_cluster,
    profile_layer,
    profile_model,
    take_rows,
    time_collectives,
)
from cephalo_lightning.profiling.model import ModelHooks, gathered_bytes
from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator, EmulationSpecError
from tests.distributed import run_distributed
from tests.tiny_gpt import sample_tokens, tiny_gpt

# the cheapest profile that still runs every code path (for tests about plumbing, not timing)
QUICK = ProfileOptions(max_micro_batch=3, warmup=0, repeats=1, min_region_ms=0.0)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread, as each CPU rank has


class MLPBlock(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


# ---------------------------------------------------------------------------------------------
# one layer


def test_layer_profile_times_and_memory() -> None:
    block = MLPBlock()
    before = {k: v.clone() for k, v in block.state_dict().items()}
    source = torch.randn(4, 16, 64)
    rng = torch.get_rng_state()
    profile = profile_layer(block, lambda m: take_rows(source, m), [1, 2, 3, 4], repeats=3)
    assert profile.sizes == (1, 2, 3, 4)
    assert all(t > 0 for t in profile.fwd_ms + profile.bwd_ms)
    # B is defined so that F + B is the measured recompute + backward pass
    for f, b, p in zip(profile.fwd_ms, profile.bwd_ms, profile.backward_pass_ms):
        assert f + b == pytest.approx(max(p, f))
    # compute memory: the layer (params + their grads) plus activations that grow with m
    params = sum(p.numel() * 4 for p in block.parameters())
    assert profile.param_bytes == params and profile.numel == params // 4
    assert profile.compute_bytes[0] > 2 * params
    assert list(profile.compute_bytes) == sorted(set(profile.compute_bytes))
    # the user's layer and RNG are untouched (a private copy is profiled)
    assert all(p.grad is None for p in block.parameters())
    assert all(torch.equal(before[k], v) for k, v in block.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


def test_layer_profile_rejects_bad_inputs() -> None:
    block = MLPBlock()
    with pytest.raises(ValueError, match="dimension 0 must be the micro-batch size 2"):
        profile_layer(block, lambda m: torch.randn(3, 64), [2], repeats=1)
    with pytest.raises(TypeError, match="must return a tensor"):
        profile_layer(block, lambda m: [torch.randn(m, 64)], [1], repeats=1)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="micro-batch sizes"):
        profile_layer(block, lambda m: torch.randn(m, 64), [0, 1], repeats=1)

    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    with pytest.raises(TypeError, match="ONE tensor"):
        profile_layer(Pair(), lambda m: torch.randn(m, 4), [1], repeats=1)


# ---------------------------------------------------------------------------------------------
# a whole model


def test_model_profile_of_gpt_tiny() -> None:
    model = tiny_gpt()
    layers = model.layers()
    profile = profile_model(layers, sample_tokens(), ProfileOptions(max_micro_batch=4, repeats=3))
    assert profile.sizes == (1, 2, 3, 4)
    assert profile.num_layers == len(layers) == 4
    assert profile.parameters == model.num_parameters()
    # the two blocks are identical: measured once
    assert [(k.name, k.indices) for k in profile.kinds] == [("Embedding", (0,)), ("Block", (1, 2)), ("Head", (3,))]
    # per-layer figures are the mean over the layers: num_layers x figure = the whole model
    for j in range(4):
        whole = sum(k.profile.fwd_ms[j] * len(k.indices) for k in profile.kinds)
        assert profile.layer_fwd_ms[j] * profile.num_layers == pytest.approx(whole)
    # times are measured on a shared host: only their presence is checked (their order is noise here)
    assert all(t > 0 for t in profile.layer_fwd_ms + profile.layer_bwd_ms)
    memory = profile.compute_memory_bytes
    assert all(b > a for a, b in zip(memory, memory[1:]))  # compute memory grows with m


def test_a_sharded_model_is_counted_while_each_layer_is_gathered() -> None:
    """A sharded layer's parameters outside its unit context are empty (or a rank's shard): the layer
    sizes the collectives are timed on must be counted inside it, as the all-gather moves them."""
    import contextlib

    model = tiny_gpt()
    layers = model.layers()
    whole = [[p.data for p in layer.parameters()] for layer in layers]
    expected = [sum(t.numel() for t in tensors) for tensors in whole]
    assert sum(expected) == model.num_parameters()
    for layer in layers:  # "sharded": nothing is held outside a unit context
        for p in layer.parameters():
            p.data = p.data.new_empty(0)

    @contextlib.contextmanager
    def gathered(index: int):
        params = list(layers[index].parameters())
        for p, full in zip(params, whole[index]):
            p.data = full
        try:
            yield
        finally:
            for p in params:
                p.data = p.data.new_empty(0)

    profile = profile_model(layers, sample_tokens(), QUICK, hooks=ModelHooks(unit_context=gathered))
    assert list(profile.layer_numels) == expected
    assert profile.parameters == sum(expected)


def test_model_memory_counts_the_prefetched_neighbour() -> None:
    layers = tiny_gpt().layers()
    quick = dict(max_micro_batch=2, warmup=0, repeats=1, min_region_ms=0.0)
    with_prefetch = profile_model(layers, sample_tokens(), ProfileOptions(prefetch=True, **quick))
    without = profile_model(layers, sample_tokens(), ProfileOptions(prefetch=False, resident_bytes=1000, **quick))
    # the accounting counts exact bytes, so both runs measured the same per-layer figures
    own = {i: k.profile.compute_bytes for k in with_prefetch.kinds for i in k.indices}
    gathered = [gathered_bytes(layer, None) for layer in layers]
    for j in range(2):
        neighbour = [max(gathered[i - 1] if i else 0, gathered[i + 1] if i + 1 < len(layers) else 0) for i in own]
        assert with_prefetch.compute_memory_bytes[j] == max(own[i][j] + neighbour[i] for i in own)
        assert without.compute_memory_bytes[j] == max(own[i][j] for i in own) + 1000


def test_signatures_and_rows() -> None:
    a, b, c = MLPBlock(64), MLPBlock(64), MLPBlock(32)
    x = torch.randn(2, 64)
    assert layer_signature(a, x) == layer_signature(b, x)
    assert layer_signature(a, x) == layer_signature(b, torch.randn(5, 64))  # batch size does not matter
    assert layer_signature(a, x) != layer_signature(c, torch.randn(2, 32))
    assert layer_signature(a, x) != layer_signature(a, torch.randn(2, 3, 64))
    rows = take_rows(torch.arange(3).view(3, 1), 7)
    assert rows.view(-1).tolist() == [0, 1, 2, 0, 1, 2, 0]


def test_collectives_in_one_process_cost_nothing() -> None:
    comm = time_collectives(1000, modes=("padded", "exact"))
    assert (comm.allgather_ms, comm.reduce_scatter_ms, comm.world_size) == (0.0, 0.0, 1)
    with pytest.raises(ValueError, match="collective mode"):
        time_collectives(1000, modes=("ring",))


# ---------------------------------------------------------------------------------------------
# the cluster and its cache, single process


def test_single_process_cluster_and_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    layers, sample = tiny_gpt().layers(), sample_tokens()
    kwargs = dict(model=ModelDescription(name="gpt-tiny"), options=QUICK, cache_dir=tmp_path, quiet=True)
    first = ClusterProfiler(layers, sample, **kwargs).run()
    assert not first.from_cache and first.cache_file is not None and first.cache_file.is_file()
    device = first.cluster.devices[0]
    assert (device.name, device.source, device.emulate) == ("cpu", "measured", None)
    assert device.memory_gb > 0.1  # the host's RAM (one rank on this host)
    assert first.cluster.model.num_layers == 4 and first.cluster.model.name == "gpt-tiny"
    assert first.cluster.settings.reserved_memory_gb == 0.0  # CPU defaults
    assert first.cluster.settings.sync_passes  # a shard group's ranks end every layer's pass together

    again = ClusterProfiler(layers, sample, **kwargs).run()
    assert again.from_cache and again.cluster == first.cluster and again.cache_file == first.cache_file

    forced = ClusterProfiler(layers, sample, force=True, **kwargs).run()
    assert not forced.from_cache and forced.cache_file == first.cache_file

    # a different profile (more micro-batch sizes, an emulated device) is a different cache entry
    fewer = ProfileOptions(max_micro_batch=2, warmup=0, repeats=1, min_region_ms=0.0)
    other = ClusterProfiler(layers, sample, **{**kwargs, "options": fewer}).run()
    assert not other.from_cache and other.cache_file != first.cache_file
    emulated = profile_cluster(layers, sample, emulate=[{"slowdown": 2, "memory_gb": 0.5}], **kwargs)
    assert emulated.devices[0].name == "cpu (emulated x2.0, 0.5 GiB)" and emulated.devices[0].memory_gb == 0.5
    assert len(list(tmp_path.glob("cluster-*.yaml"))) == 3

    # a damaged cache file is ignored (with a warning), not trusted
    first.cache_file.write_text("devices: [")
    with caplog.at_level(logging.WARNING):
        repaired = ClusterProfiler(layers, sample, **kwargs).run()
    assert not repaired.from_cache and "ignoring the profile cache" in caplog.text
    assert load_cluster(first.cache_file) == repaired.cluster


def test_profiler_argument_errors() -> None:
    layers = tiny_gpt().layers()
    with pytest.raises(ValueError, match="does not match emulate"):
        ClusterProfiler(layers, sample_tokens(), emulate=[{"slowdown": 2}], emulator=DeviceEmulator(3.0))
    agreeing = ClusterProfiler(layers, sample_tokens(), emulate=[{"slowdown": 3}], emulator=DeviceEmulator(3.0))
    assert agreeing.emulator.slowdown == 3.0
    with pytest.raises(EmulationSpecError, match="rank 0"):
        ClusterProfiler(layers, sample_tokens(), emulate=[{"slowdown": 0}])
    with pytest.raises(ValueError, match="layers"):
        ClusterProfiler([], sample_tokens())
    with pytest.raises(ValueError, match="max_micro_batch"):
        ProfileOptions(max_micro_batch=0)
    with pytest.raises(ValueError, match="collective_modes"):
        ProfileOptions(collective_modes=("ring",))


# ---------------------------------------------------------------------------------------------
# two emulated ranks (gloo)


def _profile_emulated_pair(rank: int, world_size: int, cache_dir: str) -> dict:
    # the demo's "small" GPT: a block costs milliseconds, so compute (not the collectives) decides the plan
    torch.manual_seed(0)
    layers = GPT(GPTConfig.preset("small", seq_len=64)).layers()
    sample = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    emulate = [{"slowdown": 1}, {"slowdown": 3, "memory_gb": 0.05}]
    options = ProfileOptions(max_micro_batch=4, collective_modes=("padded", "exact"))
    first = ClusterProfiler(layers, sample, ModelDescription(name="gpt-small"), emulate=emulate, options=options,
                            cache_dir=cache_dir, quiet=True).run()
    again = ClusterProfiler(layers, sample, ModelDescription(name="gpt-small"), emulate=emulate, options=options,
                            cache_dir=cache_dir, quiet=True).run()
    return {
        "cluster": first.cluster, "seconds": first.seconds, "measured_by": first.measured_by,
        "local": first.local, "comm": first.collectives, "cached": again.from_cache,
        "cached_cluster": again.cluster, "cache_seconds": again.seconds, "cache_file": str(first.cache_file),
    }


@pytest.mark.multiprocess
def test_emulated_slowdown_is_recovered_and_planned() -> None:
    with tempfile.TemporaryDirectory() as cache_dir:
        results = run_distributed(_profile_emulated_pair, 2, cache_dir)
        cluster: Cluster = results[0]["cluster"]
        # every rank built the same cluster, one device per rank, marked emulated
        assert results[1]["cluster"] == cluster
        assert cluster.world_size == 2 and cluster.emulated
        fast, slow = cluster.devices
        assert fast.name == "cpu (emulated x1.0)" and slow.name == "cpu (emulated x3.0, 0.05 GiB)"
        assert {d.source for d in cluster.devices} == {"emulated"}
        assert (slow.emulate.slowdown, slow.emulate.memory_gb, slow.memory_gb) == (3.0, 0.05, 0.05)
        assert results[0]["measured_by"] == (0, 1)  # different emulations: each measures itself
        # how closely the profile recovers the emulated slowdown is wall-clock: benchmarks/wall_clock_checks.py
        # profiled (the slowdown itself is exact on a fake clock: tests/runtime/test_emulation.py)
        assert slow.compute_memory_gb == fast.compute_memory_gb  # exact byte accounting, same model
        # the collectives were timed, in both modes, and went into the settings
        assert cluster.settings.allgather_ms > 0 and cluster.settings.reduce_scatter_ms > 0
        assert set(results[0]["comm"].by_mode) == {"padded", "exact"}
        # the restart reused the cache, on every rank
        assert all(r["cached"] and r["cached_cluster"] == cluster for r in results)
        # the cluster file round-trips
        path = Path(cache_dir) / "copy.yaml"
        save_cluster(cluster, path)
        assert load_cluster(path) == cluster
        assert load_cluster(results[0]["cache_file"]) == cluster
    # and the planner gives the slow rank the smaller batch
    result = plan(cluster, global_batch_size=16)
    assert result.batch_sizes[1] < result.batch_sizes[0]
    assert result.emulated


def _shared_and_failing(rank: int, world_size: int) -> dict:
    layers, sample = tiny_gpt().layers(), sample_tokens()
    shared = ClusterProfiler(layers, sample, emulate=[{"slowdown": 2}] * 2, options=QUICK, quiet=True).run()
    # a rank whose model is broken fails; every rank raises instead of hanging
    bad_sample = sample if rank == 0 else sample.float()
    try:
        ClusterProfiler(layers, bad_sample, options=QUICK, quiet=True,
                        emulate=[{"slowdown": 1}, {"slowdown": 2}]).run()
        error = None
    except ProfilingError as err:
        error = str(err)
    return {"measured_by": shared.measured_by, "cluster": shared.cluster, "local": shared.local, "error": error}


@pytest.mark.multiprocess
def test_identical_devices_share_a_measurement_and_failures_reach_every_rank() -> None:
    results = run_distributed(_shared_and_failing, 2)
    assert [r["measured_by"] for r in results] == [(0, 0), (0, 0)]
    assert results[0]["local"] is not None and results[1]["local"] is None  # rank 1 only waited
    devices = results[0]["cluster"].devices
    assert devices[0] == devices[1] and results[1]["cluster"] == results[0]["cluster"]
    for r in results:
        assert r["error"] is not None and "profiling failed on rank 1" in r["error"]
