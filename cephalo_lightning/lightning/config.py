"""The strategy's settings, checked once, as one frozen object passed down to the runtime.

Every bad value is refused here, at ``CephaloStrategy(...)``, with a message that names the
argument and the fix, before any process is launched or any data is read.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

MODES = ("auto", "layered", "uniform")
COLLECTIVES = ("auto", "padded", "exact")
STATE_DICT_TYPES = ("sharded", "full")
LOSS_WEIGHTINGS = ("auto", "samples", "tokens")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def _choice(name: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"CephaloStrategy({name}={value!r}): choose one of {', '.join(map(repr, choices))}")
    return value


def _integer(name: str, value: Any, minimum: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"CephaloStrategy({name}={value!r}) must be an integer >= {minimum} ({meaning})")
    return value


def _import_class(path: str) -> type[nn.Module]:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"units: cannot import module class {path!r} ({err}); give a full path like 'pkg.mod.Block'") from err


@dataclass(frozen=True)
class StrategyConfig:
    """What :class:`~cephalo_lightning.lightning.strategy.CephaloStrategy` was asked to do (see its docstring)."""

    global_batch_size: int | None = None
    mode: str = "auto"
    collective: str = "auto"
    units: tuple[type[nn.Module], ...] | None = None
    param_dtype: torch.dtype | None = None
    emulate: tuple[Any, ...] | None = None
    offload: bool | None = None
    memory_check_every_n_steps: int = 50
    state_dict_type: str = "sharded"
    prefetch: bool = True
    overlap: bool = True
    pretrained: Path | None = None
    loss_weighting: str = "auto"
    verify_loss: bool = True
    max_nonfinite_skips: int = 5
    check_devices: bool = True
    safe_globals: tuple[Any, ...] = field(default_factory=tuple)
    seed: int | None = None
    verify_checksums: bool = True

    @classmethod
    def build(cls, *, global_batch_size: Any = None, mode: Any = "auto", collective: Any = "auto", units: Any = None,
              param_dtype: Any = None, emulate: Any = None, offload: Any = None, memory_check_every_n_steps: Any = 50,
              state_dict_type: Any = "sharded", prefetch: bool = True, overlap: bool = True, pretrained: Any = None,
              loss_weighting: Any = "auto", verify_loss: bool = True, max_nonfinite_skips: Any = 5,
              check_devices: bool = True, safe_globals: Sequence[Any] = (), seed: Any = None,
              verify_checksums: bool = True) -> StrategyConfig:
        if global_batch_size is not None:
            _integer("global_batch_size", global_batch_size, 1, "samples per optimizer step over all ranks")
        if param_dtype is not None and param_dtype not in DTYPES:
            raise ValueError(f"CephaloStrategy(param_dtype={param_dtype!r}): choose one of {sorted(DTYPES)}")
        if emulate is not None and (isinstance(emulate, (str, bytes, dict)) or not isinstance(emulate, Sequence)):
            raise ValueError(
                f"CephaloStrategy(emulate={emulate!r}) must be a list with one spec per rank, e.g. "
                "[{slowdown: 1}, {slowdown: 3, memory_gb: 0.5}]"
            )
        if pretrained is not None and not Path(pretrained).exists():
            raise ValueError(f"CephaloStrategy(pretrained={str(pretrained)!r}): no such file or directory")
        if seed is not None:
            _integer("seed", seed, 0, "the seed of the data order and of meta-device initialisation")
        return cls(
            global_batch_size=global_batch_size,
            mode=_choice("mode", mode, MODES),
            collective=_choice("collective", collective, COLLECTIVES),
            units=tuple(_import_class(u) if isinstance(u, str) else u for u in units) if units else None,
            param_dtype=DTYPES[param_dtype] if param_dtype else None,
            emulate=tuple(emulate) if emulate is not None else None,
            offload=offload,
            memory_check_every_n_steps=_integer(
                "memory_check_every_n_steps", memory_check_every_n_steps, 1,
                "an emulated CPU capacity is enforced on the first 3 steps and every N-th"),
            state_dict_type=_choice("state_dict_type", state_dict_type, STATE_DICT_TYPES),
            prefetch=bool(prefetch),
            overlap=bool(overlap),
            pretrained=Path(pretrained) if pretrained is not None else None,
            loss_weighting=_choice("loss_weighting", loss_weighting, LOSS_WEIGHTINGS),
            verify_loss=bool(verify_loss),
            max_nonfinite_skips=_integer("max_nonfinite_skips", max_nonfinite_skips, 0,
                                         "consecutive non-finite steps skipped before training stops; 0 = no guard"),
            check_devices=bool(check_devices),
            safe_globals=tuple(safe_globals),
            seed=seed,
            verify_checksums=bool(verify_checksums),
        )
