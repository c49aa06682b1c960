"""Layered gradient accumulation benchmark: memory vs micro-batch count, cost model vs schedule.

    python -m benchmarks.bench_layered            # a few minutes
    python -m benchmarks.bench_layered --quick    # fewer configurations and rounds; under a minute
    python -m benchmarks.bench_layered --json -   # the result as JSON on stdout (--json PATH: to a file)

Two measurements on 2 gloo ranks (CPU processes, NOT GPUs; every figure is a CPU measurement):

1. peak accounted memory of one step at a FIXED micro-batch size as the number of micro-batches n
   grows (1, 2, 4, 8): the layered schedule (``offload=True``: on CPU this emulates host offload,
   the stash is accounted as host memory and reported apart) vs micro-batch-major accumulation
   (``ShardedModel`` hooks, unsharded gradients kept until the last micro-batch);
2. the planner's ``layered`` cost model vs the schedule: one layer's forward / backward profiled at
   micro-batch sizes 1..k on each rank (rank 1 is an EMULATED slower device), a planner ``Cluster``
   built from those figures, then layered steps at different (b_i, n_i) per rank: predicted step
   time per rank (``DeviceCost.step_s``) vs measured, and the ratio.

``run_benchmark()`` returns the rows as data (for report scripts); ``main()`` prints the tables.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from benchmarks import _common as common
from benchmarks.harness import Benchmark, comma_list

WORLD = 2
PARTS = ("memory", "cost", "unitwise")


@dataclass(frozen=True)
class Config:
    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    shares: tuple[float, ...] = (0.5, 0.5)
    # 1. memory
    memory_micro_batches: tuple[int, ...] = (4, 16)
    memory_counts: tuple[int, ...] = (1, 2, 4, 8)
    # 2. cost model vs schedule
    slowdown: tuple[float, ...] = (1.0, 2.5)  # per rank; rank 1 emulates a 2.5x slower device
    profile_sizes: int = 8  # micro-batch sizes 1..k
    comm_rounds: int = 8
    calibration_micro_batch: int = 2
    calibration_counts: tuple[int, ...] = (1, 2, 4, 6)
    calibration_rounds: int = 6
    # (batch, micro-batches) per rank; a last configuration is what plan() picks for plan_global_batch
    step_configs: tuple[tuple[tuple[int, int], ...], ...] = (
        ((4, 1), (4, 1)), ((8, 2), (4, 2)), ((8, 4), (2, 1)), ((12, 6), (4, 4)), ((6, 6), (6, 3)),
    )
    plan_global_batch: int = 12
    step_rounds: int = 7


QUICK = Config(memory_micro_batches=(4,), profile_sizes=4, plan_global_batch=8, comm_rounds=3,
               calibration_counts=(1, 4), calibration_rounds=3,
               step_configs=(((4, 1), (4, 1)), ((8, 4), (2, 1)), ((12, 6), (4, 4))), step_rounds=3)


def gpt_config(cfg: Config):
    from cephalo_lightning.demo.gpt import GPTConfig

    return GPTConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, n_layer=cfg.n_layer, n_head=cfg.n_head,
                     n_embd=cfg.n_embd)


def _tokens(cfg: Config, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return data[:, :-1], data[:, 1:]


def _micro_batches(x: torch.Tensor, y: torch.Tensor, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    from cephalo_lightning.planner.schema.plan import split_sizes

    xs, ys, start = [], [], 0
    for size in split_sizes(x.size(0), n):
        xs.append(x[start : start + size])
        ys.append(y[start : start + size])
        start += size
    return xs, ys


def _build(cfg: Config, observers=(), record: bool = False):
    from cephalo_lightning.demo.gpt import GPT
    from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

    torch.manual_seed(0)
    model = GPT(gpt_config(cfg))
    layers = model.layers()
    sharded = ShardedModel(model, list(cfg.shares), units=layers, record_collectives=record)
    for observer in observers:  # the rank's emulator, then the busy clock around it
        sharded.observers.attach(observer, outermost=type(observer).__name__ == "BusyTime")
    return model, layers, sharded


def _clear_grads(sharded) -> None:
    for p in sharded.parameters():
        p.grad = None


# ----------------------------------------------------------------------------- 1. memory vs n


def _memory(rank: int, world: int, cfg: Config) -> list[dict[str, Any]]:
    from cephalo_lightning.demo.gpt import GPT
    from cephalo_lightning.runtime.emulation.memory import MemoryTracker
    from cephalo_lightning.runtime.layered import LayeredSchedule, plain_input

    rows = []
    for m, method in [(m, method) for m in cfg.memory_micro_batches for method in ("layered", "micro-batch-major")]:
        model, layers, sharded = _build(cfg, record=True)
        schedule = LayeredSchedule(sharded, layers, offload=True) if method == "layered" else None
        resident = 12 * sharded.local_state_numel()  # fp32 masters + 2 AdamW moments (grads are made in the step)
        largest_layer = max(u.layout.numel for u in sharded.units)
        for n in cfg.memory_counts:
            x, y = _tokens(cfg, n * m, seed=10 * rank + n)
            xs, ys = _micro_batches(x, y, n)
            for attempt in range(2):  # the second step is measured (nothing left over from a first call)
                _clear_grads(sharded)
                gc.collect()
                before = len(sharded.comm.log)
                tracker = MemoryTracker()
                with sharded.observers.attached(tracker), tracker:
                    if schedule is not None:
                        forward_pass = schedule.forward(xs, plain_input, lambda k, out, side: GPT.loss(out, ys[k]), [1.0 / n] * n)
                        schedule.backward(forward_pass)
                    else:
                        for k in range(n):
                            sharded.set_requires_gradient_sync(k == n - 1)
                            sharded.backward(GPT.loss(model(xs[k]), ys[k]) / n)
                log = sharded.comm.log[before:]
            rows.append({
                "rank": rank, "method": method, "micro_batches": n, "micro_batch_size": m,
                "peak_bytes": tracker.peak_bytes, "peak_host_bytes": tracker.peak_host_bytes,
                "resident_state_bytes": resident, "largest_layer_grad_bytes": 4 * largest_layer,
                "all_gathers": sum(op == "all_gather" for op, _, _ in log),
                "reduce_scatters": sum(op == "reduce_scatter" for op, _, _ in log),
            })
        del model, layers, sharded, schedule
        gc.collect()
    return rows


def memory_rows(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for rank_rows in per_rank:
        base = {(r["method"], r["micro_batch_size"]): r for r in rank_rows if r["micro_batches"] == 1}
        two = {(r["method"], r["micro_batch_size"]): r for r in rank_rows if r["micro_batches"] == 2}
        for r in rank_rows:
            key = (r["method"], r["micro_batch_size"])
            b = base[key]
            rows.append({
                **r,
                "peak_over_n1": r["peak_bytes"] / b["peak_bytes"],
                "peak_over_n2": r["peak_bytes"] / two[key]["peak_bytes"] if key in two else None,
                "peak_with_state_over_n1": (r["peak_bytes"] + r["resident_state_bytes"])
                / (b["peak_bytes"] + b["resident_state_bytes"]),
            })
    return rows


# ----------------------------------------------------------------------------- 2. cost model vs schedule


class BusyClock:
    """This rank's busy time: a :class:`~cephalo_lightning.runtime.timing.BusyTime` observer
    attached outside the rank's emulator (its waits count), and the emulator to time layers under."""

    def __init__(self, emulator) -> None:
        from cephalo_lightning.runtime.timing import BusyTime

        self.emulator = emulator
        self.busy = BusyTime()

    @property
    def busy_s(self) -> float:
        return self.busy.seconds

    def begin_compute(self) -> None:
        self.busy.compute_begin("profile")
        self.emulator.compute_begin("profile")

    def end_compute(self) -> None:
        self.emulator.compute_end("profile")
        self.busy.compute_end("profile")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.emulator, name)


