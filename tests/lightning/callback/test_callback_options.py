"""CephaloCallback's options: one declaration (CallbackConfig), which the API reference's table
(docs/reference/callback.md) and the
callback's signature repeat name for name and default for default."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from cephalo_lightning import CephaloCallback
from cephalo_lightning._common.errors import CephaloError
from cephalo_lightning.lightning.callback import cephalo_callback as callback_module
from cephalo_lightning.lightning.callback.callback_config import CallbackConfig

README = Path(__file__).resolve().parents[3] / "docs" / "reference" / "callback.md"  # the options table


def readme_table() -> dict[str, str]:
    """The ``CephaloCallback(...)`` table: every argument with its default as written (no backticks);
    a row naming several arguments gives each its own default, or all of them its one."""
    text = README.read_text()
    section = text.split("### `CephaloCallback(...)`", 1)[1]
    rows = re.findall(r"^\|(.+)\|(.+)\|(.+)\|$", section.split("\n\n", 2)[1], flags=re.MULTILINE)
    table: dict[str, str] = {}
    for names, defaults, _meaning in rows[2:]:  # the header and the |---| line
        names_list = [n.strip().strip("`") for n in names.split(",")]
        defaults_list = [d.strip().replace("`", "") for d in defaults.split(",")]
        if len(defaults_list) == 1:
            defaults_list *= len(names_list)
        assert len(defaults_list) == len(names_list), f"row {names!r}: {len(names_list)} names, defaults {defaults!r}"
        table.update(zip(names_list, defaults_list))
    return table


def shown(option: dataclasses.Field) -> str:
    """How the README writes the option's default."""
    return option.metadata["shown"] or str(option.default)


def test_the_readme_table_lists_every_option_with_its_default() -> None:
    declared = {f.name: shown(f) for f in dataclasses.fields(CallbackConfig)}
    assert readme_table() == declared


def test_the_callback_takes_exactly_the_declared_options() -> None:
    parameters = list(inspect.signature(CephaloCallback.__init__).parameters.values())[1:]
    assert [(p.name, p.default) for p in parameters] == [(f.name, f.default) for f in dataclasses.fields(CallbackConfig)]
    assert all(f.metadata["meaning"] for f in dataclasses.fields(CallbackConfig))


def test_the_callback_holds_its_options_as_the_config() -> None:
    callback = CephaloCallback(max_micro_batch=2, settings={"usable_memory_fraction": 0.9}, replan=True)
    assert callback.config == CallbackConfig(max_micro_batch=2, settings={"usable_memory_fraction": 0.9}, replan=True)
    assert CephaloCallback().config == CallbackConfig() and CallbackConfig().settings == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        callback.config.replan = False  # type: ignore[misc]


@pytest.mark.parametrize(("arguments", "message"), [
    ({"mode": "pipelined"}, "mode must be 'layered', 'uniform' or None, got 'pipelined'"),
    ({"global_batch_size": 0}, r"CephaloCallback\(global_batch_size=0\) must be an integer >= 1 \(or None"),
    ({"max_micro_batch": True}, r"CephaloCallback\(max_micro_batch=True\) must be an integer >= 1$"),
    ({"watch_every_n_steps": -1}, "watch_every_n_steps must be >= 0 and drift_threshold > 0"),
    ({"drift_threshold": 0}, "watch_every_n_steps must be >= 0 and drift_threshold > 0"),
])
def test_bad_options_are_refused_at_construction(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        CephaloCallback(**arguments)
    assert isinstance(refused.value, CephaloError)


class Built(Exception):
    """What the config was built from, raised out of the constructor."""


def test_each_parameter_reaches_the_config_under_its_own_name(monkeypatch) -> None:
    def config(**given: object) -> CallbackConfig:
        raise Built(given)

    monkeypatch.setattr(callback_module, "CallbackConfig", config)
    given = {f.name: object() for f in dataclasses.fields(CallbackConfig)}  # one distinct value each (equal only to itself)
    with pytest.raises(Built) as built:
        CephaloCallback(**given)
    assert built.value.args[0] == given
