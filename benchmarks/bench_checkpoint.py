"""Checkpoint benchmark: what a save costs the training loop, synchronous vs in the background.

    python -m benchmarks.bench_checkpoint            # 2 ranks, 3 rounds of 3 fits, then the kill loop
    python -m benchmarks.bench_checkpoint --quick    # 1 round, a smaller model
    python -m benchmarks.bench_checkpoint --no-kills # the step times only

1. Step time: the demo GPT (AdamW) on 2 gloo ranks under an uneven plan, ``ModelCheckpoint`` every
   ``--every`` steps, three fits per round in alternating order: no checkpoints, synchronous saves,
   ``async_checkpoint=True``. Each iteration is timed from one ``on_train_batch_start`` to the
   next, so a save made in ``on_train_batch_end`` counts in its step. Printed: the median of a
   normal step (no saves), of a step ending in a synchronous save, of a step ending in a
   background save (training blocked for the snapshot to host memory, and for the previous save
   if it was still being written), of a step run while a background write was in flight; and
   their ratios to the normal step. MEASURED on CPU: the background writer's serialisation and
   hashing compete with training for the same cores here, which they would not on a GPU node.
2. Kill loop: every instrumented point of ``scenarios/kill_points.py`` (the suite's instrumentation:
   run from a checkout), each kill landing in the background writer's thread, each run resuming
   from the previous one's ``last.ckpt``; after each kill everything that looks like a checkpoint
   must verify and ``last.ckpt`` must be complete. Printed: kills, the threads they landed in,
   and the verdict.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
from benchmarks import _common as common
from benchmarks.harness import Benchmark

VARIANTS = ("none", "sync", "async")


def _timer_and_flags() -> Any:
    from lightning.pytorch.callbacks import Callback

    class Iterations(Callback):
        """Per iteration: wall time start -> next start, whether it ended in a save, whether a
        background write was in flight when it started."""

        def __init__(self, every: int) -> None:
            self.every = every
            self.starts: list[float] = []
            self.in_flight: list[bool] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            common.barrier()  # every rank's iteration, as the slowest sees it
            self.starts.append(time.perf_counter())
            writer = trainer.strategy.fit_runtime.checkpoints.writer
            self.in_flight.append(writer is not None and writer.in_flight)

        def rows(self, skip: int) -> list[tuple[float, bool, bool]]:
            out = []
            for i, (a, b) in enumerate(zip(self.starts, self.starts[1:])):
                saved = (i + 1) % self.every == 0
                out.append((b - a, saved, self.in_flight[i]))
            return out[skip:]

    return Iterations


def _fits(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from cephalo_lightning import CephaloStrategy, Plan
    from cephalo_lightning.demo.module import GPTModule
    from cephalo_lightning.planner import RankPlan

    common.quiet_lightning()
    common.pin_threads(1)
    g = config["global_batch"]
    plan = Plan(g, "layered", (RankPlan(0, "a", g * 3 // 4, 1, g * 3 // 4, 0.6),
                               RankPlan(1, "b", g - g * 3 // 4, 1, g - g * 3 // 4, 0.4)))
    data = torch.randint(0, 256, (g * (config["steps"] + 2), config["seq_len"] + 1),
                         generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=g)
    Iterations = _timer_and_flags()
    rows: dict[str, list[tuple[float, bool, bool]]] = {v: [] for v in VARIANTS}
    times = []
    for round_ in range(config["rounds"]):
        order = VARIANTS[round_ % 3:] + VARIANTS[: round_ % 3]
        for variant in order:
            folder = Path(config["root"]) / f"{variant}-{round_}"
            timer = Iterations(config["every"])
            callbacks: list[Any] = [timer]
            if variant != "none":
                callbacks.append(ModelCheckpoint(dirpath=str(folder), every_n_train_steps=config["every"],
                                                 save_top_k=-1, filename="{step}"))
            trainer = pl.Trainer(
                strategy=CephaloStrategy(plan=plan, async_checkpoint=variant == "async"), accelerator="cpu",
                devices=world, max_steps=config["steps"], logger=False, enable_progress_bar=False,
                enable_model_summary=False, enable_checkpointing=variant != "none", callbacks=callbacks,
                default_root_dir=str(folder), use_distributed_sampler=False)
            module = GPTModule(n_layer=config["n_layer"], n_head=4, n_embd=config["n_embd"],
                               seq_len=config["seq_len"])
            trainer.fit(module, loader)
            rows[variant] += timer.rows(skip=2)
            writer = trainer.strategy.fit_runtime.checkpoints.writer
            if writer is not None:
                times += [(t.snapshot_s, t.write_s) for t in writer.times]
    return {"rows": rows, "times": times}


def step_times(config: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        results = common.run_ranks(_fits, 2, {**config, "root": root})
    rows, times = results[0]["rows"], results[0]["times"]
    normal = [t for t, _, _ in rows["none"]]
    sync_save = [t for t, saved, _ in rows["sync"] if saved]
    async_save = [t for t, saved, _ in rows["async"] if saved]
    overlapped = [t for t, saved, flight in rows["async"] if flight and not saved]
    base = common.median(normal)
    out = {
        "normal step": (common.median(normal), len(normal)),
        "step + synchronous save": (common.median(sync_save), len(sync_save)),
        "step + background save submitted (snapshot)": (common.median(async_save), len(async_save)),
        "step while a background write runs": (common.median(overlapped), len(overlapped)),
    }
    return {"rows": {k: (v, n, v / base) for k, (v, n) in out.items()},
            "snapshot_s": common.median([s for s, _ in times]), "write_s": common.median([w for _, w in times])}


def kill_loop(workdir: Path) -> dict[str, Any]:
    from cephalo_lightning.runtime.checkpoint.async_save import THREAD_NAME
    from scenarios import kill_points

    points = kill_points.points_here(workdir)
    seen = kill_points.kill_loop(workdir, points, background=True)
    return {"kills": seen.kills, "threads": list(seen.threads), "complete_seen": seen.complete_seen,
            "interrupted": seen.interrupted, "background": all(t == THREAD_NAME for t in seen.threads)}


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--every", type=int, default=3, help="save every N steps")
    parser.add_argument("--no-kills", action="store_true", help="skip the kill loop")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    config = {"rounds": 1 if args.quick else 3, "steps": 14 if args.quick else 20, "every": args.every,
              "global_batch": 8, "seq_len": 64, "n_layer": 2 if args.quick else 4, "n_embd": 192 if args.quick else 320}
    before = common.load_average()
    result = {"config": config, "steps": step_times(config), "load": common.load_span(before)}
    if not args.no_kills:
        with tempfile.TemporaryDirectory() as work:
            result["kill_loop"] = kill_loop(Path(work))
    return result


def _verdict(kills: dict[str, Any]) -> str:
    return "PASS" if kills["background"] and kills["kills"] >= 10 else "FAIL"


def print_report(result: dict[str, Any]) -> None:
    config, steps = result["config"], result["steps"]
    print(common.environment_note(1))
    print(common.load_note(*result["load"]))
    print(f"Model: demo GPT, {config['n_layer']} layers, n_embd {config['n_embd']}, AdamW; 2 ranks at state shares "
          f"0.6 / 0.4; a save every {config['every']} steps; {config['rounds']} round(s) of 3 fits.\n")
    common.print_table(
        ["iteration", "median s", "n", "x normal step"],
        [(k, f"{v:.4f}", n, f"{r:.2f}") for k, (v, n, r) in steps["rows"].items()],
        title="Step time during checkpoint saves (MEASURED, CPU/gloo)")
    print(f"Background saves: snapshot (training blocked) median {steps['snapshot_s']:.4f} s, write (in the "
          f"background) median {steps['write_s']:.4f} s (MEASURED).\n")
    kills = result.get("kill_loop")
    if kills is not None:
        threads = kills["threads"]
        print(f"Kill loop (background saves): {kills['kills']} SIGKILLs at instrumented points, "
              f"{sum(t == threads[0] for t in threads)} in thread {threads[0]!r}; after every kill "
              f"the newest complete checkpoint loaded and verified, nothing that looked whole failed to verify "
              f"({kills['complete_seen']} complete checkpoints checked, {kills['interrupted']} kills left a save or "
              f"deletion under way): {_verdict(kills)}")


def exit_status(result: dict[str, Any]) -> int:
    """1 when the kill loop ran and failed."""
    return 1 if "kill_loop" in result and _verdict(result["kill_loop"]) == "FAIL" else 0


BENCHMARK = Benchmark(__doc__, measure, print_report, options, exit_status)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