class LayerProfiler:
    """One layer's F(m) and F+B(m) (ms, per average layer) at sizes m, timed as the schedule runs a layer.

    F: forward without autograd (the layered forward); F+B: forward with autograd (the recompute)
    plus its backward (the last layer's includes the loss, as in the schedule). Every region is
    bracketed by the rank's emulator, so an emulated device is profiled at its emulated speed.
    :meth:`run_once` adds one timing of every (layer, m); it gathers the layers (a collective), so
    every rank calls it at the same point, which lets it be interleaved with the measured steps.
    """

    def __init__(self, cfg: Config, sizes: list[int], model, layers, sharded, clock: BusyClock, rank: int) -> None:
        self.sizes, self.layers, self.sharded, self.clock = sizes, layers, sharded, clock
        x_all, self.y = _tokens(cfg, max(sizes), seed=777 + rank)
        self.inputs: dict[int, list[torch.Tensor]] = {}
        with sharded.scheduled(), sharded.summon_full_params(), torch.no_grad():
            for m in sizes:
                h, chain = x_all[:m], []
                for layer in layers:
                    chain.append(h)
                    h = layer(h)
                self.inputs[m] = chain
        self.grads = {m: [torch.randn_like(t) for t in chain[1:]] for m, chain in self.inputs.items()}
        self.fwd: dict[tuple[int, int], list[float]] = {(i, m): [] for i in range(len(layers)) for m in sizes}
        self.fb: dict[tuple[int, int], list[float]] = {(i, m): [] for i in range(len(layers)) for m in sizes}

    def _timed(self, fn) -> float:
        # Start every region together on all ranks, as the schedule does (each layer's all-gather
        # syncs them): on a CPU "cluster" the ranks share cores, so a profile taken out of phase
        # would see less contention than the steps it is meant to price.
        common.barrier()
        start = time.perf_counter()
        self.clock.begin_compute()
        fn()
        self.clock.end_compute()
        return time.perf_counter() - start

    def run_once(self) -> None:
        from cephalo_lightning.demo.gpt import GPT

        with self.sharded.scheduled(), self.sharded.summon_full_params():
            for i, layer in enumerate(self.layers):
                last = i == len(self.layers) - 1
                for m in self.sizes:
                    x = self.inputs[m][i]

                    def forward(layer=layer, x=x) -> None:
                        with torch.no_grad():
                            layer(x)

                    def forward_backward(layer=layer, x=x, i=i, m=m, last=last) -> None:
                        with torch.enable_grad():
                            xin = x.detach().requires_grad_(True) if x.is_floating_point() else x
                            out = layer(xin)
                            if last:
                                GPT.loss(out, self.y[:m]).backward()
                            else:
                                out.backward(self.grads[m][i])
                        for p in layer.parameters():
                            p.grad = None

                    self.fwd[(i, m)].append(self._timed(forward))
                    self.fb[(i, m)].append(self._timed(forward_backward))

    def medians(self, skip: int = 0) -> dict[str, list[float]]:
        """Per average layer (sum over the layers / L), in ms, for every size; ``skip`` warm-up runs."""
        num = len(self.layers)

        def per_layer(series: dict[tuple[int, int], list[float]], m: int) -> float:
            return 1e3 * sum(common.median(series[(i, m)][skip:]) for i in range(num)) / num

        return {"fwd_ms": [per_layer(self.fwd, m) for m in self.sizes],
                "fwd_bwd_ms": [per_layer(self.fb, m) for m in self.sizes]}


