"""``python -m cephalo_lightning demo``: the quickstart, end to end, on an emulated CPU cluster.

Runs ``cephalo-train fit --config quickstart`` (the copy of ``configs/quickstart.yaml`` shipped in
the package: profile, plan table, training with a progress bar, a checkpoint, an offline W&B
run, or CSV metrics when wandb is not installed), then trains briefly with a baseline plan in the
same processes, so the Cephalo plan's throughput is measured side by side with the baseline's, and
prints a summary with the measured speed-up. Extra arguments go to the CLI (e.g. ``--trainer.max_steps=40``).

The baseline (:func:`fair_baseline`) is the even plan, what plain FSDP runs: every rank the same
batch and the same share of the state, at the fewest micro-batches of one common count that fit
(gradient accumulation raised until the step fits, as a person would with FSDP). It is the fair
comparison because it is the plan one would run without a planner, on the same ranks, model,
global batch, emulation and runtime, measured in the same processes minutes apart; where it fits at
no micro-batch count, the fastest other baseline the planner prices that fits is used, and named.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cephalo_lightning import configs
from cephalo_lightning._common.help_text import PlainRawDescriptionHelpFormatter
from cephalo_lightning._common.vocabulary import Planner, Schedule
from cephalo_lightning.planner import Cluster, Plan, PlanningError
from cephalo_lightning.planner import plan as make_plan
from cephalo_lightning.planner.search.peers import BASELINE_GROUPINGS, BASELINES


@dataclass(frozen=True)
class Baseline:
    """The plan the demo measures the Cephalo plan against, and what it is, in words."""

    plan: Plan
    described: str


def fair_baseline(cluster: Cluster, global_batch_size: int, mode: Schedule = Schedule.LAYERED) -> Baseline | str:
    """The even plan (module docstring); where it cannot fit, the fastest feasible baseline of the
    planner. A string: no baseline fits (the even plan's reason)."""
    try:
        even = make_plan(cluster, global_batch_size, mode=mode, planner=Planner.EVEN)
    except PlanningError as err:
        refused = str(err).splitlines()[0]
    else:
        micro = max(even.num_micro_batches)
        sizes = "-".join(map(str, sorted({m for r in even.ranks for m in r.micro_batch_sizes if m})))
        split = f"{micro} micro-batches of {sizes} samples to fit" if micro > 1 else "one micro-batch each"
        return Baseline(even, f"even plan (FSDP's: equal batches and state shares, {split})")
    fitting = []
    for name in BASELINES:
        if name == Planner.EVEN:
            continue
        try:
            fitting.append(make_plan(cluster, global_batch_size, mode=mode, planner=Planner(name)))
        except PlanningError:
            continue
    if not fitting:
        return refused
    best = max(fitting, key=lambda p: p.predicted_samples_per_s or 0.0)
    return Baseline(best, f"{best.planner.value} plan ({BASELINE_GROUPINGS[best.planner]}; the even plan does not fit: "
                          f"{refused})")


def _baseline_run(cli, steps: int) -> tuple[Baseline, dict] | str | None:
    """Train ``steps`` steps with :func:`fair_baseline` of the profiled cluster: the baseline and its
    callback summary, why none fits, or None (nothing profiled)."""
    import lightning.pytorch as pl

    from cephalo_lightning import CephaloCallback, CephaloStrategy

    strategy = cli.trainer.strategy
    if strategy.cluster is None:
        return None
    baseline = fair_baseline(strategy.cluster, strategy.plan.global_batch_size, strategy.plan.mode)
    if isinstance(baseline, str):
        return baseline
    watcher = CephaloCallback(print_plan=False, quiet=True, watch_every_n_steps=0)
    trainer = pl.Trainer(
        strategy=CephaloStrategy(plan=baseline.plan, emulate=strategy.emulate), accelerator=cli.trainer.accelerator,
        devices=cli.trainer.num_devices, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[watcher],
    )
    hparams = {k: v for k, v in cli.model.hparams.items() if not k.startswith("_")}  # the CLI adds _class_path
    trainer.fit(type(cli.model)(**hparams), cli.datamodule)
    return (baseline, watcher.summary) if getattr(watcher, "summary", None) else None


def speed_up_lines(summary: dict, baseline: Baseline, measured: dict) -> list[str]:
    """The baseline's measured throughput and the measured speed-up over it (a benchmark figure of
    one run on an emulated CPU cluster, not a test)."""
    ratio = summary["measured_samples_per_s"] / measured["measured_samples_per_s"]
    predicted = summary["predicted_samples_per_s"] / measured["predicted_samples_per_s"]
    return [f"  baseline:     the {baseline.described}",
            f"                {measured['measured_samples_per_s']:.1f} samples/s measured side by side, "
            f"{measured['predicted_samples_per_s']:.1f} predicted",
            f"  speed-up:     Cephalo is {ratio:.2f}x faster than the baseline, measured on the CPU-emulated cluster "
            f"(predicted {predicted:.2f}x)"]


def _report(cli, baseline: tuple[Baseline, dict] | str | None) -> str:
    from cephalo_lightning.lightning.cli_loggers import INSTALL_HINT

    trainer = cli.trainer
    summary = next(cb for cb in trainer.callbacks if type(cb).__name__ == "CephaloCallback").summary
    lines = ["", "=" * 78, "Cephalo demo: done (all times measured on an EMULATED heterogeneous CPU cluster)"]
    measured = summary["measured_samples_per_s"]
    lines.append(f"  Cephalo plan: {measured:.1f} samples/s measured, {summary['predicted_samples_per_s']:.1f} "
                 f"predicted from the profile (measured / predicted = {measured / summary['predicted_samples_per_s']:.2f})")
    calibrated = summary.get("calibrated_predicted_step_s")
    if calibrated:
        after = summary["global_batch_size"] / calibrated
        lines.append(f"                {after:.1f} samples/s predicted after calibration on the run's first steps "
                     f"(measured / predicted = {measured / after:.2f})")
    if isinstance(baseline, str):
        lines.append(f"  baseline:     none fits here ({baseline})")
    elif baseline is not None:
        lines.extend(speed_up_lines(summary, *baseline))
    metrics = trainer.callback_metrics
    if "train_loss_epoch" in metrics or "train_loss_step" in metrics:
        lines.append(f"  loss:         {float(metrics.get('train_loss_step', metrics.get('train_loss_epoch'))):.3f} "
                     f"at step {trainer.global_step} (ln 256 = 5.545 at the start)")
    for cb in trainer.callbacks:
        if type(cb).__name__ == "ModelCheckpoint" and cb.last_model_path:
            lines.append(f"  checkpoint:   {cb.last_model_path} (sharded; see docs/checkpoints.md)")
    for logger in trainer.loggers:
        if type(logger).__name__ == "WandbLogger":
            lines.append(f"  W&B run:      {logger.experiment.dir} (offline; `wandb sync` to upload)")
        elif type(logger).__name__ == "CSVLogger":
            lines.append(f"  metrics:      {logger.log_dir}/metrics.csv (for W&B: {INSTALL_HINT})")
    lines.append("=" * 78)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cephalo_lightning demo", description=__doc__,
                                     formatter_class=PlainRawDescriptionHelpFormatter)
    parser.add_argument("--config", default="quickstart",
                        help="LightningCLI config file or packaged config name (default: the quickstart)")
    parser.add_argument("--baseline-steps", "--even-steps", type=int, default=20, dest="baseline_steps",
                        help="steps of the baseline comparison, the even plan where it fits (0: skip)")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    args.config = configs.resolve(args.config)
    if not Path(args.config).is_file():
        parser.error(f"{args.config} not found: pass a config file, or one of the packaged configs "
                     f"({', '.join(configs.names())})")
    os.environ.setdefault("WANDB_MODE", "offline")  # no account, no network

    from cephalo_lightning.lightning.cli import run_cli

    cli = run_cli(["fit", "--config", args.config, *rest])
    baseline = _baseline_run(cli, args.baseline_steps) if args.baseline_steps > 0 else None
    if cli.trainer.is_global_zero:
        print(_report(cli, baseline), flush=True)
    return 0
