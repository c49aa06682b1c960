"""A config's ``WandbLogger`` without wandb installed: a ``CSVLogger`` instead, said in one line.

W&B is an optional extra (``cephalo-lightning[wandb]``) and the packaged quickstart logs to it, so a
plain ``pip install cephalo-lightning`` would otherwise stop in Lightning's import error before the
first step. The replacement writes the same metrics to ``<save_dir>/<project>/version_N/metrics.csv``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

WANDB_LOGGER = "lightning.pytorch.loggers.WandbLogger"
CSV_LOGGER = "lightning.pytorch.loggers.CSVLogger"
INSTALL_HINT = 'pip install "cephalo-lightning[wandb]"'


def wandb_installed() -> bool:
    return importlib.util.find_spec("wandb") is not None


def _is_wandb(entry: Any) -> bool:
    return isinstance(entry, Namespace) and entry.get("class_path") in (WANDB_LOGGER, "lightning.pytorch.loggers.wandb.WandbLogger",
                                                                         "WandbLogger")


def _csv_for(entry: Namespace, default_root_dir: Any) -> Namespace:
    init = entry.get("init_args") or Namespace()
    save_dir = init.get("save_dir") or default_root_dir or "."
    return Namespace(class_path=CSV_LOGGER, init_args=Namespace(save_dir=str(save_dir), name=init.get("project") or "lightning_logs"))


def replace_missing_wandb(trainer_config: Namespace) -> list[str]:
    """In a parsed ``trainer`` config, every ``WandbLogger`` becomes a ``CSVLogger`` when wandb is not
    installed (warned once, with the install line); returns the save dirs of the replacements."""
    logger = trainer_config.get("logger")
    entries = logger if isinstance(logger, list) else [logger]
    if not any(_is_wandb(e) for e in entries) or wandb_installed():
        return []
    root = trainer_config.get("default_root_dir")
    replaced = [_csv_for(e, root) if _is_wandb(e) else e for e in entries]
    trainer_config["logger"] = replaced if isinstance(logger, list) else replaced[0]
    dirs = [r.init_args.save_dir for r, e in zip(replaced, entries) if _is_wandb(e)]
    rank_zero_warn(f"Cephalo: wandb is not installed, so the config's WandbLogger logs to a CSVLogger in {', '.join(dirs)} "
                   f"instead; for W&B: {INSTALL_HINT}")
    return dirs
