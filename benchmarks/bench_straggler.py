"""A straggler mid-run: throughput per watch window of the static plan, the adaptive one and the offline optimum.

    python -m benchmarks.bench_straggler            # 3 EMULATED ranks, rank 1 slows x3 at step S, recovers at S2
    python -m benchmarks.bench_straggler --quick
    python -m benchmarks.bench_straggler --emulate 1,1.5,2   # other slowdowns of ranks 0..2

THE CLUSTER IS EMULATED ON CPU: three gloo processes on this machine, slowed by sleeping after each
compute region (:class:`~cephalo_lightning.runtime.emulation.emulator.DeviceEmulator`); no GPU.
The default slowdowns (2, 3, 4) keep the three ranks' real compute within about one core (1/2 + 1/3
+ 1/4 of their time) on a host of two: at 1, 1.5, 2 they ask for 2.17 cores, and a plan that leaves
one rank without samples frees a core for the others, a gain that no GPU cluster has and that makes
the slowed cluster's plan measure faster than the original optimum after the recovery.

In one spawned group of ranks, every fit of the same model and data, with the same slowdown:

* static: ``CephaloCallback(adapt=False)`` - calibrated after the first windows (it may take the
  calibrated optimum then), the plan stays whatever rank 1 does;
* adaptive: ``adapt=True`` - rank 1, x3 off its prediction, is re-timed from its measured busy time
  after the first window of the slowdown, the plan re-solved and the state moved in place; on
  recovery it moves back;
* optimum: the offline optimum of the slowed cluster (the static run's calibrated cluster, rank 1's
  compute scale x the factor), pinned for the whole fit: MEASURED, so "within 10% of the optimum"
  compares two measurements; outside the slowdown the static run (the calibrated plan) is the
  original optimum.

The fits run in ``rounds``, the order rotated each round, so that a shared host's load, which drifts
over minutes, reaches every variant alike. Per window the table shows the median over rounds; per
phase (before the slowdown; slowed, from two watch intervals after it; recovered, from two
intervals after the recovery) the summary is the median over the phase's windows and rounds, and
the ratios are medians of per-round ratios (each compares fits minutes apart at most).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from benchmarks import _common as common
from benchmarks.harness import Benchmark


@dataclass(frozen=True)
class Config:
    emulate: tuple[float, ...] = (2.0, 3.0, 4.0)  # slowdowns of ranks 0..2 (see the module)
    slowed_rank: int = 1
    factor: float = 3.0
    global_batch: int = 24
    window: int = 3
    slow_from: int = 9  # global step at which the rank slows
    slow_until: int = 21  # ... and recovers
    steps: int = 33
    seq_len: int = 32
    threads: int = 1


    rounds: int = 3  # every variant once per round, the order rotated


QUICK = Config(window=2, slow_from=6, slow_until=14, steps=22, rounds=2)
VARIANTS = ("static", "adaptive", "optimum")


def _fit(cfg: Config, root: str, adapt: bool, plan: Any = None) -> dict[str, Any]:
    """One fit with the slowdown; ``plan``: pinned (no profile, no calibration, no switch)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from cephalo_lightning import CephaloCallback, CephaloStrategy
    from cephalo_lightning.demo import GPTModule, TextDataModule

    class Throttle(Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_rank == cfg.slowed_rank and trainer.global_step in (cfg.slow_from, cfg.slow_until):
                base = cfg.emulate[cfg.slowed_rank]
                trainer.strategy.emulator.slowdown = base * cfg.factor if trainer.global_step == cfg.slow_from else base

    watcher = CephaloCallback(max_micro_batch=4, cache_dir=f"{root}/profiles", watch_every_n_steps=cfg.window,
                              calibrate_after_windows=0 if plan is not None else 1, adapt=adapt, min_dwell_windows=1,
                              settings={"usable_memory_fraction": 0.9}, print_plan=False, quiet=True)
    emulate = [{"slowdown": s} for s in cfg.emulate]
    strategy = CephaloStrategy(emulate=emulate) if plan is None else CephaloStrategy(plan=plan, emulate=emulate,
                                                                                      mode=plan.mode)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu",
        devices=len(cfg.emulate), max_steps=cfg.steps, precision="32-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        use_distributed_sampler=False, callbacks=[watcher, Throttle()], default_root_dir=root,
    )
    pl.seed_everything(0, verbose=False)
    trainer.fit(GPTModule(preset="small", seq_len=cfg.seq_len, warmup_steps=2, lr_decay_steps=cfg.steps),
                TextDataModule(seq_len=cfg.seq_len, batch_size=cfg.global_batch))
    return {"history": [{"step": w["step"], "step_s": w["step_s"], "drifting": list(w["drifting"])}
                        for w in watcher.history],
            "switches": [{k: v for k, v in asdict(s).items() if k not in ("previous", "target")} for s in watcher._adapter.switches],
            "calibration": watcher.calibration}


