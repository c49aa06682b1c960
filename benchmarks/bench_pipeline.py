"""Pipelined plan vs every non-pipelined one on an emulated 2-node cluster with a slow link between the nodes.

    python -m benchmarks.bench_pipeline              # 3 rounds of 3 measured steps per plan; minutes on 2 cores
    python -m benchmarks.bench_pipeline --quick      # a smaller model, 1 round of 2 steps (about a minute)
    python -m benchmarks.bench_pipeline --link-ratio 40  # the inter-node link 40x slower than the host's (default 20)
    python -m benchmarks.bench_pipeline --json -     # the result as JSON on stdout

THE CLUSTER IS EMULATED ON CPU: 4 gloo ranks on this machine stand for 2 nodes x 2 GPUs (ranks 0, 1 on
node 0; 2, 3 on node 1). Every rank's compute regions are stretched to ``slowdown`` x their compute on
the contention-free clock (:class:`~cephalo_lightning.runtime.emulation.emulator.DeviceEmulator`), what
a rank sends to the other node is held to an emulated link
(:class:`~cephalo_lightning.runtime.emulation.links.EmulatedLinks`) ``link_ratio`` times slower than the
host's own link between two ranks, MEASURED first (an all-reduce of 16 MiB between ranks 0 and 1) and
printed beside it, and every rank's memory is emulated at ``memory_fraction`` of the model's training
state (16 bytes a parameter), so that one node's two ranks cannot hold it (each would need half, HSDP
and DDP too) and the four ranks can: the lab case, where the fast node alone cannot train the model.
No GPU is involved.

The model is a stack of residual MLP blocks (``layers`` of width ``hidden``) on (batch, tokens, hidden)
inputs with a per-sample mean-squared error, run by the runtime directly (no Lightning). In one spawned
group of ranks:

1. profile: :func:`~cephalo_lightning.profiling.profile_cluster` on the emulated ranks (compute,
   memory, the links inside and between the emulated nodes) gives the planner's cluster;
2. plan: the planner's best pipelined plan (:mod:`cephalo_lightning.planner.search.pipeline`, the
   plan the planner would pick over the others when faster), its best shard grouping over the four
   ranks, its best plan of full shard, of HSDP (a group per node) and of DDP alone, and its best
   subset; each with its predicted step, or the planner's reason it is infeasible;
3. measure: every feasible plan run in rounds with the order rotated each round, over the same
   global batches: ``pipeline`` as the planner prices it (layer by layer: each layer gathered,
   recomputed and reduced per micro-batch; :class:`~cephalo_lightning.runtime.pipelining.runner.PipelineRunner`),
   ``pipeline-gathered`` the same plan with each stage gathered once a step (not priced), and
   ``node-alone`` (node 0's two ranks, full shard, past the emulated memory: the emulated capacity is
   not enforced here) for reference, never counted as a feasible plan.

Figures: MEASURED step = wall time of one optimizer step (forward, backward, reduction, optimizer),
max over the ranks, median over the measured steps of every round; samples/s = global batch / step;
busy = the busiest rank's seconds a step in compute regions (emulated stretch included), median.
PREDICTED step: the planner's, from the profile alone (before calibration), and by the cost model
calibrated (:func:`~cephalo_lightning.planner.cost.calibration_fit.fit_calibration`, as
``CephaloCallback`` calibrates) on the measured steps of the plans of ``CALIBRATE_ON`` alone (marked
fitted): for every other plan, the pipelined one first, a prediction of steps that never entered the
fit. The headline is the pipelined plan's throughput over the best feasible non-pipelined plan's
(goal >= 1.5), and each plan's predicted / measured step, before and after calibration.
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
PLANS = ("pipeline", "pipeline-gathered", "best-grouping", "full-shard", "hsdp", "ddp", "best-subset", "node-alone")
PIPELINED = ("pipeline", "pipeline-gathered")
GOAL = 1.5


@dataclass(frozen=True)
class Config:
    hidden: int = 512
    layers: int = 8
    tokens: int = 16
    global_batch: int = 32
    rounds: int = 3
    steps: int = 3  # measured steps per plan per round (one warm-up step before each)
    slowdown: float = 2.0
    link_ratio: float = 20.0
    memory_fraction: float = 0.65  # every rank's emulated memory, as a fraction of the model's training state
    profile_micro_batch: int = 4  # the profile's micro-batch sizes 1..k (the planner extrapolates beyond)
    profile_repeats: int = 3


QUICK = Config(hidden=384, tokens=8, rounds=1, steps=2, profile_repeats=2)


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


def _emulation(config: Config, link_gbps: float, memory_gb: float) -> list[dict[str, Any]]:
    return [{"slowdown": config.slowdown, "memory_gb": memory_gb, "node": n, "inter_node_gbps": link_gbps} for n in NODES]


def _state_memory_gb(config: Config) -> float:
    """Every rank's emulated memory: ``memory_fraction`` of the model's training state (16 bytes a
    parameter: weights, gradients, AdamW's two moments), so that one node's two ranks cannot hold the
    state (each would need half of it) and the four ranks can (a quarter each, plus activations)."""
    return config.memory_fraction * 16 * _parameters(config) / 2**30


def _parameters(config: Config) -> int:
    h = config.hidden
    return config.layers * (2 * 4 * h * h + 4 * h + 3 * h)


def _plans(cluster: Any, batch: int) -> dict[str, tuple[Any, str]]:
    """The planner's plans of the profiled ``cluster``: name -> (plan or None, why / what it is)."""
    from cephalo_lightning._common.vocabulary import Grouping
    from cephalo_lightning.planner.choice import best_subset, pipeline_text, pipelined_plan
    from cephalo_lightning.planner.cost.calibration import calibrated
    from cephalo_lightning.planner.planning import Problem, plan, solved_plan, without_fixed_terms
    from cephalo_lightning.planner.schema.planning_error import PlanningError
    from cephalo_lightning.planner.search.pipeline.pipeline_search import search_pipelines

    out: dict[str, tuple[Any, str]] = {}

    def attempt(name: str, make: Any, what: str) -> None:
        try:
            out[name] = (make(), what)
        except PlanningError as error:
            out[name] = (None, f"infeasible: {str(error).splitlines()[0][:160]}")

    base = plan(cluster, batch)
    found = search_pipelines(calibrated(cluster), batch)
    out["pipeline"] = ((pipelined_plan(cluster, found, base), pipeline_text(found, found.cross_node_bytes / 2**30))
                       if found is not None else (None, "infeasible: no pipeline layout fits"))
    out["pipeline-gathered"] = (out["pipeline"][0], "the same plan, each stage gathered once a step (not priced)")
    out["best-grouping"] = (base, "the planner's best shard grouping over the 4 ranks")
    attempt("full-shard", lambda: plan(cluster, batch, groupings=(Grouping.FULL,)), "one shard group of 4 ranks")
    attempt("hsdp", lambda: plan(cluster, batch, groupings=(Grouping.PER_NODE,)), "a shard group per node")
    attempt("ddp", lambda: plan(cluster, batch, groupings=(Grouping.PER_RANK,)), "a shard group per rank")

    def solve(over: Any) -> Any:
        from cephalo_lightning._common.vocabulary import Schedule
        return solved_plan(over, Problem(without_fixed_terms(over), batch, Schedule.LAYERED), tuple(Grouping),
                           baselines=False)

    sub, kept = best_subset(cluster, solve, batch, base.upper_bound_samples_per_s)
    out["best-subset"] = ((sub, f"ranks {list(kept)} alone, the others idle") if sub is not None
                          else (None, "infeasible: no subset of the ranks holds the state"))
    return out


class _Run:
    """One plan on this rank: ``step(x, y)`` runs one optimizer step (collective over its ranks).
    ``plan`` None: node 0's two ranks alone (full shard inside the node), run past the memory the
    planner prices (the emulated capacity is not enforced here), for reference."""

    def __init__(self, name: str, plan: Any, rank: int, config: Config, links: Any, emulator: Any) -> None:
        import torch
        import torch.distributed as dist

        from cephalo_lightning.runtime.layered import LayeredSchedule
        from cephalo_lightning.runtime.pipelining.runner import PipelineRunner
        from cephalo_lightning.runtime.pipelining.stages import PipelineLayout
        from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel
        from cephalo_lightning.runtime.timing import BusyTime

        self.name, self.rank, self.config = name, rank, config
        model = _model(config)
        self.runner = self.schedule = None
        self.active = True
        if plan is not None and plan.pipelined:
            self.layout = PipelineLayout.of(plan, config.layers)
            self.runner = PipelineRunner(model, list(model), self.layout, prepare=lambda mb: (mb[0], None),
                                         loss=lambda out, mb, side, total: ((out - mb[1]) ** 2).mean(dim=(1, 2)).sum() / total,
                                         items=lambda mb: len(mb[0]), links=links,
                                         layer_by_layer=name != "pipeline-gathered")
            self.runner.sharded.observers.attach(emulator)
            self.sharded = self.runner.sharded
            params = self.runner.parameters()
        else:
            if plan is None:  # node 0 alone, even shares
                groups, shares = [[0, 1]], {0: 0.5, 1: 0.5}
                batches = {0: config.global_batch // 2, 1: config.global_batch - config.global_batch // 2}
                micro, recompute = {0: 1, 1: 1}, {0: False, 1: False}
            else:
                groups = [list(g) for g in plan.shard_groups]
                shares = {r.rank: r.state_share for r in plan.active_ranks}
                batches = {r.rank: r.batch_size for r in plan.active_ranks}
                micro = {r.rank: max(r.num_micro_batches, 1) for r in plan.active_ranks}
                recompute = {r.rank: r.recompute for r in plan.active_ranks}
            ranks = sorted(r for g in groups for r in g)
            group = dist.new_group(ranks) if len(ranks) < WORLD else None  # collective: every rank
            self.active = rank in ranks
            if not self.active:
                return
            local = {r: i for i, r in enumerate(ranks)}
            offsets, start = {}, 0
            for r in ranks:
                offsets[r], start = start, start + batches[r]
            self.rows = (offsets[rank], offsets[rank] + batches[rank])
            self.micro, self.recompute = micro[rank], recompute[rank]
            self.sharded = ShardedModel(model, [shares[r] for r in ranks], units=list(model), group=group,
                                        shard_groups=[[local[r] for r in g] for g in groups], links=links, hooks=False)
            self.sharded.observers.attach(emulator)
            self.schedule = LayeredSchedule(self.sharded, list(model))
            params = list(self.sharded.parameters())
        self.optimizer = torch.optim.AdamW(params, lr=1e-3)
        self.busy = BusyTime()  # outside the emulator: its stretch counts, as the profile's figures do
        self.sharded.observers.attach(self.busy, outermost=True)

    def busy_now(self) -> tuple[float, float]:
        """This rank's seconds in compute regions so far: contention-free and on the wall clock."""
        return (self.busy.seconds, self.busy.wall_seconds) if self.active else (0.0, 0.0)

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
            a, b = self.rows
            mine = (x[a:b], y[a:b])
            count = min(self.micro, max(b - a, 1))
            sizes = [(b - a) // count + (1 if k < (b - a) % count else 0) for k in range(count)]
            parts = micro_batches(mine, sizes)
            weights = [len(p[0]) / config.global_batch for p in parts]
            loss = lambda k, out, side: ((out - parts[k][1]) ** 2).mean()  # noqa: E731
            step = self.schedule.forward(parts, lambda mb: (mb[0], None), loss, weights, recompute=self.recompute)
            self.schedule.backward(step)
        with self.sharded.observers.compute("optimizer_step"), torch.no_grad():
            self.optimizer.step()
        self.optimizer.zero_grad()


def _profile(rank: int, config: Config, specs: list[dict[str, Any]]) -> Any:
    """The planner's cluster, profiled on these ranks as the emulation makes them (every rank calls it)."""
    import torch

    from cephalo_lightning.profiling import ModelDescription, ProfileOptions, profile_cluster

    model = _model(config)
    sample = torch.randn(config.profile_micro_batch, config.tokens, config.hidden, generator=torch.Generator().manual_seed(7))
    options = ProfileOptions(max_micro_batch=config.profile_micro_batch, warmup=1, repeats=config.profile_repeats,
                             collective_repeats=config.profile_repeats)
    return profile_cluster(list(model), sample, ModelDescription(name=f"{config.layers} MLP blocks x {config.hidden}",
                                                               hidden_size=config.hidden, seq_len=config.tokens),
                           emulate=specs, options=options, quiet=True)


def _on_rank(rank: int, world: int, config: Config) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator
    from cephalo_lightning.runtime.emulation.links import EmulatedLinks

    host_gbps = _measure_host_link(rank)
    link_gbps = host_gbps / config.link_ratio
    memory_gb = _state_memory_gb(config)
    specs = _emulation(config, link_gbps, memory_gb)
    cluster = _profile(rank, config, specs)
    planned = _plans(cluster, config.global_batch)
    links = EmulatedLinks(NODES, link_gbps)
    emulator = DeviceEmulator.from_spec({"slowdown": config.slowdown, "node": NODES[rank]}, label=f"rank {rank}")
    names = [n for n in PLANS if n == "node-alone" or planned[n][0] is not None]
    runs = {n: _Run(n, None if n == "node-alone" else planned[n][0], rank, config, links, emulator) for n in names}
    steps: dict[str, list[float]] = {name: [] for name in names}
    busy: dict[str, list[list[list[float]]]] = {name: [] for name in names}  # per step: every rank's (busy, busy wall)
    counter = 0
    for round_index in range(config.rounds):
        for name in common.rotated(names, round_index):
            for i in range(config.steps + 1):
                x, y = _data(config, counter)
                counter += 1
                dist.barrier()
                before = runs[name].busy_now()
                start = time.perf_counter()
                runs[name].step(x, y)
                elapsed = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                spent = torch.tensor([a - b for a, b in zip(runs[name].busy_now(), before)], dtype=torch.float64)
                every = [torch.zeros_like(spent) for _ in range(WORLD)]
                dist.all_gather(every, spent)
                if i:  # the first step of each plan's turn warms it up
                    steps[name].append(elapsed.item())
                    busy[name].append([t.tolist() for t in every])
    priced = lambda n, p: p is not None and n != "pipeline-gathered"  # noqa: E731 - the planner prices layer by layer
    after = _calibrated_predictions(cluster, planned, steps, busy) if rank == 0 else {}
    plans = {n: {"what": what, "predicted_s": p.predicted_step_s if priced(n, p) else None,
                 "predicted_busy_s": max(_predicted_busy(cluster, p)) if priced(n, p) else None,
                 "calibrated_s": after.get(n) if priced(n, p) else None,
                 "predicted_memory_gb": None if p is None else max((r.predicted_memory_gb or 0.0) for r in p.ranks)}
             for n, (p, what) in planned.items()}
    measured_busy = {n: common.median([max(b for b, _ in step) for step in busy[n]]) for n in names if busy[n]}
    return {"host_gbps": host_gbps, "link_gbps": link_gbps, "memory_gb": memory_gb, "steps": steps, "plans": plans,
            "busy_s": measured_busy, "fitted_on": CALIBRATE_ON}


CALIBRATE_ON = ("best-grouping", "full-shard")  # plans without pipelines whose measured steps calibrate the cost model


def _predicted_busy(cluster: Any, plan: Any) -> list[float]:
    """Every rank's predicted seconds in compute regions per step under ``plan``."""
    from cephalo_lightning.planner.cost.calibration_fit import predicted
    from cephalo_lightning.planner.cost.pipeline_cost import busy_s

    return busy_s(cluster, plan) if plan.pipelined else predicted(cluster, plan)[1]


def _calibrated_predictions(cluster: Any, planned: dict[str, tuple[Any, str]], steps: dict[str, list[float]],
                            busy: dict[str, list[list[list[float]]]]) -> dict[str, float]:
    """Every plan's step predicted by the cost model calibrated (as ``CephaloCallback`` calibrates) on the
    measured steps of the plans of ``CALIBRATE_ON`` alone: for the others, the pipelined plan first, a
    prediction of a plan no measured step of which entered the fit."""
    from cephalo_lightning.planner.cost.calibration import calibrated, with_calibration
    from cephalo_lightning.planner.cost.calibration_fit import StepObservation, fit_calibration, predicted
    from cephalo_lightning.planner.cost.pipeline_cost import PipelineCost, PipelineShape

    observations = [StepObservation(planned[n][0], wall, tuple(b for b, _ in ranks), tuple(w for _, w in ranks))
                    for n in CALIBRATE_ON if planned.get(n, (None,))[0] is not None and n in steps
                    for wall, ranks in zip(steps[n], busy[n])]
    if not observations:
        return {}
    model = with_calibration(cluster, fit_calibration(cluster, observations, fitted_on="bench_pipeline"))
    out = {}
    for name, (plan, _) in planned.items():
        if plan is None:
            continue
        if plan.pipelined:
            chains = plan.pipelines
            shape = PipelineShape(chains, tuple(plan.ranks[c[0]].batch_size for c in chains),
                                  plan.ranks[chains[0][0]].num_micro_batches)
            cost = PipelineCost(calibrated(model), shape, plan.pipeline_schedule)
            out[name] = cost.step_ms([cost.stage(s, layers) for s, layers in enumerate(plan.stage_layers)]) / 1e3
        else:
            out[name] = predicted(model, plan)[0]
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    config = QUICK if args.quick else Config()
    if args.link_ratio is not None:
        config = Config(**{**asdict(config), "link_ratio": args.link_ratio})
    if config.link_ratio < 10:
        raise SystemExit(f"--link-ratio {config.link_ratio}: the inter-node link must be at least 10x slower than the host's")
    before = common.load_average()
    results = common.run_ranks(_on_rank, WORLD, config)
    first = results[0]
    rows = []
    for name in PLANS:
        info = first["plans"].get(name, {"what": "node 0's two ranks, full shard (over the emulated memory: "
                                                 "the planner prices it out; run for reference)",
                                         "predicted_s": None, "predicted_memory_gb": None,
                                         "predicted_busy_s": None, "calibrated_s": None})
        measured = first["steps"].get(name)
        step = common.median(measured) if measured else None
        feasible = name != "node-alone" and name in first["steps"]
        rows.append({"plan": name, "what": info["what"], "feasible": feasible, "step_s": step,
                     "samples_per_s": None if step is None else config.global_batch / step,
                     "predicted_s": info["predicted_s"], "predicted_memory_gb": info["predicted_memory_gb"],
                     "predicted_over_measured": None if step is None or info["predicted_s"] is None
                     else info["predicted_s"] / step,
                     "calibrated_s": info["calibrated_s"],
                     "calibrated_over_measured": None if step is None or info["calibrated_s"] is None
                     else info["calibrated_s"] / step,
                     "fitted": name in first["fitted_on"],
                     "busy_s": first["busy_s"].get(name), "predicted_busy_s": info["predicted_busy_s"]})
    measured_rows = [r for r in rows if r["step_s"] is not None]
    best = max((r for r in measured_rows if r["plan"] not in PIPELINED and r["feasible"]), key=lambda r: r["samples_per_s"])
    pipeline = next((r for r in measured_rows if r["plan"] == "pipeline"), None)
    anyway = max((r for r in measured_rows if r["plan"] not in PIPELINED), key=lambda r: r["samples_per_s"])
    return {
        "config": asdict(config), "parameters": _parameters(config), "host_gbps": first["host_gbps"],
        "link_gbps": first["link_gbps"], "memory_gb": first["memory_gb"], "rows": rows,
        "best_non_pipelined": best["plan"],
        "ratio": None if pipeline is None else pipeline["samples_per_s"] / best["samples_per_s"],
        "ratio_any": None if pipeline is None else pipeline["samples_per_s"] / anyway["samples_per_s"],
        "fastest_non_pipelined_any": anyway["plan"],
        "goal": GOAL, "environment": common.environment_note(),
        "load": common.load_span(before),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_report(result: dict[str, Any]) -> None:
    config = result["config"]
    print(f"Emulated on CPU: 2 nodes x 2 ranks, compute slowdown {config['slowdown']:g}; host link (MEASURED) "
          f"{result['host_gbps']:.3g} GB/s, inter-node link emulated at {result['link_gbps']:.3g} GB/s "
          f"({config['link_ratio']:g}x slower). Model: {config['layers']} MLP blocks of width {config['hidden']} "
          f"({result['parameters'] / 1e6:.1f}M parameters, {16 * result['parameters'] / 2**20:.0f} MiB of training "
          f"state), global batch {config['global_batch']} x {config['tokens']} tokens. Every rank's emulated memory: "
          f"{result['memory_gb'] * 1024:.0f} MiB ({config['memory_fraction']:g} of the state: one node cannot hold it).")
    common.print_table(
        ["plan", "step (s)", "samples/s", "predicted (s)", "pred/meas", "calibrated pred/meas", "busy (s)",
         "pred busy (s)", "plan"],
        [(r["plan"], _fmt(r["step_s"], ".3f"), _fmt(r["samples_per_s"], ".2f"), _fmt(r["predicted_s"], ".3f"),
          _fmt(r["predicted_over_measured"], ".2f"),
          _fmt(r["calibrated_over_measured"], ".2f") + (" (fitted)" if r["fitted"] and r["calibrated_s"] else ""),
          _fmt(r["busy_s"], ".3f"), _fmt(r["predicted_busy_s"], ".3f"), r["what"]) for r in result["rows"]],
        title="MEASURED (emulated on CPU), median step over the rounds; PREDICTED by the planner from the profile "
              "(pred/meas), and by the cost model calibrated on the steps of the plans marked fitted; busy: the "
              "busiest rank's seconds in compute regions a step, measured and predicted")
    if result["ratio"] is None:
        print("the planner found no pipelined plan that fits: nothing to compare")
    else:
        verdict = "meets" if result["ratio"] >= result["goal"] else "MISSES"
        print(f"pipelined plan (as the planner priced it: layer by layer) / best feasible non-pipelined "
              f"({result['best_non_pipelined']}): {result['ratio']:.2f}x ({verdict} the goal of {result['goal']:g}x)")
        print(f"... / the fastest non-pipelined plan measured, feasible or not ({result['fastest_non_pipelined_any']}): "
              f"{result['ratio_any']:.2f}x")
    ratios = [r["predicted_over_measured"] for r in result["rows"] if r["predicted_over_measured"] is not None]
    if ratios:
        print(f"predicted / measured step: {min(ratios):.2f} to {max(ratios):.2f} over the plans priced (before calibration)")
    unfitted = [r["calibrated_over_measured"] for r in result["rows"]
                if r["calibrated_over_measured"] is not None and not r["fitted"]]
    if unfitted:
        print(f"calibrated on {', '.join(r['plan'] for r in result['rows'] if r['fitted'] and r['calibrated_s'])}: "
              f"predicted / measured step of the plans not fitted {min(unfitted):.2f} to {max(unfitted):.2f}")
    print(common.load_note(*result["load"]))
    print(result["environment"])


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--link-ratio", type=float, default=None,
                        help="the inter-node link this many times slower than the host's measured link (>= 10; default 20)")


BENCHMARK = Benchmark(__doc__.splitlines()[0], measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
