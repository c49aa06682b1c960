"""The strategy's options: ONE declaration of each (name, default, meaning), checked once, frozen.

:class:`StrategyConfig`'s fields are the options of ``CephaloStrategy(...)``: the strategy's
signature takes its defaults from :data:`DEFAULTS`, :meth:`StrategyConfig.build` checks and
converts what was given, and ``tests/lightning/test_options.py`` holds the API reference's table (docs/reference/strategy.md) to the fields.
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
import importlib.util
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, fields, replace
from os import PathLike
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import nn

from cephalo_lightning._common import vocabulary
from cephalo_lightning._common.errors import ConfigurationError, UnsupportedError
from cephalo_lightning._common.vocabulary import (
    AUTO,
    Auto,
    CollectiveChoice,
    HandbackChoice,
    ScheduleChoice,
    member_of,
)
from cephalo_lightning.planner import Cluster, Plan, load_cluster

# the choices as the user writes them (LightningCLI checks YAML strings against them); ``mode`` and
# ``collective`` are a vocabulary's member or AUTO, decided at setup (the vocabulary module's note)
StateDictType = Literal["sharded", "full"]
LossWeightingChoice = Literal["auto", "samples", "tokens"]  # "tokens" is LossWeighting("items"): see .schedules

MODES: tuple[str, ...] = get_args(ScheduleChoice)
COLLECTIVES: tuple[str, ...] = get_args(CollectiveChoice)
HANDBACKS: tuple[str, ...] = get_args(HandbackChoice)
STATE_DICT_TYPES: tuple[str, ...] = get_args(StateDictType)
LOSS_WEIGHTINGS: tuple[str, ...] = get_args(LossWeightingChoice)
BaseStorageChoice = Literal["compute", "nf4"]  # a vocabulary.BaseStorage, as LightningCLI reads it
BASE_STORAGES: tuple[str, ...] = get_args(BaseStorageChoice)
RouterAuxLoss = Literal["keep", "exclude"]
ROUTER_AUX_LOSSES: tuple[str, ...] = get_args(RouterAuxLoss)
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def option(default: Any, meaning: str, *, unset: str | None = None) -> Any:
    """One option: its default, its meaning in one line and, for a ``None`` default that is
    decided later, what is used then (``unset``, as the API reference's table words it)."""
    return field(default=default, metadata={"meaning": meaning, "unset": unset})


@dataclass(frozen=True)
class StrategyConfig:
    """What :class:`~cephalo_lightning.lightning.strategy.cephalo_strategy.CephaloStrategy` was asked to do.

    The values are converted: ``plan``/``cluster`` loaded, ``units`` imported, ``param_dtype`` a
    ``torch.dtype``, ``pretrained`` a ``Path``, sequences tuples.
    """

    plan: Plan | None = option(None, "a `Plan` or a plan JSON path")
    cluster: Cluster | None = option(None, "plan from a cluster file at setup")
    global_batch_size: int | None = option(None, "samples per optimizer step over all ranks")
    mode: vocabulary.Schedule | Auto = option(AUTO, "`layered` (needs the protocol), `uniform`, or auto")
    collective: vocabulary.Collective | Auto = option(AUTO, "`padded`, `exact`, or auto (exact on gloo, padded on NCCL)")
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
    loss_weighting: str = option("auto", "`tokens` (items of the model's loss), `samples`, or what the model's loss averages over")
    router_aux_loss: str = option("keep", "an MoE model's router auxiliary loss: `keep` (per micro-batch) or `exclude`")
    gather_on_teardown: vocabulary.Handback | Auto = option(
        AUTO, "after fit/validate/test the module holds the whole trained model on every rank (`all`), on global rank 0 "
        "only (`rank0`), or stays sharded and refuses use (`none`); auto: `all` for a model of at most 8 GiB in its "
        "master dtype, else `none` (`True`: `all`, `False`: `none`)")
    base_storage: vocabulary.BaseStorage = option(
        vocabulary.BaseStorage.COMPUTE, "how frozen parameters are stored, sharded and gathered: `compute` (the compute "
        "dtype) or `nf4` (their matrices as 4-bit NF4 blocks, dequantised per unit: QLoRA; needs the `qlora` extra)")
    checkpoint_frozen: bool = option(
        True, "checkpoints hold the frozen parameters (False: the trainable ones, their optimizer state and the loops, "
        "with the frozen base's path and fingerprint; resumed from the same `pretrained=`)")
    verify_loss: bool = option(True, "a recognised library model: check once that `training_step` returns its loss")
    max_nonfinite_skips: int = option(
        5, "consecutive non-finite steps skipped before training stops; 0 = no guard")
    check_devices: bool = option(True, "refuse a plan whose devices are not the ranks' actual devices")
    safe_globals: tuple[Any, ...] = option((), "extra classes your hyperparameters or callback state need to load")
    seed: int | None = option(None, "the seed of the data order (unset: seed_everything's, else torch's at setup) "
                                    "and of meta-device initialisation (unset: 0)")
    verify_checksums: bool = option(True, "check every file's SHA-256 against the checkpoint's manifest")
    progress_every: int | None = option(
        None, "stdout not a terminal: a plain progress line every N steps instead of the bar; 0 = Lightning's bar",
        unset="the Trainer's `log_every_n_steps`")
    async_checkpoint: bool = option(
        False, "save in the background: training waits only for a copy to host memory (`sharded` only)")
    elastic: bool = option(
        False, "a plan for another world size (an elastic restart) is re-planned for the ranks present (from the cluster "
        "file when given beside it), with a warning")
    fault_tolerance: bool = option(
        False, "each shard group a torchft replica group: a lost group drops out of the cross-group sum at the next "
        "step and rejoins with the live state (docs/fault-tolerance.md; needs the `ft` extra)")
    replica_group: int | None = option(
        None, "under `fault_tolerance`: this node's shard group in the plan (its torchft replica group)",
        unset="the `REPLICA_GROUP_ID` environment variable")
    pipelines: bool | Auto = option(
        AUTO, "planning from `cluster`: weigh pipelined plans too (auto: where the fit can run one, else plan without "
        "them and say why at setup; True: the same, refusing an option that rules them out; False: never)")

    def __post_init__(self) -> None:
        # a mode given as its string is held as its member (build refuses any other value)
        object.__setattr__(self, "mode", member_of(vocabulary.Schedule, self.mode))
        object.__setattr__(self, "collective", member_of(vocabulary.Collective, self.collective))
        object.__setattr__(self, "gather_on_teardown", member_of(vocabulary.Handback, self.gather_on_teardown))

    @classmethod
    def build(cls, **given: Any) -> StrategyConfig:
        """The options as given to ``CephaloStrategy(...)`` (any left out: its default), checked."""
        unknown = sorted(set(given) - set(OPTION_NAMES))
        if unknown:
            raise UnsupportedError(f"StrategyConfig.build() got unknown options {unknown}")
        o = {f.name: given.get(f.name, f.default) for f in fields(cls)}
        if o["global_batch_size"] is not None:
            _integer("global_batch_size", o["global_batch_size"], 1)
        if o["param_dtype"] is not None and (not isinstance(o["param_dtype"], str) or o["param_dtype"] not in DTYPES):
            raise ConfigurationError(f"CephaloStrategy(param_dtype={o['param_dtype']!r}): choose one of {sorted(DTYPES)}")
        emulate = o["emulate"]
        if emulate is not None and (isinstance(emulate, (str, bytes, dict)) or not isinstance(emulate, Sequence)):
            raise ConfigurationError(
                f"CephaloStrategy(emulate={emulate!r}) must be a list with one spec per rank, e.g. "
                "[{slowdown: 1}, {slowdown: 3, memory_gb: 0.5}]"
            )
        if o["pretrained"] is not None:
            if not isinstance(o["pretrained"], (str, PathLike)):
                raise ConfigurationError(f"CephaloStrategy(pretrained={o['pretrained']!r}) must be a path (a str or "
                                         "Path): a save_pretrained directory or a state_dict file")
            if not Path(o["pretrained"]).exists():
                raise ConfigurationError(f"CephaloStrategy(pretrained={str(o['pretrained'])!r}): no such file or directory")
        if o["seed"] is not None:
            _seed(o["seed"])
        for spec in fields(cls):
            if spec.type in ("bool", "bool | None"):
                check_flag(spec.name, o[spec.name], none_ok=spec.type != "bool")
        checked = cls(
            global_batch_size=o["global_batch_size"],
            mode=_choice("mode", o["mode"], MODES),
            collective=_choice("collective", o["collective"], COLLECTIVES),
            units=_units(o["units"]),
            param_dtype=DTYPES[o["param_dtype"]] if o["param_dtype"] else None,
            emulate=tuple(emulate) if emulate is not None else None,
            offload=o["offload"],
            memory_check_every_n_steps=_integer("memory_check_every_n_steps", o["memory_check_every_n_steps"], 1),
            state_dict_type=_choice("state_dict_type", o["state_dict_type"], STATE_DICT_TYPES),
            prefetch=o["prefetch"],
            overlap=o["overlap"],
            pretrained=Path(o["pretrained"]) if o["pretrained"] is not None else None,
            loss_weighting=_choice("loss_weighting", o["loss_weighting"], LOSS_WEIGHTINGS),
            router_aux_loss=_choice("router_aux_loss", o["router_aux_loss"], ROUTER_AUX_LOSSES),
            gather_on_teardown=_handback(o["gather_on_teardown"]),
            base_storage=base_storage_of(o["base_storage"]),
            checkpoint_frozen=o["checkpoint_frozen"],
            verify_loss=o["verify_loss"],
            max_nonfinite_skips=_integer("max_nonfinite_skips", o["max_nonfinite_skips"], 0),
            check_devices=o["check_devices"],
            safe_globals=_safe_globals(o["safe_globals"]),
            seed=o["seed"],
            verify_checksums=o["verify_checksums"],
            progress_every=_integer("progress_every", o["progress_every"], 0) if o["progress_every"] is not None else None,
            async_checkpoint=o["async_checkpoint"],
            elastic=o["elastic"],
            fault_tolerance=o["fault_tolerance"],
            replica_group=_integer("replica_group", o["replica_group"], 0) if o["replica_group"] is not None else None,
            pipelines=_pipelines(o["pipelines"]),
        )
        if checked.async_checkpoint and checked.state_dict_type != "sharded":
            raise ConfigurationError(
                "CephaloStrategy(async_checkpoint=True, state_dict_type='full'): a single-file checkpoint is "
                "consolidated on rank 0 after the save; use state_dict_type='sharded' (consolidate offline with "
                "`python -m cephalo_lightning consolidate`) or async_checkpoint=False")
        _check_frozen_checkpoints(checked)
        plan, cluster = _plan_source(o["plan"], o["cluster"], o["global_batch_size"], checked.elastic)
        if not checked.fault_tolerance and checked.replica_group is not None:
            raise ConfigurationError(
                f"CephaloStrategy(replica_group={checked.replica_group}) names a torchft replica group, which only "
                "fault_tolerance=True uses; add fault_tolerance=True or drop replica_group")
        return replace(checked, plan=plan, cluster=cluster)


OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(StrategyConfig))
DEFAULTS = StrategyConfig()  # the strategy's signature takes every default from here
# torch's seed range (a uint64), less room for the data epoch the sampler adds to the seed
MAX_SEED = 2**63 - 1


