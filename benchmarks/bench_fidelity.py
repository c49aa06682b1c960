"""Plan fidelity: the planner's predicted step time and peak memory per rank against what training measures.

    python benchmarks/bench_fidelity.py            # 6 emulated clusters and 2 controls (~5 minutes)
    python benchmarks/bench_fidelity.py --quick    # the same clusters, fewer steps
    python benchmarks/bench_fidelity.py --json     # the rows as data

THE CLUSTERS ARE EMULATED ON CPU: every rank is a CPU process on this machine (gloo), slowed by
sleeping after each compute region and given an accounted memory capacity
(:class:`~cephalo_lightning.runtime.emulation.emulator.DeviceEmulator`); no GPU is involved.

Only the public Lightning path is used. Per cluster, in one spawned group of ranks:

1. profile: a 1-step ``Trainer.fit`` with ``CephaloCallback`` (which profiles every emulated rank at
   setup: layers, collectives, the uneven-shard slope, the compute/communication overlap and the
   optimizer step) gives the planner's cluster, then ``planner.plan`` plans it in the cluster's mode;
2. measure: ``Trainer.fit(strategy=CephaloStrategy(plan=..., emulate=...))`` with a
   ``CephaloCallback`` watching every ``window`` steps; its ``history`` holds every rank's measured
   compute (busy) time and peak accounted memory per window, its ``summary`` the median step.

Per rank the table prints: PREDICTED step time (the rank's own, ``RankPlan.predicted_step_s``;
the plan's step is the slowest rank's) against the MEASURED step (wall time per step, median
over the measured windows' steps, the same on every rank since every step ends in collectives);
PREDICTED compute (the cost model's layer compute alone) against the MEASURED busy time; PREDICTED
peak memory (``RankPlan.predicted_memory_gb``) against the MEASURED peak of the accounted memory.
The goal is every ratio within 10%; the bottleneck rank's step ratio is the plan's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

try:
    import cephalo_lightning  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as common

from cephalo_lightning.planner.cost import predicted_busy_s  # noqa: E402 - torch-free


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    mode: str
    emulate: tuple[tuple[float, float], ...]  # (slowdown, memory_gb) per rank
    global_batch: int
    note: str


CLUSTERS = (
    ClusterSpec("A", "layered", ((1.0, 0.02), (3.0, 0.5)), 32, "2 ranks, fast rank tight (quickstart)"),
    ClusterSpec("B", "uniform", ((1.0, 0.5), (2.0, 0.5)), 32, "2 ranks, both loose"),
    ClusterSpec("C", "layered", ((1.0, 0.03), (2.0, 0.5), (4.0, 0.5)), 48, "3 ranks, slowdowns 1-4"),
    ClusterSpec("D", "uniform", ((1.0, 0.05), (1.5, 0.05), (3.0, 0.05)), 48, "3 ranks, all tight"),
    ClusterSpec("E", "layered", ((1.0, 0.5), (4.0, 0.5)), 32, "2 ranks, both loose, x4"),
    ClusterSpec("F", "layered", ((1.0, 0.02), (1.0, 0.02), (2.0, 0.5), (4.0, 0.5)), 48, "4 ranks on 2 cores"),
    # controls, to tell the model's errors from the host's: no collectives and no neighbour; two equal ranks
    ClusterSpec("S1", "layered", ((1.0, 0.5),), 16, "control: one rank"),
    ClusterSpec("S2", "layered", ((1.0, 0.5), (1.0, 0.5)), 32, "control: two equal ranks"),
)


@dataclass(frozen=True)
class Config:
    preset: str = "small"  # the demo GPT of configs/quickstart.yaml: 4 blocks x 128, ~0.9M parameters
    seq_len: int = 64
    profile_k: int = 8
    usable_memory_fraction: float = 0.9
    window: int = 4  # CephaloCallback(watch_every_n_steps=window)
    windows: int = 3  # measured windows after the first (whose steps 0-2 count every tensor: slow)
    threads: int = 1


QUICK = Config(window=3, windows=2)


def _specs(cluster: ClusterSpec) -> list[dict[str, float]]:
    return [{"slowdown": s, "memory_gb": m} for s, m in cluster.emulate]


def _trainer(world: int, strategy: Any, steps: int, callbacks: list) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=steps, precision="32-true",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=callbacks,
    )


def _fit(cfg: Config, cluster: ClusterSpec, strategy: Any, steps: int, callback: Any) -> None:
    import lightning.pytorch as pl

    from cephalo_lightning.demo import GPTModule, TextDataModule

    pl.seed_everything(0, verbose=False)
    module = GPTModule(preset=cfg.preset, seq_len=cfg.seq_len, warmup_steps=2, lr_decay_steps=steps)
    module.configure_model()  # built now, from the seed: every strategy compared starts from the same weights
    data = TextDataModule(seq_len=cfg.seq_len, batch_size=cluster.global_batch)
    _trainer(len(cluster.emulate), strategy, steps, [callback]).fit(module, data)


def _rank_main(rank: int, world: int, cfg: Config, cluster: ClusterSpec) -> dict[str, Any]:
    from cephalo_lightning import CephaloCallback, CephaloStrategy
    from cephalo_lightning.planner import plan as make_plan

    common.quiet_lightning()
    common.pin_threads(cfg.threads)
    # the layers are profiled through the layered protocol whichever mode the plan then runs in
    profiler = CephaloCallback(max_micro_batch=cfg.profile_k, cache_dir=None, watch_every_n_steps=0, mode=cluster.mode,
                               settings={"usable_memory_fraction": cfg.usable_memory_fraction},
                               print_plan=False, quiet=True)
    start = time.perf_counter()
    _fit(cfg, cluster, CephaloStrategy(emulate=_specs(cluster)), 1, profiler)
    profile_s = time.perf_counter() - start
    profiled = profiler.cluster
    assert profiled is not None
    plan = make_plan(profiled, cluster.global_batch, mode=cluster.mode)
    watcher = CephaloCallback(watch_every_n_steps=cfg.window, print_plan=False, quiet=True, cache_dir=None)
    _fit(cfg, cluster, CephaloStrategy(plan=plan, emulate=_specs(cluster), mode=cluster.mode),
         cfg.window * (1 + cfg.windows), watcher)
    return {"cluster": profiled, "plan": plan, "history": watcher.history,
            "summary": getattr(watcher, "summary", None), "profile_s": profile_s}


def measure(cfg: Config, cluster: ClusterSpec) -> dict[str, Any]:
    try:
        per_rank = common.run_ranks(_rank_main, len(cluster.emulate), cfg, cluster, threads=cfg.threads)
    except RuntimeError as err:  # e.g. an emulated OOM: the plan did not hold; report it, measure the rest
        lines = [line for line in str(err).splitlines() if "Error" in line and "Traceback" not in line]
        return {"cluster": asdict(cluster), "mode": cluster.mode, "failed": lines[0] if lines else str(err)[-300:]}
    r0 = per_rank[0]
    profiled, plan, history = r0["cluster"], r0["plan"], r0["history"][1:]  # window 1: the counting steps
    wall = [statistics.median(r["summary"]["measured_step_s"] for r in per_rank if r["summary"])] if any(
        r["summary"] for r in per_rank) else []
    steps = [w["step_s"] for w in history]
    measured_step = statistics.median(steps) if steps else (wall[0] if wall else float("nan"))
    compute = predicted_busy_s(profiled, plan)  # layers and optimizer step, as the busy time counts them
    rows = []
    for i, r in enumerate(plan.ranks):
        busy = statistics.median(w["ranks"][i]["measured_busy_s"] for w in history)
        peaks = [w["ranks"][i]["peak_memory_gb"] for w in history if w["ranks"][i]["peak_memory_gb"] is not None]
        peak = max(peaks) if peaks else None
        rows.append({
            "rank": i, "device": profiled.devices[i].name, "batch": r.batch_size, "micro_batches": r.num_micro_batches,
            "share": r.state_share, "recompute": r.recompute,
            "predicted_step_s": r.predicted_step_s, "measured_step_s": measured_step,
            "step_ratio": measured_step / r.predicted_step_s if r.predicted_step_s else None,
            "bottleneck": r.predicted_step_s == plan.predicted_step_s,
            "predicted_compute_s": compute[i], "measured_busy_s": busy,
            "compute_ratio": busy / compute[i] if compute[i] else None,
            "predicted_memory_gb": r.predicted_memory_gb, "measured_memory_gb": peak,
            "memory_ratio": peak / r.predicted_memory_gb if peak and r.predicted_memory_gb else None,
        })
    s = profiled.settings
    slowest = max(range(len(rows)), key=lambda i: rows[i]["predicted_step_s"])
    outside = {  # the slowest rank's step beyond its compute: collectives and the loop
        "predicted_s": rows[slowest]["predicted_step_s"] - rows[slowest]["predicted_compute_s"],
        "measured_s": measured_step - max(r["measured_busy_s"] for r in rows),
    }
    return {"cluster": asdict(cluster), "mode": plan.mode, "predicted_step_s": plan.predicted_step_s, "outside": outside,
            "measured_step_s": measured_step, "ranks": rows, "profile_s": r0["profile_s"],
            "settings": {"allgather_ms": s.allgather_ms, "reduce_scatter_ms": s.reduce_scatter_ms,
                         "uneven_slope": s.uneven_slope, "overlap": s.overlap},
            "optimizer_ns_per_param": [d.optimizer_ns_per_param for d in profiled.devices]}


def run_benchmark(cfg: Config = Config(), clusters: tuple[ClusterSpec, ...] = CLUSTERS) -> dict[str, Any]:
    start, load = time.perf_counter(), common.load_average()
    results = [measure(cfg, c) for c in clusters]
    return {"config": asdict(cfg), "environment": common.environment_note(cfg.threads), "emulated": True,
            "clusters": results, "wall_s": time.perf_counter() - start,
            "load_average": (load, common.load_average()), "cores": os.cpu_count()}


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_report(result: dict[str, Any]) -> None:
    print("EMULATED heterogeneous clusters on CPU: every rank is a CPU process on this machine (gloo), slowed by "
          "sleeping and given an\naccounted memory capacity; none of these figures comes from a GPU. Predicted: the "
          "planner's cost model on the profiled cluster.")
    print(result["environment"])
    rows = []
    within = []
    for c in result["clusters"]:
        spec = c["cluster"]
        if "failed" in c:
            rows.append([f"{spec['name']} {c['mode']}", "-", " ".join(f"x{s:g} {m:g}G" for s, m in spec["emulate"]),
                         *["" for _ in range(11)], "FAILED"])
            continue
        for r in c["ranks"]:
            within += [abs(x - 1) <= 0.10 for x in (r["step_ratio"] if r["bottleneck"] else None, r["memory_ratio"])
                       if x is not None]
            rows.append([
                f"{spec['name']} {c['mode']}" if r["rank"] == 0 else "", r["rank"],
                f"x{spec['emulate'][r['rank']][0]:g} {spec['emulate'][r['rank']][1]:g}G",
                r["batch"], f"{r['micro_batches']}{'' if r['recompute'] else ' kept'}", f"{r['share']:.2f}",
                f"{1e3 * r['predicted_step_s']:.0f}" + ("*" if r["bottleneck"] else ""), f"{1e3 * r['measured_step_s']:.0f}",
                _ratio(r["step_ratio"]), f"{1e3 * r['predicted_compute_s']:.0f}", f"{1e3 * r['measured_busy_s']:.0f}",
                _ratio(r["compute_ratio"]), f"{r['predicted_memory_gb']:.4f}",
                "-" if r["measured_memory_gb"] is None else f"{r['measured_memory_gb']:.4f}", _ratio(r["memory_ratio"]),
            ])
    common.print_table(
        ["cluster", "rank", "emulated", "b", "n", "share", "pred. step ms", "meas. step ms", "meas./pred.",
         "pred. compute ms", "meas. busy ms", "meas./pred.", "pred. peak GiB", "meas. peak GiB", "meas./pred."],
        rows, title="Plan fidelity per rank (EMULATED): predicted vs measured step time, compute and peak memory")
    print("*: the rank the plan predicts slowest (its step is the plan's); every rank measures the same step, as "
          "every step ends in\ncollectives, so only the starred rank's step ratio tests the model; the others wait.")
    for c in result["clusters"]:
        if "failed" in c:
            print(f"  {c['cluster']['name']}: {c['cluster']['note']}; FAILED: {c['failed']}")
            continue
        s = c["settings"]
        print(f"  {c['cluster']['name']}: {c['cluster']['note']}; profiled AG {s['allgather_ms']:.3f} ms, RS "
              f"{s['reduce_scatter_ms']:.3f} ms per layer, uneven slope {s['uneven_slope']}, overlap {s['overlap']}, "
              f"optimizer ns/param {c['optimizer_ns_per_param']}; plan {1e3 * c['predicted_step_s']:.0f} ms, "
              f"measured {1e3 * c['measured_step_s']:.0f} ms ({c['measured_step_s'] / c['predicted_step_s']:.2f}); "
              f"beyond the compute: predicted {1e3 * c['outside']['predicted_s']:.0f} ms, measured "
              f"{1e3 * c['outside']['measured_s']:.0f} ms")
    print(f"within 10%: {sum(within)} of {len(within)} figures (the slowest rank's step, every rank's peak memory)")
    most = max(len(c["cluster"]["emulate"]) for c in result["clusters"])
    if most > (result["cores"] or 0):
        print(f"NOTE: up to {most} ranks on {result['cores']} cores: "
              "ranks computing at once compete for cores, which the turn-taking profile does not see.")
    print(f"wall time {result['wall_s']:.0f} s; " + common.load_note(*result["load_average"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer measured steps")
    parser.add_argument("--clusters", default=",".join(c.name for c in CLUSTERS), help="which clusters, e.g. A,C,S1")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    chosen = tuple(c for c in CLUSTERS if c.name in args.clusters.split(","))
    result = run_benchmark(QUICK if args.quick else Config(), chosen)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print_report(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
