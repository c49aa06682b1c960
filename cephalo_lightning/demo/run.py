"""``python -m cephalo_lightning demo``: the quickstart, end to end, on an emulated CPU cluster.

Runs ``cephalo-train fit --config quickstart`` (the copy of ``configs/quickstart.yaml`` shipped in
the package: profile, plan table, training with a progress bar, a checkpoint, an offline W&B
run, or CSV metrics when wandb is not installed), then trains briefly with the planner's EVEN plan in the same processes, so the Cephalo
plan's throughput is measured side by side with the even baseline, and prints a summary. Extra arguments go to the CLI (e.g. ``--trainer.max_steps=40``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from cephalo_lightning import configs
from cephalo_lightning._common.help_text import PlainRawDescriptionHelpFormatter
from cephalo_lightning._common.vocabulary import Planner


def _even_run(cli, steps: int) -> dict | None:
    """Train ``steps`` steps with the even plan of the profiled cluster; its callback summary."""
    import lightning.pytorch as pl

    from cephalo_lightning import CephaloCallback, CephaloStrategy, PlanningError
    from cephalo_lightning.planner import plan as make_plan

    strategy = cli.trainer.strategy
    if strategy.cluster is None:
        return None
    try:
        even = make_plan(strategy.cluster, strategy.plan.global_batch_size, planner=Planner.EVEN)
    except PlanningError as err:
        return {"infeasible": str(err)}
    watcher = CephaloCallback(print_plan=False, quiet=True, watch_every_n_steps=0)
    trainer = pl.Trainer(
        strategy=CephaloStrategy(plan=even, emulate=strategy.emulate), accelerator=cli.trainer.accelerator,
        devices=cli.trainer.num_devices, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[watcher],
    )
    hparams = {k: v for k, v in cli.model.hparams.items() if not k.startswith("_")}  # the CLI adds _class_path
    trainer.fit(type(cli.model)(**hparams), cli.datamodule)
    return watcher.summary if hasattr(watcher, "summary") else None


def _report(cli, even: dict | None) -> str:
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
    if even and "infeasible" in even:
        lines.append(f"  even plan:    infeasible here ({even['infeasible'].splitlines()[0]})")
    elif even:
        ratio = summary["measured_samples_per_s"] / even["measured_samples_per_s"]
        predicted = summary["predicted_samples_per_s"] / even["predicted_samples_per_s"]
        lines.append(f"  even plan:    {even['measured_samples_per_s']:.1f} samples/s measured side by side "
                     f"-> Cephalo is {ratio:.2f}x faster (predicted {predicted:.2f}x)")
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
    parser.add_argument("--even-steps", type=int, default=20, help="steps of the even-plan comparison (0: skip)")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    args.config = configs.resolve(args.config)
    if not Path(args.config).is_file():
        parser.error(f"{args.config} not found: pass a config file, or one of the packaged configs "
                     f"({', '.join(configs.names())})")
    os.environ.setdefault("WANDB_MODE", "offline")  # no account, no network

    from cephalo_lightning.lightning.cli import run_cli

    cli = run_cli(["fit", "--config", args.config, *rest])
    even = _even_run(cli, args.even_steps) if args.even_steps > 0 else None
    if cli.trainer.is_global_zero:
        print(_report(cli, even), flush=True)
    return 0
