"""The discovered layered mode vs the named adapter vs uniform: step time and peak memory.

    python -m benchmarks.bench_discovery            # about a minute
    python -m benchmarks.bench_discovery --quick    # fewer rounds
    python -m benchmarks.bench_discovery --json -
    python -m benchmarks.bench_discovery --layers 12   # a deeper model: the discovery's cost is per micro-batch
    python -m benchmarks.bench_discovery --rounds 60   # more paired rounds (default 30)

One Llama model (built from a config, no download) on 2 gloo ranks (CPU processes, NOT GPUs; every
figure is a CPU measurement), three ways, side by side in one run, rounds interleaved:

* ``adapter``: the layered schedule through the named Hugging Face adapter (``models.hf``: the
  embedding and the head are units of their own);
* ``discovered``: the same model through the structural discovery (``models.discovery``: the
  blocks found from the forward, the embedding stage and the head in the root unit, the model's
  forward re-entered for the prefix and the loss);
* ``uniform``: micro-batch-major accumulation over the same block units (hooks).

Printed: median step time (slowest rank, wall) and median step CPU time (the ranks' process CPU
seconds, summed) after the first step; the discovery's overhead over the adapter by both (goal
<= 5%) as the median of per-round ratios: each round runs the three variants back to back (the
order rotated round by round), so a ratio compares two steps taken a fraction of a second apart
and one disturbed round moves the median by one place at most; the quartiles of those ratios
show the spread. On a machine loaded beyond its cores the wall figure is mostly waiting, the CPU
figure much less so. The load average (as ``uptime`` prints it) is printed before and after.
Also the peak accounted memory of one step (MemoryTracker, activations and gathered units; the
resident state is the same for all three).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from benchmarks import _common as common
from benchmarks.harness import Benchmark

WORLD = 2


@dataclass(frozen=True)
class Config:
    vocab_size: int = 512
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    seq_len: int = 64
    micro_batches: int = 4
    micro_batch_size: int = 2
    shares: tuple[float, ...] = (0.5, 0.5)
    repeats: int = 30  # paired rounds
    warmup: int = 2


def _model(cfg: Config):  # noqa: ANN202
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, intermediate_size=4 * cfg.hidden,
                                      num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                                      num_key_value_heads=cfg.heads, max_position_embeddings=cfg.seq_len,
                                      attn_implementation="eager")
    return transformers.LlamaForCausalLM(config)


def _micro_batches(cfg: Config, rank: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(cfg.micro_batches):
        ids = torch.randint(0, cfg.vocab_size, (cfg.micro_batch_size, cfg.seq_len), generator=gen)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


class _Variant:
    """One way of running the step, with its own sharded copy of the model."""

    def __init__(self, cfg: Config, how: str, parts: list[dict[str, torch.Tensor]]) -> None:
        from cephalo_lightning.models import hf
        from cephalo_lightning.models.discovery import Discovery
        from cephalo_lightning.models.protocol import LossWeighting
        from cephalo_lightning.runtime.layered import LayeredSchedule
        from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

        self.how, self.parts = how, parts
        self.lm = _model(cfg)
        if how == "adapter":
            self.layered, _ = hf.adapt(self.lm)
        else:
            blocks = self.lm.model.layers
            discovery = Discovery(blocks, lambda mb: self.lm(**mb).loss, "model.layers", root=self.lm)
            self.layered = discovery.layered(LossWeighting("items", hf.label_count), "LlamaForCausalLM")
        self.sharded = ShardedModel(self.lm, list(cfg.shares), units=self.layered.units)
        self.schedule = LayeredSchedule(self.sharded, self.layered.layers, offload=False) if how != "uniform" else None
        if how == "discovered":  # the first step's observation (an ordinary forward, hooks on the blocks)
            self.sharded.gather_root()
            with self.layered.discovery.observe() as seen, torch.no_grad():
                self.lm(**parts[0])
            self.sharded.free_all()
            self.layered.discovery.structure, why = seen.structure()
            assert not why, why

    def step(self) -> None:
        n = len(self.parts)
        for p in self.sharded.parameters():
            p.grad = None
        if self.schedule is None:
            self.sharded.gather_root()
            for k, mb in enumerate(self.parts):
                self.sharded.set_requires_gradient_sync(k == n - 1)
                self.sharded.backward(self.lm(**mb).loss / n)
            self.sharded.set_requires_gradient_sync(True)
            return
        model = self.layered
        forward_pass = self.schedule.forward(self.parts, model.prepare, lambda k, out, side: model.loss(out, self.parts[k], side),
                              [1.0 / n] * n)
        self.schedule.backward(forward_pass)


def _rank_main(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    from cephalo_lightning.runtime.emulation.memory import MemoryTracker

    torch.set_num_threads(1)
    parts = _micro_batches(cfg, rank)
    variants = {how: _Variant(cfg, how, parts) for how in ("adapter", "discovered", "uniform")}
    peaks = {}
    for how, variant in variants.items():
        variant.step()  # the first step (untimed)
        gc.collect()
        tracker = MemoryTracker()
        with variant.sharded.observers.attached(tracker), tracker:
            variant.step()
        peaks[how] = tracker.peak_bytes
    cpu: dict[str, list[float]] = {how: [] for how in variants}

    def timed(how: str) -> Any:
        def run() -> None:
            start = time.process_time()
            variants[how].step()
            cpu[how].append(time.process_time() - start)
        return run

    times = common.interleaved_times({how: timed(how) for how in variants}, cfg.repeats, cfg.warmup)
    return {"rank": rank, "times": times, "cpu": {how: c[cfg.warmup:] for how, c in cpu.items()}, "peaks": peaks}


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return (values[0],) * 3 if values else (float("nan"),) * 3
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _uptime_load() -> str:
    """The load averages as ``uptime`` prints them (1, 5 and 15 minutes)."""
    try:
        return "load average: " + ", ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:  # pragma: no cover - not on every platform
        return "load average: unknown"


def run_benchmark(cfg: Config = Config()) -> dict[str, Any]:
    per_rank = common.run_ranks(_rank_main, WORLD, cfg)
    names = list(per_rank[0]["times"])
    slowest = {how: [max(r["times"][how][i] for r in per_rank) for i in range(cfg.repeats)] for how in names}
    # CPU seconds of the step summed over the ranks: what the step costs the machine, barely moved by other
    # processes competing for the cores (wall time on a loaded machine is mostly waiting)
    cpu = {how: [sum(r["cpu"][how][i] for r in per_rank) for i in range(cfg.repeats)] for how in names}
    rows = [{"variant": how, "median_step_s": common.median(slowest[how]), "median_cpu_s": common.median(cpu[how]),
             "peak_bytes": max(r["peaks"][how] for r in per_rank)} for how in names]
    rounds = {"wall": [a / b for a, b in zip(slowest["discovered"], slowest["adapter"])],
              "cpu": [a / b for a, b in zip(cpu["discovered"], cpu["adapter"])]}
    return {
        "config": asdict(cfg), "rows": rows,
        "discovery_over_adapter_cpu": common.paired_ratio(cpu["discovered"], cpu["adapter"]),
        "discovery_over_adapter": common.paired_ratio(slowest["discovered"], slowest["adapter"]),
        "discovery_over_adapter_rounds": rounds,  # per round, discovered / adapter
        "discovery_over_adapter_quartiles": {how: _quartiles(r) for how, r in rounds.items()},
        "adapter_over_uniform": common.paired_ratio(slowest["adapter"], slowest["uniform"]),
        "discovered_over_uniform": common.paired_ratio(slowest["discovered"], slowest["uniform"]),
        # the fastest round of each: the least disturbed by other processes on a shared machine
        "fastest_discovery_over_adapter": min(slowest["discovered"]) / min(slowest["adapter"]),
    }


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=Config.layers, help="decoder blocks (the overhead is per micro-batch)")
    parser.add_argument("--rounds", type=int, default=None, help=f"paired rounds (default {Config.repeats}; --quick 6)")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    common.quiet_lightning()
    rounds = args.rounds or (6 if args.quick else Config.repeats)
    cfg = Config(repeats=rounds, warmup=1 if args.quick else Config.warmup, layers=args.layers)
    before, uptime_before = common.load_average(), _uptime_load()
    result = run_benchmark(cfg)
    return {**result, "load": common.load_span(before), "uptime": (uptime_before, _uptime_load())}


def print_report(result: dict[str, Any]) -> None:
    cfg = Config(**result["config"])
    print(common.environment_note())
    common.print_table(
        ["variant", "median step s (measured, wall)", "median step CPU s, all ranks (measured)",
         "peak MiB of a step (measured, accounted)"],
        [[r["variant"], f"{r['median_step_s']:.4f}", f"{r['median_cpu_s']:.4f}", common.mib(r["peak_bytes"])]
         for r in result["rows"]],
        title=f"Llama {cfg.layers} layers, hidden {cfg.hidden}, seq {cfg.seq_len}: {cfg.micro_batches} micro-batches "
              f"of {cfg.micro_batch_size} per rank, {WORLD} gloo ranks (MEASURED on CPU)")
    overhead, cpu_overhead = result["discovery_over_adapter"] - 1.0, result["discovery_over_adapter_cpu"] - 1.0
    quartiles = result["discovery_over_adapter_quartiles"]
    print(f"discovery overhead after the first step, {cfg.repeats} interleaved paired rounds (median of the per-round "
          "ratios discovered / adapter; quartiles of those ratios in brackets; measured):")
    print(f"  wall: {result['discovery_over_adapter']:.3f} -> {100 * overhead:+.1f}% "
          f"[{quartiles['wall'][0]:.3f} .. {quartiles['wall'][2]:.3f}] (goal <= 5%: "
          f"{'met' if overhead <= 0.05 else 'NOT met'})")
    print(f"  CPU, all ranks: {result['discovery_over_adapter_cpu']:.3f} -> {100 * cpu_overhead:+.1f}% "
          f"[{quartiles['cpu'][0]:.3f} .. {quartiles['cpu'][2]:.3f}] (goal <= 5%: "
          f"{'met' if cpu_overhead <= 0.05 else 'NOT met'}; the figure to trust when the load below exceeds the cores)")
    print(f"fastest round discovered / fastest round adapter (measured; less sensitive to other load): "
          f"{result['fastest_discovery_over_adapter']:.3f}")
    print(f"adapter / uniform: {result['adapter_over_uniform']:.3f}; discovered / uniform: "
          f"{result['discovered_over_uniform']:.3f} (measured)")
    print(common.load_note(*result["load"]))
    print(f"uptime before: {result['uptime'][0]}; after: {result['uptime'][1]}")


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
