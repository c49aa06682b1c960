"""A straggler mid-run: throughput per watch window of the static plan against the adaptive one.

    python benchmarks/bench_straggler.py            # 3 EMULATED ranks, rank 1 slows x3 at step S, recovers at S2
    python benchmarks/bench_straggler.py --quick

THE CLUSTER IS EMULATED ON CPU: three gloo processes on this machine, slowed by sleeping after each
compute region (:class:`~cephalo_lightning.runtime.emulation.emulator.DeviceEmulator`); no GPU.

In one spawned group of ranks, two fits of the same model and data, each with ``CephaloCallback``
(profiled once, the second fit reads the cached profile; calibrated after the first windows):

* static: ``adapt=False`` - the plan stays whatever rank 1 does;
* adaptive: ``adapt=True`` - rank 1 drifting two windows in a row is re-timed from its measured
  busy time, the plan re-solved and the state moved in place; on recovery it moves back.

Per window it prints the MEASURED samples/s of both runs, and the PREDICTED optimum of the cluster
as it is in that window (the calibrated cluster, rank 1's compute scale x3 while it is slowed), so
"within 10% of the optimum" reads as measured adaptive / predicted optimum.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

try:
    import cephalo_lightning  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as common


@dataclass(frozen=True)
class Config:
    emulate: tuple[float, ...] = (1.0, 1.5, 2.0)  # slowdowns of ranks 0..2
    slowed_rank: int = 1
    factor: float = 3.0
    global_batch: int = 24
    window: int = 3
    slow_from: int = 9  # global step at which the rank slows
    slow_until: int = 21  # ... and recovers
    steps: int = 33
    seq_len: int = 32
    threads: int = 1


QUICK = Config(window=2, slow_from=6, slow_until=14, steps=22)


def _fit(cfg: Config, root: str, adapt: bool) -> dict[str, Any]:
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
                              calibrate_after_windows=1, adapt=adapt, min_dwell_windows=1,
                              settings={"usable_memory_fraction": 0.9}, print_plan=False, quiet=True)
    trainer = pl.Trainer(
        strategy=CephaloStrategy(emulate=[{"slowdown": s} for s in cfg.emulate]), accelerator="cpu",
        devices=len(cfg.emulate), max_steps=cfg.steps, precision="32-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        use_distributed_sampler=False, callbacks=[watcher, Throttle()], default_root_dir=root,
    )
    pl.seed_everything(0, verbose=False)
    trainer.fit(GPTModule(preset="small", seq_len=cfg.seq_len, warmup_steps=2, lr_decay_steps=cfg.steps),
                TextDataModule(seq_len=cfg.seq_len, batch_size=cfg.global_batch))
    return {"history": watcher.history, "switches": [asdict(s) for s in watcher._adapter.switches],
            "cluster": watcher.cluster, "calibration": watcher.calibration}


def _rank_main(rank: int, world: int, cfg: Config, root: str) -> dict[str, Any]:
    common.quiet_lightning()
    common.pin_threads(cfg.threads)
    static = _fit(cfg, root, adapt=False)
    adaptive = _fit(cfg, root, adapt=True)
    return {"static": static, "adaptive": adaptive}


def _optimum(cluster: Any, cfg: Config, slowed: bool) -> float:
    """Predicted samples/s of the best plan for the calibrated cluster, rank ``slowed_rank`` x factor or not."""
    from cephalo_lightning.planner import plan as make_plan
    from cephalo_lightning.planner.calibration import with_calibration

    cal = cluster.calibration
    if slowed:
        scale = list(cal.compute_scale)
        scale[cfg.slowed_rank] *= cfg.factor
        cluster = with_calibration(cluster, replace(cal, compute_scale=tuple(scale)))
    return make_plan(cluster, cfg.global_batch).predicted_samples_per_s


def run_benchmark(cfg: Config = Config()) -> dict[str, Any]:
    start, load = time.perf_counter(), common.load_average()
    with tempfile.TemporaryDirectory() as root:
        per_rank = common.run_ranks(_rank_main, len(cfg.emulate), cfg, root, threads=cfg.threads)
    r0 = per_rank[0]
    static_cluster = r0["static"]["calibration"].cluster  # calibrated before the slowdown, never re-timed
    original, slowed = _optimum(static_cluster, cfg, False), _optimum(static_cluster, cfg, True)
    rows = []
    for s, a in zip(r0["static"]["history"], r0["adaptive"]["history"]):
        step = s["step"]
        in_slow = cfg.slow_from < step <= cfg.slow_until
        rows.append({"step": step, "slowed": in_slow, "static_samples_per_s": cfg.global_batch / s["step_s"],
                     "adaptive_samples_per_s": cfg.global_batch / a["step_s"],
                     "predicted_optimum_samples_per_s": slowed if in_slow else original})
    return {"config": asdict(cfg), "rows": rows, "switches": r0["adaptive"]["switches"], "emulated": True,
            "environment": common.environment_note(cfg.threads), "wall_s": time.perf_counter() - start,
            "load_average": (load, common.load_average())}


def print_report(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(f"EMULATED straggler on CPU: {len(cfg['emulate'])} gloo ranks (slowdowns {cfg['emulate']}); rank "
          f"{cfg['slowed_rank']} runs x{cfg['factor']:g} slower from step {cfg['slow_from']} to {cfg['slow_until']}.")
    print(result["environment"])
    common.print_table(
        ["window end", "rank slowed", "static samples/s", "adaptive samples/s", "adaptive / static",
         "predicted optimum", "adaptive / optimum"],
        [[r["step"], "yes" if r["slowed"] else "", f"{r['static_samples_per_s']:.1f}", f"{r['adaptive_samples_per_s']:.1f}",
          f"{r['adaptive_samples_per_s'] / r['static_samples_per_s']:.2f}", f"{r['predicted_optimum_samples_per_s']:.1f}",
          f"{r['adaptive_samples_per_s'] / r['predicted_optimum_samples_per_s']:.2f}"] for r in result["rows"]],
        title="Throughput per watch window (MEASURED, EMULATED; optimum PREDICTED by the calibrated model)")
    for s in result["switches"]:
        measured = "-" if s["measured_gain"] is None else f"{s['measured_gain']:+.1%}"
        print(f"  switch at step {s['step']} ({s['reason']}): predicted {s['predicted_gain']:+.1%}, measured {measured}; "
              f"now {s['plan']}")
    print(f"wall time {result['wall_s']:.0f} s; " + common.load_note(*result["load_average"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "disabled")
    result = run_benchmark(QUICK if args.quick else Config())
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print_report(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
