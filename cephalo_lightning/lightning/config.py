"""The strategy's options: ONE declaration of each (name, default, meaning), checked once, frozen.

:class:`StrategyConfig`'s fields are the options of ``CephaloStrategy(...)``: the strategy's
signature takes its defaults from :data:`DEFAULTS`, :meth:`StrategyConfig.build` checks and
converts what was given, and ``tests/test_options.py`` holds the README's table to the fields.
Every bad value is refused here, at ``CephaloStrategy(...)``, with a message that names the
argument and the fix, before any process is launched or any data is read.

[Note: three meanings of "mode"] The user's word ``mode`` picks the *schedule* a fit runs
(``layered`` or ``uniform``, or ``auto``: decided from the model at setup, see
:mod:`.schedules`); ``collective`` picks how shards are all-gathered and reduce-scattered
(``padded`` or ``exact``; ``auto``: by backend). The option names stay the user's; inside the
package the decided values are called ``schedule`` and ``collective``.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import nn

from cephalo_lightning._common.errors import ConfigurationError, UnsupportedError
from cephalo_lightning.planner import Cluster, Plan, load_cluster

Mode = Literal["auto", "layered", "uniform"]  # the user's request; decided into a Schedule at setup
Schedule = Literal["layered", "uniform"]
Collective = Literal["auto", "padded", "exact"]
StateDictType = Literal["sharded", "full"]
LossWeightingChoice = Literal["auto", "samples", "tokens"]  # "tokens" is LossWeighting("items"): see .schedules

MODES: tuple[str, ...] = get_args(Mode)
COLLECTIVES: tuple[str, ...] = get_args(Collective)
STATE_DICT_TYPES: tuple[str, ...] = get_args(StateDictType)
LOSS_WEIGHTINGS: tuple[str, ...] = get_args(LossWeightingChoice)
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def option(default: Any, meaning: str, *, unset: str | None = None) -> Any:
    """One option: its default, its meaning in one line and, for a ``None`` default that is
    decided later, what is used then (``unset``, as the README's table words it)."""
    return field(default=default, metadata={"meaning": meaning, "unset": unset})


@dataclass(frozen=True)
class StrategyConfig:
    """What :class:`~cephalo_lightning.lightning.strategy.CephaloStrategy` was asked to do.

    The values are converted: ``plan``/``cluster`` loaded, ``units`` imported, ``param_dtype`` a
    ``torch.dtype``, ``pretrained`` a ``Path``, sequences tuples.
    """

    plan: Plan | None = option(None, "a `Plan` or a plan JSON path")
    cluster: Cluster | None = option(None, "plan from a cluster file at setup")
    global_batch_size: int | None = option(None, "samples per optimizer step over all ranks")
    mode: str = option("auto", "`layered` (needs the protocol), `uniform`, or auto")
    collective: str = option("auto", "`padded`, `exact`, or auto (exact on gloo, padded on NCCL)")
    units: tuple[type[nn.Module], ...] | None = option(
        None, "wrap policy for the uniform mode: module classes or import paths", unset="largest `nn.ModuleList`")
    param_dtype: torch.dtype | None = option(
        None, "gather parameters in e.g. `\"bf16\"`; masters and reductions stay fp32", unset="module's dtype")
    emulate: tuple[Any, ...] | None = option(None, "per-rank CPU emulation")
    offload: bool | None = option(None, "keep the layered stash in host memory", unset="CUDA / emulated memory")
    memory_check_every_n_steps: int = option(
        50, "an emulated CPU capacity is enforced on the first 3 steps and every N-th")
    state_dict_type: str = option("sharded", "`sharded` (resharding DCP directory) or `full` (one file, rank 0)")
    prefetch: bool = option(True, "all-gather the next unit early")
    overlap: bool = option(True, "on CUDA, collectives on their own streams")
    pretrained: Path | None = option(None, "a `save_pretrained` directory or a `state_dict` file, read into the shards")
    loss_weighting: str = option("auto", "`tokens` (items of the model's loss), `samples`, or what the model defines")
    verify_loss: bool = option(True, "a recognised library model: check once that `training_step` returns its loss")
    max_nonfinite_skips: int = option(
        5, "consecutive non-finite steps skipped before training stops; 0 = no guard")
    check_devices: bool = option(True, "refuse a plan whose devices are not the ranks' actual devices")
    safe_globals: tuple[Any, ...] = option((), "extra classes your hyperparameters or callback state need to load")
    seed: int | None = option(None, "the seed of the data order and of meta-device initialisation")
    verify_checksums: bool = option(True, "check every file's SHA-256 against the checkpoint's manifest")

    @classmethod
    def build(cls, **given: Any) -> StrategyConfig:
        """The options as given to ``CephaloStrategy(...)`` (any left out: its default), checked."""
        unknown = sorted(set(given) - set(OPTION_NAMES))
        if unknown:
            raise UnsupportedError(f"StrategyConfig.build() got unknown options {unknown}")
        o = {f.name: given.get(f.name, f.default) for f in fields(cls)}
        if o["global_batch_size"] is not None:
            _integer("global_batch_size", o["global_batch_size"], 1)
        if o["param_dtype"] is not None and o["param_dtype"] not in DTYPES:
            raise ConfigurationError(f"CephaloStrategy(param_dtype={o['param_dtype']!r}): choose one of {sorted(DTYPES)}")
        emulate = o["emulate"]
        if emulate is not None and (isinstance(emulate, (str, bytes, dict)) or not isinstance(emulate, Sequence)):
            raise ConfigurationError(
                f"CephaloStrategy(emulate={emulate!r}) must be a list with one spec per rank, e.g. "
                "[{slowdown: 1}, {slowdown: 3, memory_gb: 0.5}]"
            )
        if o["pretrained"] is not None and not Path(o["pretrained"]).exists():
            raise ConfigurationError(f"CephaloStrategy(pretrained={str(o['pretrained'])!r}): no such file or directory")
        if o["seed"] is not None:
            _integer("seed", o["seed"], 0)
        checked = cls(
            global_batch_size=o["global_batch_size"],
            mode=_choice("mode", o["mode"], MODES),
            collective=_choice("collective", o["collective"], COLLECTIVES),
            units=tuple(_import_class(u) if isinstance(u, str) else u for u in o["units"]) if o["units"] else None,
            param_dtype=DTYPES[o["param_dtype"]] if o["param_dtype"] else None,
            emulate=tuple(emulate) if emulate is not None else None,
            offload=o["offload"],
            memory_check_every_n_steps=_integer("memory_check_every_n_steps", o["memory_check_every_n_steps"], 1),
            state_dict_type=_choice("state_dict_type", o["state_dict_type"], STATE_DICT_TYPES),
            prefetch=bool(o["prefetch"]),
            overlap=bool(o["overlap"]),
            pretrained=Path(o["pretrained"]) if o["pretrained"] is not None else None,
            loss_weighting=_choice("loss_weighting", o["loss_weighting"], LOSS_WEIGHTINGS),
            verify_loss=bool(o["verify_loss"]),
            max_nonfinite_skips=_integer("max_nonfinite_skips", o["max_nonfinite_skips"], 0),
            check_devices=bool(o["check_devices"]),
            safe_globals=tuple(o["safe_globals"]),
            seed=o["seed"],
            verify_checksums=bool(o["verify_checksums"]),
        )
        plan, cluster = _plan_source(o["plan"], o["cluster"], o["global_batch_size"])
        return replace(checked, plan=plan, cluster=cluster)


OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(StrategyConfig))
DEFAULTS = StrategyConfig()  # the strategy's signature takes every default from here