def _time_collectives(cfg: Config, sharded) -> tuple[float, float]:
    """Per-average-layer all-gather and reduce-scatter ms, as the runtime issues them (even shares)."""
    units = sharded.units[1:]

    def gather_all() -> None:
        for unit in units:
            unit.gather(sharded.comm)
            unit.free()

    zeros = [torch.zeros(u.layout.numel) for u in units]

    def reduce_all() -> None:
        for unit, z in zip(units, zeros):
            sharded.comm.reduce_scatter(z, unit.layout)

    times = common.interleaved_times({"ag": gather_all, "rs": reduce_all}, repeats=cfg.comm_rounds, warmup=1)
    return (1e3 * common.median(common.max_over_ranks(times["ag"])) / len(units),
            1e3 * common.median(common.max_over_ranks(times["rs"])) / len(units))


class StepRunner:
    """One layered step (forward + backward, no optimizer) at a fixed (batch, micro-batches) on this rank;
    records the rank's busy time (compute regions) and its own forward+backward wall time."""

    def __init__(self, cfg: Config, sharded, schedule, clock: BusyClock, rank: int, batch: int, n: int,
                 global_batch: int) -> None:
        self.sharded, self.schedule, self.clock = sharded, schedule, clock
        x, y = _tokens(cfg, batch, seed=31 * rank + batch + n)
        self.xs, self.ys = _micro_batches(x, y, n)
        self.weights = [t.size(0) / global_batch for t in self.xs]
        self.busy: list[float] = []
        self.wall: list[float] = []

    def __call__(self) -> None:
        from cephalo_lightning.demo.gpt import GPT
        from cephalo_lightning.runtime.layered import plain_input

        busy0, start = self.clock.busy_s, time.perf_counter()
        forward_pass = self.schedule.forward(self.xs, plain_input, lambda k, out, side: GPT.loss(out, self.ys[k]), self.weights)
        self.schedule.backward(forward_pass)
        self.wall.append(time.perf_counter() - start)
        self.busy.append(self.clock.busy_s - busy0)
        _clear_grads(self.sharded)


