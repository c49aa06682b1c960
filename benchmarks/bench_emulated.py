"""Emulated heterogeneous cluster benchmark: the Cephalo plan vs the even and proportional plans.

    python -m benchmarks.bench_emulated              # 2 ranks as configs/quickstart.yaml, 3 rounds; a few minutes
    python -m benchmarks.bench_emulated --quick      # 2 rounds, fewer batches; about a minute
    python -m benchmarks.bench_emulated --world 3    # 3 ranks: x1 small memory, x2 and x3 large memory
    python -m benchmarks.bench_emulated --json -     # the result as JSON on stdout (--json PATH: to a file)

THE CLUSTER IS EMULATED ON CPU: every rank is a CPU process on one machine (gloo), made slower by
sleeping after each compute region (``slowdown``) and given an accounted memory capacity
(``memory_gb``) by :class:`~cephalo_lightning.runtime.emulation.emulator.DeviceEmulator`; no GPU is involved.
By default the ranks are those of ``configs/quickstart.yaml``: rank 0 fast with little memory
(x1, 0.02 GiB), rank 1 three times slower with plenty (x3, 0.5 GiB).

In one spawned group of ranks:

1. profile once: a 1-step ``Trainer.fit`` with :class:`~cephalo_lightning.CephaloCallback`, which
   profiles every (emulated) rank at setup and builds the planner's cluster;
2. plan that cluster three ways with ``planner.plan(cluster, B, planner=...)``: ``cephalo``,
   ``even`` and ``proportional`` (a baseline the planner finds infeasible is skipped, and why is
   printed);
3. train the demo GPT with each plan through ``Trainer.fit`` (``CephaloStrategy(plan=..., emulate=...)``),
   R rounds of one short fit per plan, the order rotated each round, same data and seed.

Figures: MEASURED samples/s = B / median iteration time (``on_train_batch_end`` to the next one,
max over the ranks per batch; the first ``warmup`` batches of every fit are skipped, which also
skips the steps where the emulated capacity is checked by counting every tensor); PREDICTED
samples/s = the planner's cost model on the profiled (emulated) cluster. Measured ratios are medians
of per-round ratios (fits run seconds apart); predicted ratios come from the same plans.

``run_benchmark()`` returns the rows as data; ``main()`` prints the tables.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks import _common as common
from benchmarks.harness import Benchmark
from cephalo_lightning.planner.cost.cluster_cost import predicted_busy_s  # noqa: E402 - torch-free

PLANS = ("cephalo", "even", "proportional")
# per world size: (slowdown, memory_gb) per rank; W=2 is configs/quickstart.yaml's cluster
EMULATE: dict[int, tuple[tuple[float, float | None], ...]] = {
    2: ((1.0, 0.02), (3.0, 0.5)),
    3: ((1.0, 0.02), (2.0, 0.5), (3.0, 0.5)),
}


@dataclass(frozen=True)
class Config:
    world: int = 2
    emulate: tuple[tuple[float, float | None], ...] = field(default_factory=lambda: EMULATE[2])
    # the demo GPT as in configs/quickstart.yaml (small preset: 4 blocks x 128, ~0.9M parameters)
    preset: str = "small"
    seq_len: int = 64
    global_batch: int = 32
    profile_k: int = 8  # profiled micro-batch sizes 1..k (quickstart: 8)
    usable_memory_fraction: float = 0.9
    rounds: int = 3
    warmup: int = 3  # >= 3: the strategy counts every tensor (slow) in steps 0-2 under a memory cap
    measured: int = 8
    threads: int = 1
    plans: tuple[str, ...] = PLANS


QUICK = Config(rounds=2, measured=5)


def emulate_specs(cfg: Config) -> list[dict[str, float]]:
    return [{"slowdown": s, **({"memory_gb": m} if m is not None else {})} for s, m in cfg.emulate]


def _module(cfg: Config):
    from cephalo_lightning.demo import GPTModule

    module = GPTModule(preset=cfg.preset, seq_len=cfg.seq_len, warmup_steps=2, lr_decay_steps=cfg.warmup + cfg.measured)
    module.configure_model()  # built now, from the seed: every strategy compared starts from the same weights
    return module


def _trainer(cfg: Config, strategy, steps: int, callbacks: list):
    import lightning.pytorch as pl

    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=cfg.world, max_steps=steps, precision="32-true",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=callbacks,
    )


def _datamodule(cfg: Config):
    from cephalo_lightning.demo import TextDataModule

    return TextDataModule(seq_len=cfg.seq_len, batch_size=cfg.global_batch)


def profile(cfg: Config):
    """Profile the emulated ranks once through the callback (a 1-step fit); the planner's cluster."""
    import lightning.pytorch as pl

    from cephalo_lightning import CephaloCallback, CephaloStrategy

    callback = CephaloCallback(max_micro_batch=cfg.profile_k, cache_dir=None, watch_every_n_steps=0,
                               settings={"usable_memory_fraction": cfg.usable_memory_fraction},
                               print_plan=False, quiet=True)
    pl.seed_everything(0, verbose=False)
    trainer = _trainer(cfg, CephaloStrategy(emulate=emulate_specs(cfg)), 1, [callback])
    trainer.fit(_module(cfg), _datamodule(cfg))
    assert callback.cluster is not None
    return callback.cluster