def base_storage_of(value: Any, owner: str = "CephaloStrategy") -> vocabulary.BaseStorage:
    """``base_storage`` checked: one of :data:`BASE_STORAGES`, and ``nf4`` only where bitsandbytes is installed."""
    if value not in BASE_STORAGES:
        raise ConfigurationError(f"{owner}(base_storage={value!r}): choose one of {', '.join(map(repr, BASE_STORAGES))}")
    storage = vocabulary.BaseStorage(value)
    if storage is vocabulary.BaseStorage.NF4 and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigurationError(f"{owner}(base_storage='nf4') quantises the frozen base with bitsandbytes, which "
                                 "is not installed: pip install \"cephalo-lightning[qlora]\", or use base_storage='compute'")
    return storage


def _choice(name: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ConfigurationError(f"CephaloStrategy({name}={value!r}): choose one of {', '.join(map(repr, choices))}")
    return value


def _handback(value: Any) -> vocabulary.Handback | Auto:
    """``gather_on_teardown``: a choice's string, or the bool it was before it had choices."""
    if value is True or value is False:
        return vocabulary.Handback.ALL if value else vocabulary.Handback.NONE
    if isinstance(value, str) and value in HANDBACKS:
        return value if value == AUTO else vocabulary.Handback(value)
    raise ConfigurationError(
        f"CephaloStrategy(gather_on_teardown={value!r}): choose one of {', '.join(map(repr, HANDBACKS))} (True is "
        f"{vocabulary.Handback.ALL.value!r}, False {vocabulary.Handback.NONE.value!r})")


def _check_frozen_checkpoints(config: StrategyConfig) -> None:
    """``checkpoint_frozen=False`` saves no frozen parameter: a resume reads them from ``pretrained=``."""
    if config.checkpoint_frozen:
        return
    if config.pretrained is None:
        raise ConfigurationError(
            "CephaloStrategy(checkpoint_frozen=False) saves the trainable parameters only, and a resume reads the "
            "frozen ones from pretrained=, which is not given: add pretrained=PATH (the base the frozen parameters "
            "come from) or drop checkpoint_frozen=False")
    if config.state_dict_type != "sharded":
        raise ConfigurationError(
            f"CephaloStrategy(checkpoint_frozen=False, state_dict_type={config.state_dict_type!r}): a single-file "
            "checkpoint is the whole model; use state_dict_type='sharded' (the default) or checkpoint_frozen=True")


def _pipelines(value: Any) -> bool | Auto:
    if value is True or value is False or value == AUTO:
        return value
    raise ConfigurationError(f"CephaloStrategy(pipelines={value!r}): choose True, False or 'auto' (weigh pipelined plans "
                             "when planning from a cluster file where the fit can run one)")


def _integer(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        meaning = StrategyConfig.__dataclass_fields__[name].metadata["meaning"]
        raise ConfigurationError(f"CephaloStrategy({name}={value!r}) must be an integer >= {minimum} ({meaning})")
    return value


def check_flag(name: str, value: Any, *, none_ok: bool = False, owner: str = "CephaloStrategy") -> None:
    """A bool option takes only True or False (``"no"`` would be truthy; YAML already reads ``false``)."""
    if not isinstance(value, bool) and not (none_ok and value is None):
        allowed = "True, False or None (decided by the device)" if none_ok else "True or False"
        raise ConfigurationError(f"{owner}({name}={value!r}) must be {allowed}, got {type(value).__name__}; "
                                 f"write {name}=True or {name}=False (in YAML: true / false)")


def _seed(value: Any, where: str = "CephaloStrategy(seed={!r})") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise ConfigurationError(f"{where.format(value)} must be an integer in [0, 2**63 - 1] (torch's seed range, "
                                 "less room for the data epoch added to it), e.g. seed=42")
    return value


def _units(units: Any) -> tuple[type[nn.Module], ...] | None:
    """The ``units`` option: module classes, or import paths of module classes, in a list."""
    if units is None:
        return None
    if isinstance(units, (str, bytes)) or not isinstance(units, Sequence) or not units:
        raise ConfigurationError(
            f"CephaloStrategy(units={units!r}) must be a non-empty list of nn.Module classes or import paths, "
            "e.g. units=[MyBlock] or units=['pkg.mod.MyBlock']")
    classes = tuple(_import_class(u) if isinstance(u, str) else u for u in units)
    for given, cls in zip(units, classes):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ConfigurationError(
                f"CephaloStrategy(units=[..., {given!r}, ...]): {given!r} is not an nn.Module subclass; give the class "
                "of the blocks to shard one by one (e.g. units=[MyBlock]) or its import path ('pkg.mod.MyBlock')")
    return classes


def _import_class(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigurationError(
            f"units: cannot import module class {path!r} ({err}); give a full path like 'pkg.mod.Block'") from err


def _safe_globals(value: Any) -> tuple[Any, ...]:
    """Classes (or functions) a checkpoint may name: a list of the objects themselves."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, AbstractSet)):
        raise ConfigurationError(
            f"CephaloStrategy(safe_globals={value!r}) must be a list of classes or functions, got "
            f"{type(value).__name__}; write safe_globals=[MyClass] (import the class itself, not its name)")
    for item in value:
        if not callable(item):
            raise ConfigurationError(
                f"CephaloStrategy(safe_globals=[..., {item!r}, ...]): {item!r} is not a class or function; write "
                "safe_globals=[MyClass] with the class itself (import it), not its name or an instance")
    return tuple(value)


def _plan_source(plan: Plan | str | Path | None, cluster: Cluster | str | Path | None,
                 global_batch_size: int | None, elastic: bool) -> tuple[Plan | None, Cluster | None]:
    """The ``plan`` and ``cluster`` options, loaded, and checked against each other."""
    for name, value, kind in (("plan", plan, Plan), ("cluster", cluster, Cluster)):
        if value is not None and not isinstance(value, (kind, str, PathLike)):
            raise ConfigurationError(
                f"CephaloStrategy({name}={value!r}) must be a {kind.__name__} or the path of a {name} file "
                f"({'plan JSON' if name == 'plan' else 'YAML or JSON'}), got {type(value).__name__}; write "
                f"{name}='{name}.{'json' if name == 'plan' else 'yaml'}'")
    if cluster is not None and plan is not None and not elastic:
        raise ConfigurationError("CephaloStrategy(cluster=...) plans at setup: give global_batch_size=B and no plan= "
                                 "(or elastic=True: the plan is used, and re-planned from the cluster file when the "
                                 "world size changes)")
    if cluster is not None and plan is None and global_batch_size is None:
        raise ConfigurationError("CephaloStrategy(cluster=...) plans at setup: give global_batch_size=B")
    plan = Plan.load(plan) if isinstance(plan, (str, PathLike)) else plan
    if plan is not None and global_batch_size not in (None, plan.global_batch_size):
        raise ConfigurationError(
            f"global_batch_size={global_batch_size} but the plan is for {plan.global_batch_size}: drop one")
    return plan, load_cluster(cluster) if isinstance(cluster, (str, PathLike)) else cluster

