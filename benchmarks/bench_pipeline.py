"""Pipelined plan vs every non-pipelined one on an emulated 2-node cluster with a slow link between the nodes.

    python -m benchmarks.bench_pipeline              # 3 rounds of 3 measured steps per plan; minutes on 2 cores
    python -m benchmarks.bench_pipeline --quick      # a smaller model, 1 round of 2 steps
    python -m benchmarks.bench_pipeline --link-ratio 20  # the inter-node link 20x slower than the host's (default)
    python -m benchmarks.bench_pipeline --json -     # the result as JSON on stdout

THE CLUSTER IS EMULATED ON CPU: 4 gloo ranks on this machine stand for 2 nodes x 2 GPUs (ranks 0, 1 on
node 0; 2, 3 on node 1). Every rank's compute regions are stretched to ``slowdown`` x their compute on
the contention-free clock (:class:`~cephalo_lightning.runtime.emulation.emulator.DeviceEmulator`;
slowdown 2 so that 4 ranks on 2 cores do not wait for each other's compute), and what a rank sends to
the other node is held to an emulated link (:class:`~cephalo_lightning.runtime.emulation.links.EmulatedLinks`)
``link_ratio`` times slower than the host's own link between two ranks, MEASURED first (an
all-reduce of 16 MiB between ranks 0 and 1) and printed beside it. No GPU is involved.

The model is a stack of residual MLP blocks (``layers`` of width ``hidden``) on (batch, tokens, hidden)
inputs with a per-sample mean-squared error, run by the runtime directly (no Lightning): each plan is
one step loop over the same global batches, every plan built in the same spawned group, measured in
rounds with the order rotated each round.

Plans:

* ``pipeline``: 2 stages (node 0 computes the first half of the blocks, node 1 the second), 2
  pipelines (ranks 0 -> 2 and 1 -> 3), each stage sharded over its node's two ranks
  (:class:`~cephalo_lightning.runtime.pipelining.runner.PipelineRunner`), 1F1B, ``micro`` micro-batches
  per pipeline, layer by layer (each layer gathered, recomputed and reduced per micro-batch, as the
  planner prices it); only hidden states and their gradients cross the link;
* ``pipeline-gathered``: the same, each stage gathered once a step and its gradient reduced once
  (no recomputation; the stage's whole state and the in-flight activations held);
* ``full-shard``: one shard group of the 4 ranks (the layered schedule), every unit gathered and
  reduced across the link;
* ``hsdp``: a shard group per node, the replicas' gradients summed across the link;
* ``ddp``: groups of one rank, every gradient all-reduced across the link;
* ``node-alone``: node 0's two ranks alone (full shard inside the node), node 1 idle: the best subset.

Figures: MEASURED step = wall time of one optimizer step (forward, backward, reduction, optimizer),
max over the ranks, median over the measured steps of every round; samples/s = global batch / step.
The headline is the faster pipelined plan's throughput over the best non-pipelined plan's (goal >= 1.5).
PREDICTED step: the planner's pipeline cost is not wired in here yet (``predicted`` is null): it
lives on the planner's side of pipelined plans, which this benchmark does not import.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks import _common as common
from benchmarks.harness import Benchmark

WORLD = 4
NODES = (0, 0, 1, 1)
PLANS = ("pipeline", "pipeline-gathered", "full-shard", "hsdp", "ddp", "node-alone")
PIPELINED = ("pipeline", "pipeline-gathered")
GOAL = 1.5


@dataclass(frozen=True)
class Config:
    hidden: int = 512
    layers: int = 8
    tokens: int = 8
    global_batch: int = 32
    micro: int = 4  # micro-batches per pipeline
    rounds: int = 3
    steps: int = 3  # measured steps per plan per round (one warm-up step before each)
    slowdown: float = 2.0
    link_ratio: float = 20.0


QUICK = Config(hidden=384, tokens=4, rounds=1, steps=2)


def _model(config: Config, seed: int = 0):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, h: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(h)
            self.up = nn.Linear(h, 4 * h)
            self.down = nn.Linear(4 * h, h)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    torch.manual_seed(seed)
    return nn.Sequential(*[Block(config.hidden) for _ in range(config.layers)])


def _data(config: Config, step: int):
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(config.global_batch, config.tokens, config.hidden, generator=gen)
    return x, torch.randn(x.shape, generator=gen)


def _measure_host_link(rank: int) -> float:
    """GB/s of an all-reduce of 16 MiB between ranks 0 and 1 (node 0), the host's own link."""
    import torch
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    tensor = torch.ones(4 * 2**20)
    times = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        if rank in (0, 1):
            dist.all_reduce(tensor, group=group)
        times.append(time.perf_counter() - start)
    seconds = torch.tensor(common.median(times[1:]))
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    # an all-reduce of M bytes over 2 ranks sends M bytes from each (2M/k per peer, k = 2)
    return tensor.numel() * 4 / seconds.item() / 1e9


