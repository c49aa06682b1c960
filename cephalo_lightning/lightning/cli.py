"""``cephalo-train``: LightningCLI with omegaconf interpolation and the Cephalo strategy registered.

    cephalo-train fit --config configs/quickstart.yaml
    cephalo-train fit --config quickstart          (the copy shipped in the package)
    python -m cephalo_lightning fit --config configs/quickstart.yaml --trainer.max_steps=50

Model and data are chosen in the config with ``class_path`` (any LightningModule /
LightningDataModule); ``trainer.strategy`` may be ``cephalo`` or ``{class_path: ..., init_args: ...}``.
A top-level ``vars:`` block holds values shared by ``${vars.x}`` interpolations; ``--vars.x=V``
overrides one of them (only names the configs define: a typo is an error, not a new var).

``strategy="cephalo"`` is registered by the package's ``__init__``, which Python runs before any of
its modules, this one too, so it is known before the arguments are parsed.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import DefaultHelpFormatter, Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from omegaconf.errors import InterpolationKeyError, OmegaConfBaseException
from typing_extensions import override

from cephalo_lightning._common.errors import CephaloError, refused
from cephalo_lightning._common.help_text import PlainHelp, PlainHelpFormatter
from cephalo_lightning.configs import resolve as resolve_config
from cephalo_lightning.lightning.cli_errors import CLIArgumentParser, fail
from cephalo_lightning.lightning.cli_loggers import replace_missing_wandb

log = logging.getLogger(__name__)

_CONFIG_FLAGS = ("--config", "-c")
DESCRIPTION = (
    "cephalo-train (cephalo-lightning): LightningCLI with the Cephalo strategy, for training transformers with "
    "PyTorch Lightning on heterogeneous GPU clusters: per-GPU batch sizes, gradient accumulation and uneven "
    "state sharding from a profiled plan. Try: cephalo-train fit --config quickstart (the packaged demo on an "
    "emulated 2-rank CPU cluster). The other commands (plan, profile, demo, consolidate, export, lighthouse): "
    "python -m cephalo_lightning --help."
)


class CLIHelpFormatter(PlainHelp, DefaultHelpFormatter):
    """jsonargparse's help formatter, the reST markup of the docstrings it prints removed."""


def resolve_configs(args: Sequence[str]) -> list[str]:
    """``--config NAME`` names a packaged config (``quickstart``) when no such file exists."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg in _CONFIG_FLAGS and i + 1 < len(out):
            out[i + 1] = resolve_config(out[i + 1])
        elif arg.startswith("--config="):
            out[i] = "--config=" + resolve_config(arg[len("--config="):])
    return out


def _config_files(args: Sequence[str]) -> list[Path]:
    files = [args[i + 1] for i, a in enumerate(args[:-1]) if a in _CONFIG_FLAGS]
    files += [a[len("--config="):] for a in args if a.startswith("--config=")]
    return [Path(f) for f in files if Path(f).is_file()]


def defined_vars(args: Sequence[str]) -> list[str]:
    """The names in the ``vars:`` blocks of the config files on the command line."""
    names: set[str] = set()
    for path in _config_files(args):
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):  # jsonargparse reports unreadable configs itself
            continue
        if isinstance(data, dict) and isinstance(data.get("vars"), dict):
            names |= set(data["vars"])
    return sorted(names)


def check_vars(args: Sequence[str]) -> None:
    """``--vars.NAME=V`` must name a var a config defines (a typo would otherwise be a silent new var)."""
    known = defined_vars(args)
    given = [a[len("--vars."):].split("=", 1)[0].split(".", 1)[0] for a in args if a.startswith("--vars.")]
    unknown = sorted(set(given) - set(known))
    if unknown:
        flags = ", ".join(f"--vars.{name}" for name in unknown)
        where = f"the config defines {', '.join(known)}" if known else "the config files define no vars"
        fail(f"unknown var in {flags}: {where}. Fix the name, or add the var to the config's vars: block.")


def interpolation_error(err: OmegaConfBaseException, args: Sequence[str]) -> str:
    """omegaconf's multi-line report (and traceback) as one sentence naming the value, key and vars."""
    written = re.sub(r"\$\{\.+", "${", str(err.child_node)) if err.child_node is not None else "an interpolation"
    key = err.full_key or "?"
    subcommand = next((a for a in args if not a.startswith("-")), None)
    if subcommand and key.startswith(subcommand + "."):
        key = key[len(subcommand) + 1:]
    reason = "no such key" if isinstance(err, InterpolationKeyError) else (err.msg or str(err)).splitlines()[0]
    known = defined_vars(args)
    listed = f"the config's vars are {', '.join(known)}" if known else "the config files define no vars"
    return f"{written} at {key} does not resolve ({reason}); {listed}."