def _cost_model(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    from cephalo_lightning.planner import plan as make_plan
    from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator
    from cephalo_lightning.runtime.layered import LayeredSchedule

    emulator = DeviceEmulator(slowdown=cfg.slowdown[rank], emulated=cfg.slowdown[rank] > 1, label=f"rank {rank}")
    clock = BusyClock(emulator)
    model, layers, sharded = _build(cfg, observers=(emulator, clock.busy))
    schedule = LayeredSchedule(sharded, layers, offload=False)
    out: dict[str, Any] = {"rank": rank, "emulator": emulator.describe(), "num_layers": len(layers),
                           "parameters": sum(u.layout.numel for u in sharded.units)}

    # a) the collectives of one layer, as the runtime issues them
    out["allgather_ms"], out["reduce_scatter_ms"] = _time_collectives(cfg, sharded)

    # b) the per-micro-batch overhead c: busy(n) at a fixed micro-batch size m, interleaved with a
    #    profile of F(m), F+B(m), under the same emulation as the measured steps (on a shared CPU the
    #    ranks' contention depends on it)
    m = cfg.calibration_micro_batch
    cal_profile = LayerProfiler(cfg, [m], model, layers, sharded, clock, rank)
    runners = {n: StepRunner(cfg, sharded, schedule, clock, rank, n * m, n, world * n * m)
               for n in cfg.calibration_counts}
    common.interleaved_times({"profile": cal_profile.run_once, **runners}, repeats=cfg.calibration_rounds, warmup=1)
    num = len(layers)
    out["calibration"] = {
        # per round (the warm-up dropped): busy seconds of a step at each n, and the profiled F + (F + B) at m
        "busy_s": {n: r.busy[1:] for n, r in runners.items()},
        "profile_ms": [1e3 * sum(cal_profile.fwd[(i, m)][r] + cal_profile.fb[(i, m)][r] for i in range(num)) / num
                       for r in range(1, len(cal_profile.fwd[(0, m)]))],
        "slowdown": emulator.slowdown,
    }

    # c) a first profile at this rank's (emulated) speed, to ask the planner for its assignment
    sizes = list(range(1, cfg.profile_sizes + 1))
    profiler = LayerProfiler(cfg, sizes, model, layers, sharded, clock, rank)
    for _ in range(2):
        profiler.run_once()
    figures: list[Any] = [None] * world
    torch.distributed.all_gather_object(figures, {**out, "profile": profiler.medians(skip=1)})
    configs = [tuple(c) for c in cfg.step_configs]
    out["plan"] = None
    try:
        chosen = make_plan(build_cluster(cfg, figures), cfg.plan_global_batch, mode="layered")
        configs.append(tuple((r.batch_size, r.num_micro_batches) for r in chosen.ranks))
        out["plan"] = {"shares": chosen.state_shares, "global_batch": cfg.plan_global_batch}
    except Exception as err:  # noqa: BLE001 - report it, do not fail the benchmark
        out["plan_error"] = repr(err)
    out["configs"] = configs

    # d) the measured steps, interleaved with the profile that prices them (so drift hits both)
    profiler = LayerProfiler(cfg, sizes, model, layers, sharded, clock, rank)
    runners = {i: StepRunner(cfg, sharded, schedule, clock, rank, per[rank][0], per[rank][1],
                             sum(b for b, _ in per)) for i, per in enumerate(configs)}
    walls = common.interleaved_times({"profile": profiler.run_once, **runners}, repeats=cfg.step_rounds, warmup=1)
    out["profile"] = profiler.medians(skip=1)
    out["measured"] = [{"busy_s": common.median(r.busy[1:]), "rank_wall_s": common.median(r.wall[1:]),
                        "step_wall_s": common.median(common.max_over_ranks(walls[i]))}
                       for i, r in runners.items()]
    return out


def calibrated_overhead_ms(figures: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]]]:
    """c from busy(n) at a fixed micro-batch size m.

    The model says busy(n) / L = n * (F + (F + B) + c) - c, so per round
    c = (least-squares slope of busy over n) / L - (F + (F + B)), with F and F + B profiled in the same
    round (the rounds alternate profile and steps, so machine noise hits both). A rank's c is the
    median over the rounds, divided by its emulated slowdown (the emulator stretches the overhead
    too; a real device's launch overhead does not scale with its speed). The planner's c is the mean
    over the ranks, clamped at 0 (it takes no negative overhead); the raw value is reported.
    """
    details = []
    for f in figures:
        busy = {int(n): v for n, v in f["calibration"]["busy_s"].items()}
        ns = sorted(busy)
        mean_n = sum(ns) / len(ns)
        per_round, slopes = [], []
        for r, profiled in enumerate(f["calibration"]["profile_ms"]):
            ts = [busy[n][r] for n in ns]
            mean_t = sum(ts) / len(ts)
            slope = sum((n - mean_n) * (t - mean_t) for n, t in zip(ns, ts)) / sum((n - mean_n) ** 2 for n in ns)
            slopes.append(1e3 * slope / f["num_layers"])
            per_round.append(slopes[-1] - profiled)
        slowdown = f["calibration"]["slowdown"]
        details.append({"rank": f["rank"], "slowdown": slowdown, "per_micro_batch_layer_ms": common.median(slopes),
                        "profiled_2F_plus_B_ms": common.median(f["calibration"]["profile_ms"]),
                        "c_ms": common.median(per_round) / slowdown, "c_ms_per_round": per_round})
    raw = sum(d["c_ms"] for d in details) / len(details)
    return max(0.0, raw), details


