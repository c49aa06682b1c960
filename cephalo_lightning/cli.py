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
    import jsonargparse

    jsonargparse.set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
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


if __name__ == "__main__":
    raise SystemExit(main())