def _choice(name: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ConfigurationError(f"CephaloStrategy({name}={value!r}): choose one of {', '.join(map(repr, choices))}")
    return value


def _integer(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        meaning = StrategyConfig.__dataclass_fields__[name].metadata["meaning"]
        raise ConfigurationError(f"CephaloStrategy({name}={value!r}) must be an integer >= {minimum} ({meaning})")
    return value


def _import_class(path: str) -> type[nn.Module]:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigurationError(
            f"units: cannot import module class {path!r} ({err}); give a full path like 'pkg.mod.Block'") from err


def _plan_source(plan: Plan | str | Path | None, cluster: Cluster | str | Path | None,
                 global_batch_size: int | None) -> tuple[Plan | None, Cluster | None]:
    """The ``plan`` and ``cluster`` options, loaded, and checked against each other."""
    if cluster is not None and (plan is not None or global_batch_size is None):
        raise ConfigurationError("CephaloStrategy(cluster=...) plans at setup: give global_batch_size=B and no plan=")
    plan = Plan.load(plan) if isinstance(plan, (str, Path)) else plan
    if plan is not None and global_batch_size not in (None, plan.global_batch_size):
        raise ConfigurationError(
            f"global_batch_size={global_batch_size} but the plan is for {plan.global_batch_size}: drop one")
    return plan, load_cluster(cluster) if isinstance(cluster, (str, Path)) else cluster