def build_cluster(cfg: Config, figures: list[dict[str, Any]]):
    """A planner cluster from the ranks' measured figures (memory: large, so nothing binds)."""
    from cephalo_lightning.planner import Cluster, DeviceProfile, Emulation, ModelSpec, Settings

    c_ms, _ = calibrated_overhead_ms(figures)
    devices = []
    for f, slowdown in zip(figures, cfg.slowdown):
        fwd = f["profile"]["fwd_ms"]
        bwd = [max(fb - fw, 1e-3) for fw, fb in zip(fwd, f["profile"]["fwd_bwd_ms"])]
        emulated = slowdown > 1
        devices.append(DeviceProfile(
            name=f"cpu rank {f['rank']}" + (f" (emulated x{slowdown:g})" if emulated else ""),
            memory_gb=1000.0, layer_fwd_ms=tuple(fwd), layer_bwd_ms=tuple(bwd),
            compute_memory_gb=tuple(0.0 for _ in fwd), source="emulated" if emulated else "measured",
            emulate=Emulation(slowdown) if emulated else None,
        ))
    settings = Settings(usable_memory_fraction=1.0, reserved_memory_gb=0.0, micro_batch_overhead_ms=c_ms,
                        allgather_ms=max(f["allgather_ms"] for f in figures),
                        reduce_scatter_ms=max(f["reduce_scatter_ms"] for f in figures), collective="padded")
    model = ModelSpec(name="gpt-bench", num_layers=figures[0]["num_layers"], parameters=figures[0]["parameters"])
    return Cluster(model=model, devices=tuple(devices), settings=settings)


