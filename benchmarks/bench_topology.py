"""Shard groups over an emulated network topology: the planner's choice vs full shard, HSDP and DDP.

    python -m benchmarks.bench_topology              # 2 rounds per cluster; several minutes on 2 cores
    python -m benchmarks.bench_topology --quick      # 1 round, fewer batches
    python -m benchmarks.bench_topology --profile-only  # measure the links, profile and plan; no fits
    python -m benchmarks.bench_topology --calibrate  # plan on a calibration of the profile's plan
    python -m benchmarks.bench_topology --link-ratio 10  # the inter-node link 10x slower than the host's, measured
    python -m benchmarks.bench_topology --slowdown-scale 1  # cluster 1 unscaled, 1, 1, 2, 2 (default 2: see below)
    python -m benchmarks.bench_topology --json -     # the result as JSON on stdout (--json PATH: to a file)

THE CLUSTER IS EMULATED ON CPU: 4 gloo ranks on this machine stand for 2 nodes x 2 GPUs. Node 0 has
two fast ranks with little memory, node 1 two ranks twice as slow with plenty
(:class:`~cephalo_lightning.runtime.emulation.emulator.DeviceEmulator`); what a rank sends to a rank
of the other node is held to an emulated inter-node link (``node`` / ``inter_node_gbps``,
:class:`~cephalo_lightning.runtime.emulation.links.EmulatedLinks`) set to 0.02 GB/s, several times
slower than the host's own link between two ranks, which is MEASURED first (an all-gather between
ranks, :func:`~cephalo_lightning.profiling.topology.time_links`) and printed with the ratio (6-24x
on one 2-core host, 4-9x on a slower one). The link
is fixed rather than derived from that measurement, which the host's load moves 4x from run to run
(``--link-ratio R`` derives it, R times slower than the host's). No GPU is involved.

Four ranks share the host's two cores. A rank at slowdown 1 computes on a core for its whole
region, so ranks at 1, 1, 2, 2 would ask for 3 cores between them and wait for one another's
compute, which no GPU does. Cluster 1's slowdowns are therefore scaled by ``slowdown_scale`` = 2 by
default (2, 2, 4, 4: the same ratios, 1.5 cores asked for), and every rank then has a wait after its
compute that covers the time it queued for a core inside the region (the emulator's
[Note: covered run-queue wait]), so the emulated compute does not stretch with the neighbours' load.
``--slowdown-scale 1`` runs the unscaled 1, 1, 2, 2. Cluster 2 stays at full speed, as Lightning's
DDP beside it runs unemulated.

In one spawned group of 4 ranks, for each of two clusters:

1. profile once (a 1-step ``Trainer.fit`` with :class:`~cephalo_lightning.CephaloCallback`): the
   profiler finds the emulated nodes and measures both link classes;
2. with ``--calibrate``, calibrate as ``CephaloCallback`` does after warm-up: the profile's plan runs
   ``calibration_windows`` watch windows (the first, which counts every tensor, left out) and the
   cost model's run-time terms are fitted to them (:func:`~cephalo_lightning.lightning.callback.run_model.calibrate`:
   every rank's compute as run, the fitted grouping's collectives as run, the per-step overhead, the
   host's contention), and every plan below is planned and predicted on the calibrated cluster;
3. plan: the planner's choice (``planner.plan``, which chooses the shard groups), ``full-shard``
   (the planner restricted to one group of every rank, ``groupings=("full",)``: today's plan),
   ``hsdp-even`` and ``ddp-even`` (``planner="hsdp-even"`` / ``"ddp-even"``, even shares and batches,
   a group per node / per rank); a plan the planner finds infeasible is skipped, and why is printed;
4. train the demo GPT with each plan through ``Trainer.fit`` (``CephaloStrategy(plan=..., emulate=...)``),
   R rounds of one short fit per plan, the order rotated each round, same data and seed.

The second cluster fits the model on every rank with no link penalty (one node, full speed,
unlimited memory): the planner's choice beside Lightning's ``strategy="ddp"`` (goal: within 1.05x).

Figures: MEASURED step = ``on_train_batch_start`` -> ``on_train_batch_end``, max over the ranks per
batch, median over the measured batches (the first ``warmup`` of every fit skipped); PREDICTED =
the planner's cost model on the profiled (emulated) cluster (with ``--calibrate``: on the calibrated
one, beside the profile's own figure). Measured ratios are medians of
per-round ratios (fits run seconds apart).
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
PLANS = ("cephalo", "full-shard", "hsdp-even", "ddp-even")
FITS_EVERYWHERE_PLANS = ("cephalo", "ddp")  # the second cluster: the planner's choice vs Lightning's DDP
GOALS = {"full-shard": 1.5, "ddp": 1.05}  # full shard / cephalo step >= 1.5; cephalo / ddp step <= 1.05


@dataclass(frozen=True)
class Config:
    # per rank (slowdown, memory_gb): node 0 fast with little memory, node 1 twice as slow with plenty
    devices: tuple[tuple[float, float | None], ...] = ((1.0, 0.03), (1.0, 0.03), (2.0, 0.5), (2.0, 0.5))
    # the emulated inter-node link, GB/s per direction per rank: fixed, so that how much the slow link
    # weighs against compute does not follow the host's momentary load (the host's own link between two
    # ranks measures 0.12-0.48 GB/s on this 2-core machine, load-dependent: 6-24x faster); None: the
    # host's link as measured at the start, divided by link_ratio
    inter_node_gbps: float | None = 0.02
    link_ratio: float = 10.0
    # cluster 1's slowdowns times this, their ratios unchanged: 2, 2, 4, 4 ask the host for 1.5 of its 2
    # cores (cluster 2 stays at full speed: Lightning's DDP beside it runs unemulated)
    slowdown_scale: float = 2.0
    probe_bytes: int = 2**20  # each rank's shard when the host's link is measured
    preset: str = "small"  # the demo GPT: 4 blocks x 128, ~0.9M parameters
    seq_len: int = 64
    global_batch: int = 32
    profile_k: int = 4
    usable_memory_fraction: float = 0.9
    rounds: int = 2
    warmup: int = 3  # >= 3: under a memory cap the strategy counts every tensor (slow) in steps 0-2
    measured: int = 5
    threads: int = 1
    plans: tuple[str, ...] = PLANS
    fits_everywhere: bool = True  # also run the second cluster
    profile_only: bool = False
    calibration_window: int = 3  # steps per watch window of the calibration run
    calibration_windows: int = 0  # windows fitted, after a first one left out (0: plan on the profile alone)


QUICK = Config(rounds=1, measured=4)


# ----------------------------------------------------------------------------- the clusters


def host_link_gbps(cfg: Config) -> float:
    """The host's own link between two ranks (GB/s per direction per rank), MEASURED: the least of an
    all-gather within and across the would-be nodes, no emulated link (every rank gets the same)."""
    from cephalo_lightning.profiling.topology import Topology, time_links

    profile = time_links(Topology(NODES, "bench"), probe_bytes=cfg.probe_bytes, repeats=5)
    assert profile is not None and profile.intra_node_gbps is not None
    return min(profile.intra_node_gbps, profile.inter_node_gbps)


def topology_specs(cfg: Config, inter_node_gbps: float) -> list[dict[str, Any]]:
    specs = []
    for (slowdown, memory), node in zip(cfg.devices, NODES):
        spec: dict[str, Any] = {"slowdown": slowdown * cfg.slowdown_scale, "node": node, "inter_node_gbps": inter_node_gbps}
        if memory is not None:
            spec["memory_gb"] = memory
        specs.append(spec)
    return specs


def fits_everywhere_specs() -> list[dict[str, Any]]:
    return [{"slowdown": 1.0} for _ in range(WORLD)]  # one node, full speed, unlimited memory


def _module(cfg: Config):
    from cephalo_lightning.demo import GPTModule

    module = GPTModule(preset=cfg.preset, seq_len=cfg.seq_len, warmup_steps=2, lr_decay_steps=cfg.warmup + cfg.measured)
    module.configure_model()  # built now, from the seed: every plan compared starts from the same weights
    return module


def _trainer(strategy, steps: int, callbacks: list):
    import lightning.pytorch as pl

    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=steps, precision="32-true",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=callbacks,
    )


def _datamodule(cfg: Config, batch_size: int | None = None):
    from cephalo_lightning.demo import TextDataModule

    return TextDataModule(seq_len=cfg.seq_len, batch_size=batch_size or cfg.global_batch)


def profile(cfg: Config, specs: list[dict[str, Any]]):
    """Profile the emulated ranks once through the callback (a 1-step fit); the planner's cluster."""
    import lightning.pytorch as pl

    from cephalo_lightning import CephaloCallback, CephaloStrategy

    callback = CephaloCallback(max_micro_batch=cfg.profile_k, cache_dir=None, watch_every_n_steps=0,
                               settings={"usable_memory_fraction": cfg.usable_memory_fraction},
                               print_plan=False, quiet=True)
    pl.seed_everything(0, verbose=False)
    trainer = _trainer(CephaloStrategy(emulate=specs), 1, [callback])
    trainer.fit(_module(cfg), _datamodule(cfg))
    assert callback.cluster is not None
    return callback.cluster


