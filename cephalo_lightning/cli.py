"""``cephalo-train``: LightningCLI with omegaconf interpolation and the Cephalo strategy registered.

    cephalo-train fit --config configs/quickstart.yaml
    python -m cephalo_lightning fit --config configs/quickstart.yaml --trainer.max_steps=50

Model and data are chosen in the config with ``class_path`` (any LightningModule /
LightningDataModule); ``trainer.strategy`` may be ``cephalo`` or ``{class_path: ..., init_args: ...}``.
A top-level ``vars:`` block holds values shared by ``${vars.x}`` interpolations.
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI

import cephalo_lightning  # noqa: F401  (registers strategy="cephalo" before arguments are parsed)


class CephaloCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 - jsonargparse's parser
        parser.add_argument("--vars", type=dict, default={}, help="shared values for ${vars.*} interpolation")


def run_cli(args: list[str], run: bool = True) -> CephaloCLI:
    """Parse ``args`` (``fit --config ...``) and run the subcommand; returns the CLI (its trainer).

    ``omegaconf+`` resolves ``${vars.x}`` after every config file and command-line override is
    merged, so ``--vars.steps=40`` reaches every place that interpolates it; relative interpolation
    paths (jsonargparse's setting) keep nested ``class_path``/``init_args`` resolvable.
    """
    import warnings

    import jsonargparse

    jsonargparse.set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
    # the demo and profile commands build their CLI arguments themselves, on purpose
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    return CephaloCLI(
        args=args,
        run=run,
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={"parser_mode": "omegaconf+"},
        save_config_kwargs={"overwrite": True},
    )


def main(argv: list[str] | None = None) -> int:
    run_cli(list(sys.argv[1:] if argv is None else argv))
    return 0


def profile_main(argv: list[str] | None = None) -> int:
    """``python -m cephalo_lightning profile --config C.yaml -o cluster.yaml``: profile, plan, stop.

    Builds the run from the config (its strategy, emulation, model and data), profiles every rank
    as ``CephaloCallback`` does at setup, writes the cluster file (the planner's input: re-plan
    offline with ``python -m cephalo_lightning plan``) and the plan, and trains nothing.
    """
    import argparse
    from pathlib import Path

    from lightning.pytorch.callbacks import Checkpoint

    from cephalo_lightning.callback import CephaloCallback

    parser = argparse.ArgumentParser(prog="python -m cephalo_lightning profile", description=profile_main.__doc__)
    parser.add_argument("-o", "--output", default="cluster.yaml", help="cluster file to write (YAML or .json)")
    parser.add_argument("--plan-output", default=None, help="also write the plan JSON here")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    # setup runs (and profiles); no step, no validation, no logger run
    cli = run_cli([*rest, "--trainer.max_steps=0", "--trainer.num_sanity_val_steps=0", "--trainer.logger=false"],
                  run=False)
    trainer = cli.trainer
    trainer.callbacks = [cb for cb in trainer.callbacks if not isinstance(cb, Checkpoint)]  # nothing to save
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, CephaloCallback)]
    callback = callbacks[0] if callbacks else CephaloCallback()
    if not callbacks:
        trainer.callbacks.append(callback)
    callback.force_profile, callback.cluster_file, callback.plan_file = True, Path(args.output), args.plan_output
    trainer.fit(cli.model, datamodule=cli.datamodule)
    if trainer.is_global_zero:
        print(f"wrote {args.output}" + (f" and {args.plan_output}" if args.plan_output else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
