"""A LightningCLI config as the CLI's own parser reads it, for the tests of the shipped configs."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import yaml


def print_config(*configs: Path, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Parse like ``python -m cephalo_lightning fit --config A --config B ... --print_config``.

    In-process (the parse takes a fraction of a second; a subprocess would import torch again):
    jsonargparse resolves every class path and checks every value against the signatures, prints
    the merged config and exits, without instantiating anything.
    """
    from cephalo_lightning.lightning.cli import main

    argv = ["fit", *[arg for c in configs for arg in ("--config", str(c))], *overrides, "--print_config"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code in (0, None), out.getvalue()[-2000:]
    return yaml.safe_load(out.getvalue())