def cost_rows(cfg: Config, figures: list[dict[str, Any]]) -> dict[str, Any]:
    from cephalo_lightning.planner.cost.collective_prices import communication
    from cephalo_lightning.planner.cost.device_cost import DeviceCost
    from cephalo_lightning.planner.cost.prices import Prices

    cluster = build_cluster(cfg, figures)
    c_ms, calibration = calibrated_overhead_ms(figures)
    comm = communication(cluster)
    rho = max(cfg.shares)
    ag, rs = comm.allgather(rho), comm.reduce_scatter(rho)
    L = cluster.model.num_layers
    costs = [DeviceCost(d, cluster) for d in cluster.devices]
    configs = figures[0]["configs"]
    has_plan = figures[0]["plan"] is not None
    rows = []
    for i, per in enumerate(configs):
        predicted = [c.step_s(b, n, Prices(ag, rs)) for c, (b, n) in zip(costs, per)]
        # the same model with the collectives NOT overlapped with compute (what gloo on CPU does)
        serial = [L * (sum(c.compute_ms(b, n)) + 2 * ag + rs) / 1e3 for c, (b, n) in zip(costs, per)]
        label = "plan()" if has_plan and i == len(configs) - 1 else f"config {i + 1}"
        for rank, ((b, n), f) in enumerate(zip(per, figures)):
            measured = f["measured"][i]
            rows.append({
                "config": label, "rank": rank, "batch": b, "micro_batches": n,
                "micro_batch_size": -(-b // n) if n else 0,
                "predicted_s": predicted[rank], "measured_busy_s": measured["busy_s"],
                "busy_over_predicted": measured["busy_s"] / predicted[rank],
                "measured_rank_wall_s": measured["rank_wall_s"],
                "predicted_step_s": max(predicted), "predicted_serial_step_s": max(serial),
                "measured_step_s": measured["step_wall_s"],
                "step_over_predicted": measured["step_wall_s"] / max(predicted),
                "step_over_serial": measured["step_wall_s"] / max(serial),
            })
    devices = [{"rank": f["rank"], "device": d.name, "emulator": f["emulator"],
                "fwd_ms": list(d.layer_fwd_ms), "bwd_ms": list(d.layer_bwd_ms)}
               for f, d in zip(figures, cluster.devices)]
    # the plan's assignment was chosen from a first, short profile; its row is priced with the final one
    plan_info = {**figures[0]["plan"], "assignment": list(configs[-1])} if has_plan else None
    return {"rows": rows, "devices": devices, "calibration": calibration, "micro_batch_overhead_ms": c_ms,
            "allgather_ms": ag, "reduce_scatter_ms": rs, "num_layers": L, "plan": plan_info,
            "plan_error": figures[0].get("plan_error")}


# ----------------------------------------------------------------------------- 3. optimizer step per unit


def _unit_wise(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    """Peak accounted memory of 2 steps with the optimizer stepped at the end vs unit by unit."""
    from cephalo_lightning.runtime.emulation.memory import MemoryTracker
    from cephalo_lightning.runtime.layered import LayeredSchedule, plain_input
    from scenarios.unit_optimizers import UnitOptimizers

    peaks = {}
    for unit_wise in (False, True):
        model, layers, sharded = _build(cfg)
        make = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731 - one line is clearest
        per_unit = UnitOptimizers(sharded, make) if unit_wise else None
        schedule = LayeredSchedule(sharded, layers, offload=True,
                                   on_unit_reduced=per_unit.step_unit if per_unit else None)
        optimizer = None if unit_wise else make(list(sharded.parameters()))
        m = cfg.memory_micro_batches[0]
        x, y = _tokens(cfg, 2 * m, seed=rank)
        xs, ys = _micro_batches(x, y, 2)
        tracker = MemoryTracker(baseline_bytes=sharded.local_state_numel() * 4)
        with sharded.observers.attached(tracker), tracker:
            for _ in range(2):  # the second step runs with the optimizer state already allocated
                tracker.reset_peak()
                forward_pass = schedule.forward(xs, plain_input, lambda k, out, side: torch.nn.functional.cross_entropy(
                    out.reshape(-1, out.size(-1)), ys[k].reshape(-1)), [0.5, 0.5])
                schedule.backward(forward_pass)
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        peaks["unit_wise" if unit_wise else "at_end"] = tracker.peak_bytes
        peaks["local_grad_bytes"] = sharded.local_state_numel() * 4
    return {"rank": rank, **peaks}


# ----------------------------------------------------------------------------- driver


def _rank_main(rank: int, world: int, cfg: Config, parts: tuple[str, ...]) -> dict[str, Any]:
    return common.run_parts(parts, {"memory": lambda: _memory(rank, world, cfg),
                                    "cost": lambda: _cost_model(rank, world, cfg),
                                    "unitwise": lambda: _unit_wise(rank, world, cfg)})


def run_benchmark(cfg: Config = Config(), parts: tuple[str, ...] = PARTS) -> dict[str, Any]:
    """Both measurements as plain data (one spawn of 2 gloo ranks)."""
    start, load = time.perf_counter(), common.load_average()
    per_rank = common.run_ranks(_rank_main, WORLD, cfg, parts)
    result: dict[str, Any] = {"config": asdict(cfg), "environment": common.environment_note(), "world_size": WORLD,
                              "memory": [], "cost_model": None}
    if "memory" in parts:
        result["memory"] = memory_rows([r["memory"] for r in per_rank])
    if "cost" in parts:
        result["cost_model"] = cost_rows(cfg, [r["cost"] for r in per_rank])
    if "unitwise" in parts:
        result["unit_wise"] = [r["unitwise"] for r in per_rank]
    result["wall_s"] = time.perf_counter() - start
    result["load_average"] = common.load_span(load)
    return result


def print_unit_wise(rows: list[dict[str, Any]]) -> None:
    common.print_table(
        ["rank", "peak MiB, step at the end", "peak MiB, step per unit", "ratio", "saved MiB", "local grad MiB"],
        [[r["rank"], common.mib(r["at_end"]), common.mib(r["unit_wise"]), f"{r['unit_wise'] / r['at_end']:.3f}",
          common.mib(r["at_end"] - r["unit_wise"]), common.mib(r["local_grad_bytes"])] for r in rows],
        title="3. Optimizer stepped per unit as soon as its reduce-scatter lands (UnitOptimizers) vs one step at the "
              "end: peak accounted memory (measured; stash on the emulated host)",
    )
    print("   stepping per unit frees each unit's local gradient before the next layer's backward, so at most "
          "one unit's gradient is held\n")


def print_report(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(result["environment"])
    print(f"{result['world_size']} gloo ranks, GPT {cfg['n_layer']} blocks x {cfg['n_embd']} wide, seq {cfg['seq_len']}, "
          f"fp32, state shares {list(cfg['shares'])}.\n")
    if result["memory"]:
        rows = []
        for r in result["memory"]:
            if r["rank"] != 0:
                continue
            rows.append([r["micro_batch_size"], r["method"], r["micro_batches"], common.mib(r["peak_bytes"]),
                         f"{r['peak_over_n1']:.3f}", "-" if r["peak_over_n2"] is None else f"{r['peak_over_n2']:.3f}",
                         f"{r['peak_with_state_over_n1']:.3f}", common.mib(r["peak_host_bytes"]),
                         r["all_gathers"], r["reduce_scatters"]])
        common.print_table(
            ["m", "method", "n", "peak MiB", "peak(n)/peak(1)", "peak(n)/peak(2)", "incl. state: (n)/(1)",
             "host stash MiB", "all-gathers", "reduce-scatters"],
            rows,
            title=("1. Peak accounted memory of one step at a fixed micro-batch size m, rank 0 "
                   "(goal: layered peak(8)/peak(1) <= 1.10)"),
        )
        grad = result["memory"][0]["largest_layer_grad_bytes"]
        print("   peak: device bytes the MemoryTracker saw during the step (gathered layers, activations, gradients); "
              "'incl. state' adds the\n   resident fp32 master shard and AdamW moments (12 B/param x share) to both. "
              "layered runs with offload=True: on CPU that\n   EMULATES host offload, the stashed layer inputs are "
              "accounted as host memory (host stash column), not device memory.\n   micro-batch-major keeps every "
              "unit's unsharded gradient until the last micro-batch and re-gathers every unit for every micro-batch.\n"
              f"   layered: the step from n = 1 to n = 2 is the layer's accumulated full gradient (largest layer: "
              f"{common.mib(grad)} MiB fp32), alive while\n   the next micro-batch is recomputed; with n = 1 it never "
              "coexists with a full set of activations. Nothing grows after n = 2,\n   so the ratio to n = 1 "
              "shrinks as the activations (m) grow.\n")
    cm = result["cost_model"]
    if cm:
        print("2. Planner cost model vs the layered schedule (times are CPU measurements; rank 1 is EMULATED "
              "slower by sleeping)")
        for d in cm["devices"]:
            print(f"   rank {d['rank']}: {d['emulator']}")
            print(f"      profiled per average layer F(m) ms  = {[round(v, 3) for v in d['fwd_ms']]}")
            print(f"      profiled per average layer B(m) ms  = {[round(v, 3) for v in d['bwd_ms']]}")
        print(f"   per layer: AG {cm['allgather_ms']:.3f} ms, RS {cm['reduce_scatter_ms']:.3f} ms (measured, even "
              f"shares); {cm['num_layers']} layers (embedding, blocks, head: figures are per average layer)")
        cal = "\n".join(f"      rank {d['rank']}: busy grows {d['per_micro_batch_layer_ms']:.3f} ms per extra micro-batch "
                        f"and layer vs profiled F + (F + B) = {d['profiled_2F_plus_B_ms']:.3f} ms -> c = "
                        f"{d['c_ms']:+.3f} ms" + (f" (/{d['slowdown']:g}, the emulated slowdown)" if d["slowdown"] > 1 else "")
                        for d in cm["calibration"])
        raw = sum(d["c_ms"] for d in cm["calibration"]) / len(cm["calibration"])
        print(f"   calibrated micro_batch_overhead_ms c = {cm['micro_batch_overhead_ms']:.3f} ms on this CPU (raw mean "
              f"{raw:+.3f} ms, clamped at 0; the GPU default is 10 ms),\n   from steps at micro-batch size "
              f"{cfg['calibration_micro_batch']} and n = {list(cfg['calibration_counts'])}:\n{cal}")
        if cm["plan"]:
            print(f"   plan() for B={cm['plan']['global_batch']} on this cluster (from a first, short profile): "
                  f"(b_i, n_i) = {[tuple(pair) for pair in cm['plan']['assignment']]}, shares {[round(x, 3) for x in cm['plan']['shares']]}")
        elif cm.get("plan_error"):
            print(f"   plan() failed: {cm['plan_error']}")
        print("   The model, per layer and rank: fwd = max(AG, sum_k F(m_k)); bwd = max(AG + RS, sum_k (F(m_k) + B(m_k)) "
              "+ (n - 1) c):\n   the forward is recomputed in the backward (F + (F + B) per micro-batch), c is the "
              "overhead of each extra micro-batch;\n   step = L * (fwd + bwd) (DeviceCost.step_s), and the cluster's "
              "step is the max over ranks. It assumes the collectives\n   overlap compute; 'serial' is the same model "
              "with L * (2 AG + RS) added instead (no overlap, which is what gloo on CPU gives).\n"
              "   measured busy: the rank's compute regions during forward + backward (the emulated wait included); "
              "measured step:\n   barrier-to-barrier wall time of forward + backward (the same on both ranks: "
              "every layer's collectives sync them).\n")
        rows = []
        for r in cm["rows"]:
            first = r["rank"] == 0
            rows.append([r["config"] if first else "", r["rank"], r["batch"], r["micro_batches"],
                         f"{r['predicted_s'] * 1e3:.1f}", f"{r['measured_busy_s'] * 1e3:.1f}",
                         f"{r['busy_over_predicted']:.2f}",
                         f"{r['predicted_step_s'] * 1e3:.1f}" if first else "",
                         f"{r['predicted_serial_step_s'] * 1e3:.1f}" if first else "",
                         f"{r['measured_step_s'] * 1e3:.1f}" if first else "",
                         f"{r['step_over_predicted']:.2f}" if first else "",
                         f"{r['step_over_serial']:.2f}" if first else ""])
        common.print_table(
            ["config", "rank", "b_i", "n_i", "predicted ms", "busy ms", "busy/pred", "pred. step ms",
             "serial ms", "measured step ms", "step/pred", "step/serial"],
            rows,
        )
    if result.get("unit_wise"):
        print_unit_wise(result["unit_wise"])
    print(f"wall time of the run: {result['wall_s']:.1f} s; " + common.load_note(*result["load_average"]))


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", type=comma_list(PARTS), default=PARTS, help=f"comma-separated subset of {','.join(PARTS)}")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``--quick``: fewer configurations and rounds (under a minute)."""
    return run_benchmark(QUICK if args.quick else Config(), args.parts)


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