class CephaloCLI(LightningCLI):
    """LightningCLI with a ``--vars`` block, packaged configs by name, one-line interpolation and option
    errors (:class:`CLIArgumentParser`, its default ``parser_class``) and a CSV logger in place of a
    ``WandbLogger`` when wandb is not installed (:mod:`.cli_loggers`)."""

    def __init__(self, *args: Any, parser_class: type[LightningArgumentParser] = CLIArgumentParser,
                 **kwargs: Any) -> None:
        self.parsers: list[LightningArgumentParser] = []  # the main parser and every subcommand's (init_parser)
        super().__init__(*args, parser_class=parser_class, **kwargs)

    @override
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        kwargs.setdefault("formatter_class", CLIHelpFormatter)  # the main parser and every subcommand's
        if issubclass(self.parser_class, CLIArgumentParser):
            kwargs.setdefault("option_parsers", self.parsers)
        parser = super().init_parser(**kwargs)
        self.parsers.append(parser)
        return parser

    @override
    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 - jsonargparse's parser
        # dict[str, Any], not dict: "--vars.steps=40" stays an int, as it would be in the YAML
        parser.add_argument("--vars", type=dict[str, Any], default={}, help="shared values for ${vars.*} interpolation")

    @override
    def parse_arguments(self, parser, args) -> None:  # noqa: ANN001 - LightningCLI's own signature
        if isinstance(args, (dict, Namespace)):  # an already structured config: nothing to rewrite
            return super().parse_arguments(parser, args)
        argv = resolve_configs(sys.argv[1:] if args is None else args)
        check_vars(argv)
        try:  # None keeps LightningCLI reading sys.argv itself (and not warning about args)
            super().parse_arguments(parser, None if args is None and argv == sys.argv[1:] else argv)
        except OmegaConfBaseException as err:
            fail(interpolation_error(err, argv))

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if isinstance(config.get("trainer"), Namespace):
            replace_missing_wandb(config.trainer)

    @override
    def instantiate_classes(self) -> None:
        """jsonargparse reports a ``class_path`` whose constructor raised as "Does not validate against
        any of the Union subtypes", the cause flattened into its text: a refusal of this package is
        caught on its way out (by an instantiator tried after Lightning's own) and raised as itself."""
        refusals: list[CephaloError] = []

        def instantiate(class_type: type, *args: Any, **kwargs: Any) -> Any:
            try:
                return class_type(*args, **kwargs)
            except CephaloError as err:
                refusals.append(err)
                raise

        import warnings

        with warnings.catch_warnings():  # deprecated for jsonargparse 5, which LightningCLI does not use yet
            warnings.simplefilter("ignore", DeprecationWarning)
            self.parser.add_instantiator(instantiate, object, subclasses=True)
        try:
            super().instantiate_classes()
        except ValueError as err:
            if refusals and refusals[-1] is not err:
                raise refusals[-1] from None
            raise


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
        parser_kwargs={"parser_mode": "omegaconf+", "description": DESCRIPTION},
        save_config_kwargs={"overwrite": True},
    )


def main(argv: list[str] | None = None) -> int:
    """``cephalo-train``: a refusal of this package is one ``error:`` line (exit 2 for bad input, else 1)."""
    try:
        run_cli(list(sys.argv[1:] if argv is None else argv))
    except CephaloError as err:
        return refused(err)
    release_process_group()
    return 0


def release_process_group() -> None:
    """Destroy the default process group after a run that succeeded, as PyTorch asks on a normal
    exit: left to the interpreter's teardown, gloo's worker threads may abort the process (exit -6),
    which torchrun counts as a failure and answers by restarting the finished run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        log.debug("Cephalo: destroying the default process group before exit")
        dist.destroy_process_group()


def profile_main(argv: list[str] | None = None) -> int:
    """``python -m cephalo_lightning profile --config C.yaml -o cluster.yaml``: profile, plan, stop.

    Builds the run from the config (its strategy, emulation, model and data), profiles every rank
    as ``CephaloCallback`` does at setup, writes the cluster file (the planner's input: re-plan
    offline with ``python -m cephalo_lightning plan``) and the plan, and trains nothing.
    """
    import argparse
    from dataclasses import replace

    from lightning.pytorch.callbacks import Checkpoint

    from cephalo_lightning.lightning.callback.cephalo_callback import CephaloCallback

    parser = argparse.ArgumentParser(prog="python -m cephalo_lightning profile", description=profile_main.__doc__,
                                     formatter_class=PlainHelpFormatter,
                                     epilog="Other arguments go to LightningCLI, e.g. --trainer.devices=4 or --vars.out=DIR.")
    parser.add_argument("-c", "--config", action="append", required=True, metavar="C.yaml",
                        help="the run's LightningCLI config file, or a packaged config name (quickstart); repeatable")
    parser.add_argument("-o", "--output", default="cluster.yaml", help="cluster file to write (YAML or .json)")
    parser.add_argument("--plan-output", default=None, help="also write the plan JSON here")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    rest = [arg for config in args.config for arg in ("--config", config)] + rest
    from cephalo_lightning.planner.schema.files import check_writable

    check_writable(args.output, "-o")  # before the profile, not after it
    if args.plan_output:
        check_writable(args.plan_output, "--plan-output")
    # setup runs (and profiles); no step, no validation, no logger run
    cli = run_cli([*rest, "--trainer.max_steps=0", "--trainer.num_sanity_val_steps=0", "--trainer.logger=false"],
                  run=False)
    trainer = cli.trainer
    trainer.callbacks = [cb for cb in trainer.callbacks if not isinstance(cb, Checkpoint)]  # nothing to save
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, CephaloCallback)]
    callback = callbacks[0] if callbacks else CephaloCallback()
    if not callbacks:
        trainer.callbacks.append(callback)
    callback.config = replace(callback.config, force_profile=True, cluster_file=Path(args.output),
                              plan_file=args.plan_output)
    trainer.fit(cli.model, datamodule=cli.datamodule)
    if trainer.is_global_zero:
        print(f"wrote {args.output}" + (f" and {args.plan_output}" if args.plan_output else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