class _Plan:
    """One plan on this rank: ``step(x, y)`` runs one optimizer step (collective over its ranks)."""

    def __init__(self, name: str, rank: int, config: Config, links: Any, emulator: Any) -> None:
        import torch
        import torch.distributed as dist

        from cephalo_lightning.runtime.layered import LayeredSchedule
        from cephalo_lightning.runtime.pipelining.runner import PipelineRunner
        from cephalo_lightning.runtime.pipelining.stages import PipelineLayout
        from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

        self.name, self.rank, self.config = name, rank, config
        model = _model(config)
        self.runner = self.schedule = None
        self.active = True
        half = config.global_batch // 2
        if name in PIPELINED:
            layout = PipelineLayout((config.layers // 2, config.layers - config.layers // 2), ((0, 2), (1, 3)),
                                    (0.5, 0.5, 0.5, 0.5), (half, config.global_batch - half),
                                    (config.micro, config.micro), "1f1b")
            self.layout = layout
            self.runner = PipelineRunner(model, list(model), layout, prepare=lambda mb: (mb[0], None),
                                         loss=lambda out, mb, side, total: ((out - mb[1]) ** 2).mean(dim=(1, 2)).sum() / total,
                                         items=lambda mb: len(mb[0]), links=links,
                                         layer_by_layer=name == "pipeline")
            self.runner.sharded.observers.attach(emulator)
            self.sharded = self.runner.sharded
            params = self.runner.parameters()
        else:
            groups = {"full-shard": [[0, 1, 2, 3]], "hsdp": [[0, 1], [2, 3]], "ddp": [[0], [1], [2], [3]],
                      "node-alone": [[0, 1]]}[name]
            ranks = sorted(r for g in groups for r in g)
            group = dist.new_group(ranks) if len(ranks) < WORLD else None
            self.ranks = ranks
            self.active = rank in ranks
            if not self.active:
                return
            shares = [1.0 / len(g) for g in groups for _ in g]
            self.sharded = ShardedModel(model, shares, units=list(model), group=group, shard_groups=groups,
                                        links=links, hooks=False)
            self.sharded.observers.attach(emulator)
            self.schedule = LayeredSchedule(self.sharded, list(model))
            params = list(self.sharded.parameters())
        self.optimizer = torch.optim.AdamW(params, lr=1e-3)

    def step(self, x, y) -> None:
        import torch

        from cephalo_lightning.runtime.batching import micro_batches

        if not self.active:
            return
        config = self.config
        if self.runner is not None:
            d = self.layout.pipeline_of(self.rank)
            rows = self.layout.samples(d)
            parts = micro_batches((x[rows.start:rows.stop], y[rows.start:rows.stop]), self.layout.micro_batch_sizes(d))
            self.runner.train_step(parts)
        else:
            per = config.global_batch // len(self.ranks)
            index = self.ranks.index(self.rank)
            mine = (x[index * per:(index + 1) * per], y[index * per:(index + 1) * per])
            weights = [per / config.global_batch]
            loss = lambda k, out, side: ((out - mine[1]) ** 2).mean()  # noqa: E731
            step = self.schedule.forward([mine], lambda mb: (mb[0], None), loss, weights, recompute=False)
            self.schedule.backward(step)
        with self.sharded.observers.compute("optimizer_step"), torch.no_grad():
            self.optimizer.step()
        self.optimizer.zero_grad()


def _on_rank(rank: int, world: int, config: Config) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator
    from cephalo_lightning.runtime.emulation.links import EmulatedLinks

    host_gbps = _measure_host_link(rank)
    link_gbps = host_gbps / config.link_ratio
    links = EmulatedLinks(NODES, link_gbps)
    emulator = DeviceEmulator.from_spec({"slowdown": config.slowdown, "node": NODES[rank]}, label=f"rank {rank}")
    plans = {name: _Plan(name, rank, config, links, emulator) for name in PLANS}
    steps: dict[str, list[float]] = {name: [] for name in PLANS}
    counter = 0
    for round_index in range(config.rounds):
        for name in common.rotated(PLANS, round_index):
            for i in range(config.steps + 1):
                x, y = _data(config, counter)
                counter += 1
                dist.barrier()
                start = time.perf_counter()
                plans[name].step(x, y)
                elapsed = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if i:  # the first step of each plan's turn warms it up
                    steps[name].append(elapsed.item())
    return {"host_gbps": host_gbps, "link_gbps": link_gbps, "steps": steps}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    config = QUICK if args.quick else Config()
    if args.link_ratio is not None:
        config = Config(**{**asdict(config), "link_ratio": args.link_ratio})
    if config.link_ratio < 10:
        raise SystemExit(f"--link-ratio {config.link_ratio}: the inter-node link must be at least 10x slower than the host's")
    before = common.load_average()
    results = common.run_ranks(_on_rank, WORLD, config)
    first = results[0]
    params = config.layers * (2 * 4 * config.hidden * config.hidden + 4 * config.hidden + 3 * config.hidden)
    rows = []
    for name in PLANS:
        step = common.median(first["steps"][name])
        rows.append({"plan": name, "step_s": step, "samples_per_s": config.global_batch / step})
    best = max((r for r in rows if r["plan"] not in PIPELINED), key=lambda r: r["samples_per_s"])
    pipeline = max((r for r in rows if r["plan"] in PIPELINED), key=lambda r: r["samples_per_s"])
    return {
        "config": asdict(config), "parameters": params, "host_gbps": first["host_gbps"], "link_gbps": first["link_gbps"],
        "rows": rows, "best_non_pipelined": best["plan"], "best_pipelined": pipeline["plan"], "ratio": pipeline["samples_per_s"] / best["samples_per_s"],
        "goal": GOAL, "predicted": None, "environment": common.environment_note(),
        "load": common.load_span(before),
    }


def print_report(result: dict[str, Any]) -> None:
    config = result["config"]
    print(f"Emulated on CPU: 2 nodes x 2 ranks, compute slowdown {config['slowdown']:g}; host link (MEASURED) "
          f"{result['host_gbps']:.3g} GB/s, inter-node link emulated at {result['link_gbps']:.3g} GB/s "
          f"({config['link_ratio']:g}x slower). Model: {config['layers']} MLP blocks of width {config['hidden']} "
          f"({result['parameters'] / 1e6:.1f}M parameters), global batch {config['global_batch']} x {config['tokens']} tokens.")
    common.print_table(["plan", "step (s)", "samples/s"],
                       [(r["plan"], f"{r['step_s']:.3f}", f"{r['samples_per_s']:.2f}") for r in result["rows"]],
                       title="MEASURED (emulated on CPU), median step over the rounds")
    verdict = "meets" if result["ratio"] >= result["goal"] else "MISSES"
    print(f"best pipelined ({result['best_pipelined']}) / best non-pipelined ({result['best_non_pipelined']}): "
          f"{result['ratio']:.2f}x "
          f"({verdict} the goal of {result['goal']:g}x)")
    print("predicted step: not available (the planner's pipeline cost is not wired into this benchmark)")
    print(common.load_note(*result["load"]))
    print(result["environment"])


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--link-ratio", type=float, default=None,
                        help="the inter-node link this many times slower than the host's measured link (>= 10; default 20)")


BENCHMARK = Benchmark(__doc__.splitlines()[0], measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