def make_plans(cfg: Config, cluster) -> tuple[dict[str, Any], dict[str, str]]:
    """Each requested plan of the profiled cluster, and why any infeasible one was skipped."""
    from cephalo_lightning.planner import PlanningError
    from cephalo_lightning.planner import plan as make_plan

    plans, skipped = {}, {}
    for name in cfg.plans:
        try:
            plans[name] = make_plan(cluster, cfg.global_batch, mode="layered", planner=name)
        except PlanningError as err:
            skipped[name] = str(err)
    return plans, skipped


def fit_plan(cfg: Config, plan, warmup: int, measured: int) -> dict[str, Any]:
    """Train with ``plan`` on the emulated ranks; this rank's per-batch times, warm-up skipped."""
    import lightning.pytorch as pl

    from cephalo_lightning import CephaloStrategy

    timer = common.step_timer()
    busy = _busy_recorder()
    pl.seed_everything(0, verbose=False)
    trainer = _trainer(cfg, CephaloStrategy(plan=plan, emulate=emulate_specs(cfg)), warmup + measured, [timer, busy])
    trainer.fit(_module(cfg), _datamodule(cfg))
    # this rank's own figures; the caller combines the ranks (no collective here, see _common)
    return {"step_s": timer.step_s(warmup), "iteration_s": timer.iteration_s(warmup),
            "busy_s": common.median(busy.per_step[warmup:]),
            "loss": float(trainer.callback_metrics.get("train_loss", float("nan")))}


def _busy_recorder():
    """Per batch, the seconds this rank spent in compute regions (the emulated waits included):
    a :class:`~cephalo_lightning.runtime.timing.BusyTime` observer attached outside the emulator."""
    from lightning.pytorch.callbacks import Callback

    from cephalo_lightning.runtime.timing import BusyTime

    class Busy(Callback):
        def __init__(self) -> None:
            self.per_step: list[float] = []
            self.busy = BusyTime()
            self._start = 0.0

        def on_train_start(self, trainer, pl_module) -> None:
            trainer.strategy.sharded.observers.attach(self.busy, outermost=True)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._start = self.busy.seconds

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.per_step.append(self.busy.seconds - self._start)

    return Busy()


def interleaved_fits(cfg: Config, plans: dict[str, Any], rounds: int, warmup: int, measured: int
                     ) -> tuple[dict[str, list[dict[str, Any]]], list[list[str]]]:
    """``rounds`` rounds of one fit per plan, the order rotated every round (same seed and data)."""
    fits: dict[str, list[dict[str, Any]]] = {name: [] for name in plans}
    order = []
    for i in range(rounds):
        names = common.rotated(list(plans), i)
        order.append(names)
        for name in names:
            fits[name].append(fit_plan(cfg, plans[name], warmup, measured))
    return fits, order