def _rank_main(rank: int, world: int, cfg: Config, root: str) -> dict[str, Any]:
    from cephalo_lightning.planner import plan as make_plan

    common.quiet_lightning()
    common.pin_threads(cfg.threads)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    slowed_plan = None
    for r in range(cfg.rounds):
        order = common.rotated(VARIANTS, r) if r else list(VARIANTS)  # round 0: static first, it calibrates
        for name in order:
            if name == "optimum" and slowed_plan is None:
                static = runs["static"][0]["calibration"]
                slowed_plan = make_plan(_slowed(static.cluster, cfg), cfg.global_batch)
            runs[name].append(_fit(cfg, root, adapt=name == "adaptive", plan=slowed_plan if name == "optimum" else None))
    return {"runs": runs, "slowed_plan": slowed_plan}


def _slowed(cluster: Any, cfg: Config) -> Any:
    """The calibrated cluster with rank ``slowed_rank``'s compute scale x factor."""
    from cephalo_lightning.planner.cost.calibration import with_calibration

    cal = cluster.calibration
    scale = list(cal.compute_scale)
    scale[cfg.slowed_rank] *= cfg.factor
    return with_calibration(cluster, replace(cal, compute_scale=tuple(scale)))


def _phase(cfg: Config, step: int) -> str | None:
    """Which phase a window ending at ``step`` measures (None: warm-up, or within two intervals of a change)."""
    settle = 2 * cfg.window
    if step <= cfg.window:
        return None  # the first window counts every tensor
    if step <= cfg.slow_from:
        return "before"
    if cfg.slow_from + settle < step <= cfg.slow_until:
        return "slowed"
    if step > cfg.slow_until + settle:
        return "recovered"
    return None


def run_benchmark(cfg: Config = Config()) -> dict[str, Any]:
    from cephalo_lightning.planner import plan as make_plan

    start, load = time.perf_counter(), common.load_average()
    with tempfile.TemporaryDirectory() as root:
        per_rank = common.run_ranks(_rank_main, len(cfg.emulate), cfg, root, threads=cfg.threads)
    runs = per_rank[0]["runs"]
    static_cluster = runs["static"][0]["calibration"].cluster  # calibrated before the slowdown, never re-timed
    predicted = {"original": make_plan(static_cluster, cfg.global_batch).predicted_samples_per_s,
                 "slowed": per_rank[0]["slowed_plan"].predicted_samples_per_s}
    throughput = {name: [[cfg.global_batch / w["step_s"] for w in run["history"]] for run in runs[name]]
                  for name in VARIANTS}
    steps = [w["step"] for w in runs["static"][0]["history"]]
    rows = []
    for i, step in enumerate(steps):
        row = {"step": step, "slowed": cfg.slow_from < step <= cfg.slow_until, "phase": _phase(cfg, step)}
        for name in VARIANTS:
            row[f"{name}_samples_per_s"] = common.median([t[i] for t in throughput[name] if i < len(t)])
        rows.append(row)
    phases = {}
    for phase in ("before", "slowed", "recovered"):
        at = [i for i, step in enumerate(steps) if _phase(cfg, step) == phase]
        per_round = {name: [[t[i] for i in at if i < len(t)] for t in throughput[name]] for name in VARIANTS}
        summary = {f"{name}_samples_per_s": common.median([v for values in per_round[name] for v in values])
                   for name in VARIANTS}
        for a, b in (("adaptive", "static"), ("adaptive", "optimum"), ("static", "optimum")):
            summary[f"{a}/{b}"] = common.median([common.median(x) / common.median(y) for x, y in
                                                 zip(per_round[a], per_round[b]) if x and y])
        summary["windows"] = len(at)
        phases[phase] = summary
    return {"config": asdict(cfg), "rows": rows, "phases": phases, "predicted": predicted, "per_round": throughput,
            "slowed_plan": per_rank[0]["slowed_plan"].batch_sizes,
            "switches": [run["switches"] for run in runs["adaptive"]], "emulated": True,
            "drifting": [{w["step"]: w["drifting"] for w in run["history"] if w["drifting"]} for run in runs["adaptive"]],
            "environment": common.environment_note(cfg.threads), "wall_s": time.perf_counter() - start,
            "load_average": common.load_span(load)}


