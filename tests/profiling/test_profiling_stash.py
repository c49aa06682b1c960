"""The layered stash in device memory: measured by the profiler, priced per sample by the cost model.

A recomputing layered rank whose stash stays on the device (``offload=False``: a CPU rank without an
emulated capacity) keeps every layer's input of every sample, and the last layer's outputs until the
loss, between its two passes: at a fixed micro-batch size its peak memory grows with its batch. The
reference is the runtime's own accounted peak (``MemoryTracker``) over batches up to 32x the
micro-batch.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cephalo_lightning.demo.gpt import GPT, GPTConfig
from cephalo_lightning.planner import evaluate
from cephalo_lightning.planner.cost.device_cost import DeviceCost
from cephalo_lightning.profiling import ClusterProfiler, ProfileOptions
from cephalo_lightning.runtime.emulation.memory import MemoryTracker
from cephalo_lightning.runtime.layered import LayeredSchedule, plain_input
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

SEQ, MICRO = 32, 2
OPTIONS = ProfileOptions(max_micro_batch=3, warmup=0, repeats=1, min_region_ms=0.0)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread, as each CPU rank has


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", seq_len=SEQ))


def sample(rows: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (rows, SEQ), generator=torch.Generator().manual_seed(1))


def test_profiler_measures_what_the_stash_keeps_per_sample() -> None:
    model = tiny_gpt()
    cluster = ClusterProfiler(model.layers(), sample(), options=OPTIONS, quiet=True).run().cluster
    config = model.config
    hidden = SEQ * config.n_embd * 4  # one sample's hidden state, fp32
    inputs = [SEQ * 8] + [hidden] * (len(model.layers()) - 1)  # the token ids (int64), then hidden states
    logits = SEQ * config.vocab_size * 4
    assert cluster.model.kept_bytes_per_sample == sum(inputs) + logits
    assert cluster.model.stash_bytes_per_sample == pytest.approx(sum(inputs) / len(inputs))
    # ranks on one host's CPU cores: the profiler records the cores they share
    assert cluster.settings.host_cores is not None and cluster.settings.host_cores >= 1


def measured_peak_bytes(batch: int) -> int:
    """The accounted peak of one layered step of ``batch`` samples in micro-batches of MICRO, stash on the device."""
    model = tiny_gpt()
    layers = model.layers()
    sharded = ShardedModel(model, [1.0], units=layers)
    schedule = LayeredSchedule(sharded, layers, offload=False)
    data = torch.randint(0, 256, (batch, SEQ + 1), generator=torch.Generator().manual_seed(2))
    xs = [data[k: k + MICRO, :-1] for k in range(0, batch, MICRO)]
    ys = [data[k: k + MICRO, 1:] for k in range(0, batch, MICRO)]
    tracker = MemoryTracker()
    with sharded.observers.attached(tracker), tracker:
        forward_pass = schedule.forward(xs, plain_input, lambda k, out, side: GPT.loss(out, ys[k]), [1 / len(xs)] * len(xs))
        schedule.backward(forward_pass)
    return tracker.peak_bytes


def test_memory_with_the_stash_on_the_device_is_never_under_predicted() -> None:
    model = tiny_gpt()
    profiled = ClusterProfiler(model.layers(), sample(), options=OPTIONS, quiet=True).run().cluster
    on_device = replace(profiled, settings=replace(profiled.settings, stash_on_device=True))
    cost = DeviceCost(on_device.devices[0], on_device)
    for batch in (MICRO, 4 * MICRO, 16 * MICRO, 32 * MICRO, 128 * MICRO):
        n = batch // MICRO
        predicted = evaluate(on_device, [batch], [n], [1.0])[0].memory_gb * 2**30
        measured = measured_peak_bytes(batch)
        assert measured <= predicted, (batch, measured, predicted)
        # the term is b x the measured bytes per sample, on top of the profile's compute memory
        without = evaluate(profiled, [batch], [n], [1.0])[0].memory_gb * 2**30
        assert predicted - without == pytest.approx(batch * on_device.model.kept_bytes_per_sample)
        assert float(cost.stash_gb(batch)) * 2**30 == pytest.approx(batch * on_device.model.kept_bytes_per_sample)
    # without the term the largest batch's peak is under-predicted: the stash is what grows with b (the
    # reduction's shards, priced per share though a lone rank holds none, are a constant it outgrows)
    assert measured > without, (measured, without)