def calibrate(cfg: Config, cluster, specs: list[dict[str, Any]]):
    """The profile's plan measured for a few watch windows and the cost model fitted to them (rank 0
    fits, every rank gets the result), as ``CephaloCallback`` calibrates after warm-up."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    from cephalo_lightning import CephaloCallback, CephaloStrategy
    from cephalo_lightning.lightning.callback.run_model import calibrate as fit_to_windows
    from cephalo_lightning.planner import plan as make_plan
    from cephalo_lightning.runtime.distributed import broadcast_object

    plan = make_plan(cluster, cfg.global_batch, mode="layered")
    watcher = CephaloCallback(watch_every_n_steps=cfg.calibration_window, print_plan=False, quiet=True, cache_dir=None,
                              calibrate_after_windows=0)
    pl.seed_everything(0, verbose=False)
    trainer = _trainer(CephaloStrategy(plan=plan, emulate=specs), cfg.calibration_window * (1 + cfg.calibration_windows),
                       [watcher])
    trainer.fit(_module(cfg), _datamodule(cfg))
    # every rank's windows hold its own step wall: rank 0's fit, for every rank
    return broadcast_object(fit_to_windows(cluster, plan, watcher.history[1:]) if dist.get_rank() == 0 else None)


def make_plans(cfg: Config, cluster, names: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, str]]:
    """Each requested plan of the profiled cluster, and why any was skipped."""
    from cephalo_lightning.planner import PlanningError
    from cephalo_lightning.planner import plan as make_plan

    plans, skipped = {}, {}
    for name in names:
        try:
            if name == "cephalo":
                plans[name] = make_plan(cluster, cfg.global_batch, mode="layered")
            elif name == "full-shard":  # the planner's best plan with one group of every rank
                plans[name] = make_plan(cluster, cfg.global_batch, mode="layered", groupings=("full",))
            elif name != "ddp":  # ddp is Lightning's own strategy, no plan
                plans[name] = make_plan(cluster, cfg.global_batch, mode="layered", planner=name)
        except PlanningError as err:
            skipped[name] = str(err)
    return plans, skipped


# ----------------------------------------------------------------------------- fits


def fit(cfg: Config, name: str, plan, specs: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Train one short fit; this rank's per-batch times, warm-up skipped."""
    import lightning.pytorch as pl

    from cephalo_lightning import CephaloStrategy

    timer = common.step_timer()
    pl.seed_everything(0, verbose=False)
    if name == "ddp":  # Lightning's DDP: the DataLoader's batch is per rank
        trainer = _trainer("ddp", cfg.warmup + cfg.measured, [timer])
        datamodule = _datamodule(cfg, cfg.global_batch // WORLD)
    else:
        trainer = _trainer(CephaloStrategy(plan=plan, emulate=specs), cfg.warmup + cfg.measured, [timer])
        datamodule = _datamodule(cfg)
    trainer.fit(_module(cfg), datamodule)
    return {"step_s": timer.step_s(cfg.warmup), "iteration_s": timer.iteration_s(cfg.warmup),
            "loss": float(trainer.callback_metrics.get("train_loss", float("nan")))}


def interleaved_fits(cfg: Config, plans: dict[str, Any], specs, names: list[str]):
    fits: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    order = []
    for i in range(cfg.rounds):
        rotated = common.rotated(names, i)
        order.append(rotated)
        for name in rotated:
            fits[name].append(fit(cfg, name, plans.get(name), specs))
    return fits, order


def _cluster_run(cfg: Config, specs: list[dict[str, Any]], names: tuple[str, ...]) -> dict[str, Any]:
    from cephalo_lightning.planner.cost.calibration_fit import predicted

    start = time.perf_counter()
    profiled = cluster = profile(cfg, specs)
    profile_s = time.perf_counter() - start
    calibration = None
    if cfg.calibration_windows and not cfg.profile_only:
        calibration = calibrate(cfg, profiled, specs)
        cluster = calibration.cluster
    plans, skipped = make_plans(cfg, cluster, names)
    out: dict[str, Any] = {"specs": specs, "cluster": cluster, "plans": plans, "skipped": skipped,
                           "profile_s": profile_s, "fits": {}, "order": [],
                           "profile_predicted_s": {name: predicted(profiled, p)[0] for name, p in plans.items()},
                           "calibration": None if calibration is None else calibration.message()}
    if not cfg.profile_only:
        runnable = [n for n in names if n in plans or n == "ddp"]
        out["fits"], out["order"] = interleaved_fits(cfg, plans, specs, runnable)
    return out


def _rank_main(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    common.quiet_lightning()
    common.pin_threads(cfg.threads)
    host_gbps = host_link_gbps(cfg)
    inter_node_gbps = cfg.inter_node_gbps or float(f"{host_gbps / cfg.link_ratio:.3g}")
    out = {"host_link_gbps": host_gbps, "inter_node_gbps": inter_node_gbps,
           "topology": _cluster_run(cfg, topology_specs(cfg, inter_node_gbps), cfg.plans)}
    if cfg.fits_everywhere:
        out["fits_everywhere"] = _cluster_run(cfg, fits_everywhere_specs(), FITS_EVERYWHERE_PLANS)
    return out


# ----------------------------------------------------------------------------- rows


def summarize(cfg: Config, run: dict[str, Any], fits: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    rows = []
    for name, per_fit in fits.items():
        plan = run["plans"].get(name)
        predicted = plan.predicted_step_s if plan is not None else None
        profile_predicted = run["profile_predicted_s"].get(name)
        rows.append({
            "plan": name,
            "shard_groups": [list(g) for g in plan.shard_groups] if plan is not None else "per rank (Lightning DDP)",
            "batch_sizes": plan.batch_sizes if plan is not None else [cfg.global_batch // WORLD] * WORLD,
            "micro_batches": plan.num_micro_batches if plan is not None else [1] * WORLD,
            "state_shares": plan.state_shares if plan is not None else [1.0] * WORLD,
            "predicted_step_ms": None if predicted is None else 1e3 * predicted,
            "profile_predicted_step_ms": None if profile_predicted is None else 1e3 * profile_predicted,
            "measured_step_ms": 1e3 * common.median([t for f in per_fit for t in f["step_s"]]),
            "per_round_step_ms": [1e3 * common.median(f["step_s"]) for f in per_fit],
            "final_loss": [f["loss"] for f in per_fit],
        })
    by = {r["plan"]: r for r in rows}
    ratios = []
    if "cephalo" in by:
        for other in by:
            if other == "cephalo":
                continue
            per_round = [o / c for o, c in zip(by[other]["per_round_step_ms"], by["cephalo"]["per_round_step_ms"])]
            predicted = (by[other]["predicted_step_ms"] / by["cephalo"]["predicted_step_ms"]
                         if by[other]["predicted_step_ms"] and by["cephalo"]["predicted_step_ms"] else None)
            ratios.append({"ratio": f"{other} / cephalo", "other": other, "measured_paired": common.median(per_round),
                           "min_round": min(per_round), "max_round": max(per_round), "predicted": predicted})
    # fastest by the paired ratios (each round compares fits run seconds apart, as the ratio table
    # does), not by the pooled medians, which a drift of the host's load between rounds moves
    if ratios:
        slowest_other = min(ratios, key=lambda r: r["measured_paired"])
        fastest = "cephalo" if slowest_other["measured_paired"] >= 1.0 else slowest_other["other"]
    else:
        fastest = min(rows, key=lambda r: r["measured_step_ms"])["plan"] if rows else None
    return {"rows": rows, "ratios": ratios, "fastest_measured": fastest}


def _combine(cfg: Config, per_rank: list[dict[str, Any]], key: str) -> dict[str, Any]:
    run = per_rank[0][key]
    fits = common.max_over_rank_results([r[key]["fits"] for r in per_rank], ("step_s", "iteration_s")) \
        if run["fits"] else {}
    return {"specs": run["specs"], "skipped": run["skipped"], "order": run["order"], "profile_s": run["profile_s"],
            "calibration": run["calibration"],
            "settings": asdict(run["cluster"].settings),
            "devices": [{"rank": i, "device": d.name, "node": d.node, "memory_gb": d.memory_gb,
                         "emulate": asdict(d.emulate) if d.emulate else None} for i, d in enumerate(run["cluster"].devices)],
            "plans": {name: {"shard_groups": [list(g) for g in p.shard_groups], "batch_sizes": p.batch_sizes,
                             "micro_batches": p.num_micro_batches, "state_shares": p.state_shares,
                             "predicted_step_ms": None if (s := p.predicted_step_s) is None else 1e3 * s}
                      for name, p in run["plans"].items()},
            **(summarize(cfg, run, fits) if fits else {"rows": [], "ratios": [], "fastest_measured": None})}


def run_benchmark(cfg: Config = Config()) -> dict[str, Any]:
    """Measure the host's link, then profile, plan and fit both clusters (one spawn of 4 gloo ranks)."""
    start, load = time.perf_counter(), common.load_average()
    per_rank = common.run_ranks(_rank_main, WORLD, cfg, threads=cfg.threads)
    result: dict[str, Any] = {
        "config": asdict(cfg), "environment": common.environment_note(cfg.threads), "emulated": True,
        "host_link_gbps": per_rank[0]["host_link_gbps"],
        "inter_node_gbps": per_rank[0]["inter_node_gbps"], "topology": _combine(cfg, per_rank, "topology"),
    }
    if cfg.fits_everywhere:
        result["fits_everywhere"] = _combine(cfg, per_rank, "fits_everywhere")
    result["wall_s"] = time.perf_counter() - start
    result["load_average"] = common.load_span(load)
    return result


# ----------------------------------------------------------------------------- report


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _print_cluster(title: str, run: dict[str, Any]) -> None:
    print(title)
    for d in run["devices"]:
        print(f"  rank {d['rank']}: {d['device']}, node {d['node']}, {d['memory_gb']:g} GiB (emulate {d['emulate']})")
    s = run["settings"]
    print(f"  profiled ({run['profile_s']:.1f} s): link within a node {_fmt(s.get('link_bandwidth_gbps'), '.4g')} GB/s, "
          f"between nodes {_fmt(s.get('inter_node_bandwidth_gbps'), '.4g')} GB/s (MEASURED on the EMULATED cluster); "
          f"all-gather {s['allgather_ms']:.2f} ms, reduce-scatter {s['reduce_scatter_ms']:.2f} ms per layer (measured)")
    if run["calibration"]:
        print(f"  {run['calibration'].removeprefix('Cephalo: ')} (EMULATED)")
    for name, why in run["skipped"].items():
        print(f"  skipped {name}: {why}")
    on = "calibrated" if run["calibration"] else "profiled"
    common.print_table(
        ["plan", "shard groups", "batch per rank", "micro-batches", "state shares", "predicted step ms"],
        [[name, p["shard_groups"], p["batch_sizes"], p["micro_batches"], "/".join(f"{v:.2f}" for v in p["state_shares"]),
          _fmt(p["predicted_step_ms"])] for name, p in run["plans"].items()],
        title=f"  plans (predicted by the planner's cost model on the {on} EMULATED cluster)",
    )
    if not run["rows"]:
        return
    beside = ["by the profile alone"] if run["calibration"] else []
    common.print_table(
        ["plan", "shard groups", "predicted step ms", *beside, "measured step ms", "measured / predicted",
         "per-round measured"],
        [[r["plan"], r["shard_groups"], _fmt(r["predicted_step_ms"]),
          *([_fmt(r.get("profile_predicted_step_ms"))] if beside else []), f"{r['measured_step_ms']:.1f}",
          _fmt(r["measured_step_ms"] / r["predicted_step_ms"] if r["predicted_step_ms"] else None, ".2f"),
          " ".join(f"{v:.0f}" for v in r["per_round_step_ms"])] for r in run["rows"]],
        title="  step per plan, MEASURED through Trainer.fit on the EMULATED cluster (max over ranks, median over batches)",
    )
    common.print_table(
        ["ratio", "measured (paired)", "rounds min..max", "predicted"],
        [[r["ratio"], f"{r['measured_paired']:.2f}", f"{r['min_round']:.2f}..{r['max_round']:.2f}",
          _fmt(r["predicted"], ".2f")] for r in run["ratios"]],
        title="  step ratios (> 1: the planner's choice is faster)",
    )
    print(f"  fastest measured (by the paired ratios): {run['fastest_measured']}\n")


def print_report(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print("EMULATED cluster on CPU: 4 gloo processes on this machine stand for 2 nodes x 2 GPUs (slowed by sleeping, "
          "given an\naccounted memory capacity, their sends across nodes held to an emulated link); none of these "
          "figures comes from a GPU or a network.")
    print(result["environment"])
    print(f"host link between two ranks: {result['host_link_gbps']:.4g} GB/s (MEASURED, {cfg['probe_bytes']} B per rank); "
          f"emulated inter-node link: {result['inter_node_gbps']:.4g} GB/s ({result['host_link_gbps'] / result['inter_node_gbps']:.1f}x "
          f"slower, {'fixed' if cfg['inter_node_gbps'] else 'the host link / link_ratio'}, EMULATED)")
    print(f"demo GPTModule ({cfg['preset']}), seq {cfg['seq_len']}, global batch {cfg['global_batch']}, AdamW, 32-true, "
          f"layered; {cfg['rounds']} round(s) x one fit per plan, {cfg['warmup']} warm-up + {cfg['measured']} "
          "measured batches per fit.\n")
    _print_cluster("Cluster 1: 2 emulated nodes, heterogeneous slowdowns and memories, slow inter-node link",
                   result["topology"])
    if "fits_everywhere" in result:
        _print_cluster("Cluster 2: one node, the model fits every rank, no link penalty",
                       result["fits_everywhere"])
    topo = {r["ratio"]: r for r in result["topology"]["ratios"]}
    if "full-shard / cephalo" in topo:
        value = topo["full-shard / cephalo"]["measured_paired"]
        verdict = "meets" if value >= GOALS["full-shard"] else "MISSES"
        print(f"full shard / planner's choice step = {value:.2f} (measured, EMULATED): {verdict} the goal of >= "
              f"{GOALS['full-shard']:.2f}.")
    if result["topology"]["fastest_measured"] is not None:
        verdict = "meets" if result["topology"]["fastest_measured"] == "cephalo" else "MISSES"
        print(f"fastest measured on cluster 1: {result['topology']['fastest_measured']}: {verdict} the goal that the "
              "planner's choice is the fastest of the plans that fit.")
    everywhere = {r["ratio"]: r for r in result.get("fits_everywhere", {}).get("ratios", [])}
    if "ddp / cephalo" in everywhere:
        value = 1.0 / everywhere["ddp / cephalo"]["measured_paired"]
        verdict = "meets" if value <= GOALS["ddp"] else "MISSES"
        print(f"planner's choice / DDP step on cluster 2 = {value:.3f} (measured): {verdict} the goal of <= "
              f"{GOALS['ddp']:.2f}.")
    print(f"wall time of the run: {result['wall_s']:.1f} s; " + common.load_note(*result["load_average"]))


def _at_least_one(text: str) -> float:
    value = float(text)
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _above_one(text: str) -> float:
    value = float(text)
    if not value > 1:
        raise argparse.ArgumentTypeError(f"must be > 1 (how many times slower than the host's link), got {value}")
    return value


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, help="override the number of rounds")
    parser.add_argument("--profile-only", action="store_true", help="measure the links, profile and plan; no fits")
    parser.add_argument("--no-second", action="store_true", help="skip the cluster that fits everywhere")
    parser.add_argument("--calibrate", action="store_true",
                        help="calibrate on the profile's plan first (2 windows) and plan on the calibrated cluster")
    parser.add_argument("--link-ratio", type=_above_one, metavar="R",
                        help="derive the emulated inter-node link from the host's, R times slower (default: fixed "
                             f"at {Config.inter_node_gbps} GB/s)")
    parser.add_argument("--slowdown-scale", type=_at_least_one, metavar="S",
                        help="cluster 1's emulated slowdowns times S (>= 1), the ratios between ranks unchanged")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``--quick``: 1 round, fewer batches."""
    overrides: dict[str, Any] = {"profile_only": args.profile_only, "fits_everywhere": not args.no_second}
    if args.calibrate:
        overrides["calibration_windows"] = 2
    if args.rounds:
        overrides["rounds"] = args.rounds
    if args.slowdown_scale is not None:
        overrides["slowdown_scale"] = args.slowdown_scale
    if args.link_ratio is not None:
        overrides.update(inter_node_gbps=None, link_ratio=args.link_ratio)
    return run_benchmark(Config(**{**asdict(QUICK if args.quick else Config()), **overrides}))


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