def _rank_main(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    common.quiet_lightning()
    common.pin_threads(cfg.threads)
    start = time.perf_counter()
    cluster = profile(cfg)
    profile_s = time.perf_counter() - start
    plans, skipped = make_plans(cfg, cluster)
    fits, order = interleaved_fits(cfg, plans, cfg.rounds, cfg.warmup, cfg.measured)
    return {"cluster": cluster, "plans": plans, "skipped": skipped, "fits": fits, "order": order,
            "profile_s": profile_s}


# ----------------------------------------------------------------------------- rows


def throughput(global_batch: int, fits: list[dict[str, Any]]) -> dict[str, Any]:
    per_round = [global_batch / common.median(f["iteration_s"]) for f in fits]
    pooled = global_batch / common.median([t for f in fits for t in f["iteration_s"]])
    return {"per_round": per_round, "samples_per_s": pooled,
            "step_ms": 1e3 * common.median([t for f in fits for t in f["step_s"]])}


def summarize(cfg: Config, cluster, plans: dict[str, Any], fits: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    rows = []
    for name, plan in plans.items():
        measured = throughput(cfg.global_batch, fits[name])
        predicted = plan.predicted_samples_per_s
        busy = [common.median([f["busy_s"][r] for f in fits[name]]) for r in range(plan.world_size)]
        rows.append({
            "measured_busy_s": busy, "predicted_busy_s": predicted_busy_s(cluster, plan),
            "predicted_step_s": plan.predicted_step_s,
            "plan": name, "batch_sizes": plan.batch_sizes, "micro_batches": plan.num_micro_batches,
            "state_shares": plan.state_shares, "predicted_samples_per_s": predicted,
            "measured_samples_per_s": measured["samples_per_s"], "per_round_samples_per_s": measured["per_round"],
            "median_step_ms": measured["step_ms"],
            "measured_over_predicted": measured["samples_per_s"] / predicted if predicted else None,
            "final_loss": [f["loss"] for f in fits[name]],
        })
    by = {r["plan"]: r for r in rows}
    ratios = []
    if "cephalo" in by:
        for other in ("even", "proportional"):
            if other not in by:
                continue
            a, b = by["cephalo"], by[other]
            per_round = [x / y for x, y in zip(a["per_round_samples_per_s"], b["per_round_samples_per_s"])]
            ratios.append({
                "ratio": f"cephalo / {other}",
                "measured_paired": common.median(per_round),
                "measured_pooled": a["measured_samples_per_s"] / b["measured_samples_per_s"],
                "min_round": min(per_round), "max_round": max(per_round),
                "predicted": a["predicted_samples_per_s"] / b["predicted_samples_per_s"],
            })
    return {"plans": rows, "ratios": ratios}


def run_benchmark(cfg: Config = Config()) -> dict[str, Any]:
    """Profile, plan and the interleaved fits, as plain data (one spawn of ``cfg.world`` gloo ranks)."""
    if len(cfg.emulate) != cfg.world:
        raise ValueError(f"emulate has {len(cfg.emulate)} ranks but world is {cfg.world}")
    start, load = time.perf_counter(), common.load_average()
    per_rank = common.run_ranks(_rank_main, cfg.world, cfg, threads=cfg.threads)
    r0 = per_rank[0]
    fits = common.max_over_rank_results([r["fits"] for r in per_rank], ("step_s", "iteration_s"))
    for name, per_fit in fits.items():  # busy time stays per rank
        for i, fit in enumerate(per_fit):
            fit["busy_s"] = [r["fits"][name][i]["busy_s"] for r in per_rank]
    cluster = r0["cluster"]
    devices = [{"rank": i, "device": d.name, "emulate": asdict(d.emulate) if d.emulate else None,
                "memory_gb": d.memory_gb} for i, d in enumerate(cluster.devices)]
    from cephalo_lightning.planner.report import render_plan

    result = {
        "config": asdict(cfg), "environment": common.environment_note(cfg.threads), "emulated": True,
        "world_size": cfg.world, "cores": os.cpu_count(),
        "devices": devices, "skipped": r0["skipped"], "order": r0["order"], "profile_s": r0["profile_s"],
        "plan_tables": {name: render_plan(p) for name, p in r0["plans"].items()},
        **summarize(cfg, cluster, r0["plans"], fits),
    }
    result["wall_s"] = time.perf_counter() - start
    result["load_average"] = common.load_span(load)
    return result


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_report(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print("EMULATED heterogeneous cluster on CPU: every rank is a CPU process on this machine (gloo), slowed by "
          "sleeping and\ngiven an accounted memory capacity; none of these figures comes from a GPU.")
    print(result["environment"])
    for d in result["devices"]:
        print(f"  rank {d['rank']}: {d['device']}  (emulate {d['emulate']})")
    print(f"demo GPTModule ({cfg['preset']}), seq {cfg['seq_len']}, global batch {cfg['global_batch']}, AdamW, 32-true, "
          f"layered mode, pydoc corpus; profiled once at setup (CephaloCallback, micro-batches 1..{cfg['profile_k']}, "
          f"{result['profile_s']:.1f} s incl. a 1-step fit).\n")
    print(result["plan_tables"].get("cephalo", ""))
    for name, why in result["skipped"].items():
        print(f"skipped the {name} plan (the planner finds it infeasible): {why}")
    if result["skipped"]:
        print()
    common.print_table(
        ["plan", "batch per rank", "micro-batches", "state shares", "predicted samples/s", "measured samples/s",
         "measured / predicted", "per-round measured"],
        [[r["plan"], r["batch_sizes"], r["micro_batches"], "/".join(f"{s:.2f}" for s in r["state_shares"]),
          _fmt(r["predicted_samples_per_s"], ".1f"), f"{r['measured_samples_per_s']:.1f}",
          _fmt(r["measured_over_predicted"]), " ".join(f"{v:.1f}" for v in r["per_round_samples_per_s"])]
         for r in result["plans"]],
        title=(f"Throughput per plan (EMULATED cluster): {cfg['rounds']} rounds x one fit per plan, order rotated; "
               f"{cfg['warmup']} warm-up + {cfg['measured']} measured batches per fit"),
    )
    rows = []
    for r in result["plans"]:
        for rank, (m, p) in enumerate(zip(r["measured_busy_s"], r["predicted_busy_s"])):
            rows.append([r["plan"] if rank == 0 else "", rank, r["batch_sizes"][rank], r["micro_batches"][rank],
                         f"{1e3 * p:.1f}", f"{1e3 * m:.1f}", _fmt(m / p if p else None),
                         f"{r['median_step_ms']:.1f}" if rank == 0 else "",
                         _fmt(1e3 * r["predicted_step_s"] if r["predicted_step_s"] else None, ".1f") if rank == 0 else ""])
    common.print_table(
        ["plan", "rank", "b_i", "n_i", "predicted busy ms", "measured busy ms", "busy meas./pred.", "measured step ms",
         "predicted step ms"],
        rows,
        title=("Where the time goes (EMULATED): per rank, compute regions per step (the emulated waits included), "
               "predicted vs measured; medians"),
    )
    print("busy above prediction: the rank's real compute ran slower than when it was profiled (the profile runs "
          "the ranks in turns;\nin training they compute at once, beside other programs). step above the slowest "
          "rank's busy: collectives (gloo\non CPU does not overlap them with compute, the cost model assumes it "
          "does), the optimizer step and Lightning's loop.\n")
    common.print_table(
        ["ratio", "measured (paired)", "measured (pooled)", "rounds min..max", "predicted", "measured / predicted"],
        [[r["ratio"], f"{r['measured_paired']:.2f}", f"{r['measured_pooled']:.2f}",
          f"{r['min_round']:.2f}..{r['max_round']:.2f}", f"{r['predicted']:.2f}",
          f"{r['measured_paired'] / r['predicted']:.2f}"] for r in result["ratios"]],
        title="Speed-up of the Cephalo plan, measured on the EMULATED cluster next to the planner's prediction",
    )
    print("measured samples/s = global batch / median iteration time (batch end to batch end, max over ranks); "
          "predicted = the planner's\ncost model on the profiled (emulated) cluster. Ratios > 1: the Cephalo plan "
          "trains faster.")
    if result["world_size"] > (result["cores"] or 0):
        print(f"NOTE: {result['world_size']} ranks on {result['cores']} cores: the ranks' real compute competes for "
              "cores, so measured falls further below predicted.")
    print(f"wall time of the run: {result['wall_s']:.1f} s; " + common.load_note(*result["load_average"]))


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, choices=sorted(EMULATE), default=2, help="number of emulated ranks")
    parser.add_argument("--rounds", type=int, help="override the number of rounds")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``--quick``: 2 rounds, fewer batches (about a minute)."""
    overrides: dict[str, Any] = {"world": args.world, "emulate": EMULATE[args.world]}
    if args.rounds:
        overrides["rounds"] = args.rounds
    return run_benchmark(Config(**{**asdict(QUICK if args.quick else Config()), **overrides}))


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