def print_report(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(f"EMULATED straggler on CPU: {len(cfg['emulate'])} gloo ranks (slowdowns {cfg['emulate']}); rank "
          f"{cfg['slowed_rank']} runs x{cfg['factor']:g} slower from step {cfg['slow_from']} to {cfg['slow_until']}; "
          f"{cfg['rounds']} rounds of static / adaptive / optimum fits, interleaved.")
    print(result["environment"])
    common.print_table(
        ["window end", "rank slowed", "phase", "static samples/s", "adaptive samples/s", "optimum samples/s",
         "adaptive / static", "adaptive / optimum"],
        [[r["step"], "yes" if r["slowed"] else "", r["phase"] or "-", f"{r['static_samples_per_s']:.1f}",
          f"{r['adaptive_samples_per_s']:.1f}", f"{r['optimum_samples_per_s']:.1f}",
          f"{r['adaptive_samples_per_s'] / r['static_samples_per_s']:.2f}",
          f"{r['adaptive_samples_per_s'] / r['optimum_samples_per_s']:.2f}"] for r in result["rows"]],
        title="Throughput per watch window (MEASURED, EMULATED; the median over rounds; optimum: the slowed "
              f"cluster's offline optimum b={result['slowed_plan']}, pinned)")
    common.print_table(
        ["phase", "windows", "static", "adaptive", "optimum", "adaptive / static", "adaptive / optimum",
         "static / optimum"],
        [[phase, p["windows"], f"{p['static_samples_per_s']:.1f}", f"{p['adaptive_samples_per_s']:.1f}",
          f"{p['optimum_samples_per_s']:.1f}", f"{p['adaptive/static']:.2f}", f"{p['adaptive/optimum']:.2f}",
          f"{p['static/optimum']:.2f}"] for phase, p in result["phases"].items()],
        title="Per phase (MEASURED samples/s, medians over windows and rounds; ratios: median of per-round ratios). "
              "Goal: slowed adaptive / optimum >= 0.90; recovered adaptive / static >= 0.90")
    print(f"  PREDICTED by the calibrated model: original optimum {result['predicted']['original']:.1f} samples/s, "
          f"slowed optimum {result['predicted']['slowed']:.1f} samples/s")
    for r, switches in enumerate(result["switches"]):
        drifting = result["drifting"][r]
        print(f"  round {r}: windows with drifting ranks (window end: ranks): "
              + (", ".join(f"{step}: {ranks}" for step, ranks in drifting.items()) or "none"))
        for s in switches:
            measured = "-" if s["measured_gain"] is None else f"{s['measured_gain']:+.1%}"
            print(f"  round {r}: switch at step {s['step']} ({s['reason']}): predicted {s['predicted_gain']:+.1%}, "
                  f"measured {measured}; now {s['plan']}")
    print(f"wall time {result['wall_s']:.0f} s; " + common.load_note(*result["load_average"]))


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--emulate", help="slowdowns of ranks 0..2, e.g. 1,1.5,2 (default 2,3,4)")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``--quick``: fewer steps."""
    os.environ.setdefault("WANDB_MODE", "disabled")
    cfg = QUICK if args.quick else Config()
    if args.emulate:
        cfg = replace(cfg, emulate=tuple(float(v) for v in args.emulate.split(",")))
    return run_benchmark(cfg)


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
