"""Every ``CephaloStrategy`` option is declared once (:class:`StrategyConfig`'s fields): the API
reference's table (docs/reference/strategy.md), the strategy's signature and the checked config all agree with that declaration."""

from __future__ import annotations

import inspect
import re
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest

from cephalo_lightning import CephaloStrategy
from cephalo_lightning.lightning.strategy.process_group import ProcessGroupStrategy
from cephalo_lightning.lightning.strategy_config import DEFAULTS, OPTION_NAMES, StrategyConfig

README = Path(__file__).resolve().parents[2] / "docs" / "reference" / "strategy.md"  # the options table
# pages that show some options again, in a table under the same heading: each row agrees with the declaration,
# and the reference's table lists every option all the same (a page's rows never stand in for the reference's)
OPTION_PAGES = (Path(__file__).resolve().parents[2] / "docs" / "fault-tolerance.md",)
HEADING = "### `CephaloStrategy(...)`"


def readme_table() -> dict[str, str]:
    """``name -> default`` as the reference's table states them (a row may name several options)."""
    rows = _table(README)
    assert rows, f"no option rows under {HEADING!r} in {README}"
    return rows


def _table(page: Path) -> dict[str, str]:
    lines = page.read_text().splitlines()
    start = lines.index(HEADING)
    rows: dict[str, str] = {}
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or cells[0] in ("argument", "") or set(cells[0]) <= {"-"}:
            continue
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            rows[name] = cells[1]
    return rows


def shown(name: str) -> str:
    """How the README shows option ``name``'s default: what an unset value means, or the value."""
    spec = StrategyConfig.__dataclass_fields__[name]
    unset = spec.metadata["unset"]
    if unset is not None:
        return unset
    value: Any = spec.default
    return f'"{value}"' if isinstance(value, str) else repr(value)


def test_every_option_has_a_default_and_a_meaning():
    for spec in fields(StrategyConfig):
        assert spec.default is not MISSING, spec.name
        assert spec.metadata.get("meaning"), f"{spec.name} has no meaning"


def test_the_readme_table_lists_exactly_the_declared_options_with_their_defaults():
    table = readme_table()
    assert sorted(table) == sorted(OPTION_NAMES), (
        f"README only: {sorted(set(table) - set(OPTION_NAMES))}; declared only: {sorted(set(OPTION_NAMES) - set(table))}")
    for name in OPTION_NAMES:
        assert table[name].replace("`", "") == shown(name).replace("`", ""), (
            f"{name}: the README says {table[name]!r}, StrategyConfig says {shown(name)!r}")


@pytest.mark.parametrize("page", OPTION_PAGES, ids=[p.name for p in OPTION_PAGES])
def test_a_page_that_shows_options_again_shows_declared_ones_with_their_defaults(page):
    rows = _table(page)
    assert rows and set(rows) <= set(OPTION_NAMES), f"{page.name} names {sorted(set(rows) - set(OPTION_NAMES))}"
    for name, default in rows.items():
        assert default.replace("`", "") == shown(name).replace("`", ""), (name, page.name, default, shown(name))


def test_the_strategy_signature_exposes_exactly_the_declared_options_with_their_defaults():
    process_group = [n for n in inspect.signature(ProcessGroupStrategy.__init__).parameters if n not in ("self", "kwargs")]
    parameters = inspect.signature(CephaloStrategy.__init__).parameters
    options = [n for n, p in parameters.items()
               if n != "self" and n not in process_group and p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert options == list(OPTION_NAMES)
    for name in OPTION_NAMES:
        assert parameters[name].default == getattr(DEFAULTS, name), name


def test_every_given_option_reaches_the_config():
    given = {"global_batch_size": 8, "mode": "uniform", "collective": "exact", "param_dtype": "bf16",
             "emulate": [{"slowdown": 1.0}], "offload": True, "memory_check_every_n_steps": 7,
             "state_dict_type": "full", "prefetch": False, "overlap": False, "loss_weighting": "samples",
             "verify_loss": False, "max_nonfinite_skips": 0, "check_devices": False, "safe_globals": [Path],
             "seed": 3, "verify_checksums": False, "progress_every": 10, "elastic": True,
             "router_aux_loss": "exclude", "gather_on_teardown": False}
    config = CephaloStrategy(**given).config
    assert config == StrategyConfig.build(**given)
    changed = {name for name in OPTION_NAMES if getattr(config, name) != getattr(DEFAULTS, name)}
    assert changed == set(given)
    background = {**given, "state_dict_type": "sharded", "async_checkpoint": True}  # needs sharded checkpoints
    assert CephaloStrategy(**background).config == StrategyConfig.build(**background)


class Built(Exception):
    """What the config was built from, raised out of the constructor."""


def test_each_parameter_reaches_the_config_under_its_own_name(monkeypatch):
    def build(**given: Any) -> StrategyConfig:
        raise Built(given)

    monkeypatch.setattr(StrategyConfig, "build", build)
    given = {name: object() for name in OPTION_NAMES}  # one distinct value per option (equal only to itself)
    with pytest.raises(Built) as built:
        CephaloStrategy(**given)
    assert built.value.args[0] == given
