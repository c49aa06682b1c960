"""``CephaloCallback``'s options: one declaration, each with its default and meaning, checked once.

:class:`~cephalo_lightning.lightning.callback.CephaloCallback` takes these as keyword arguments (so
LightningCLI and YAML configs see them one by one) and builds a :class:`CallbackConfig` from them
at construction, so a bad value is refused before any process is launched. The README's
``CephaloCallback(...)`` table lists the same names and defaults (a test compares them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cephalo_lightning._common.errors import ConfigurationError

MODES = (None, "layered", "uniform")


def _option(default: Any, meaning: str, shown: str | None = None) -> Any:
    """A field with its default, its one-line meaning and, where the default is ``None``, what
    ``None`` stands for (as the README's table shows it)."""
    return field(default=default, metadata={"meaning": meaning, "shown": shown})


@dataclass(frozen=True)
class CallbackConfig:
    """What :class:`~cephalo_lightning.lightning.callback.CephaloCallback` was asked to do."""

    global_batch_size: int | None = _option(
        None, "samples per optimizer step over all ranks (None: the strategy's, else the DataLoader's batch_size)",
        shown="DataLoader's")
    mode: str | None = _option(None, "planner mode, 'layered' or 'uniform'", shown="what the module supports")
    max_micro_batch: int = _option(4, "profile micro-batch sizes 1..k")
    settings: Mapping[str, Any] | None = _option(
        None, "cost-model settings to override, e.g. {'usable_memory_fraction': 0.9}", shown="device defaults")
    cache_dir: str | Path | None = _option(".cephalo", "where profiles are cached (a restart does not re-profile); None: no cache")
    force_profile: bool = _option(False, "profile again even when a cached profile matches")
    cluster_file: str | Path | None = _option(
        None, "also write the profiled cluster here (re-plan offline with `python -m cephalo_lightning plan`)")
    plan_file: str | Path | None = _option(None, "write the plan JSON here")
    watch_every_n_steps: int = _option(10, "compare measured with predicted every N steps (0: never)")
    drift_threshold: float = _option(
        0.3, "a rank whose measured/predicted ratio departs from the median rank's by more than this fraction drifts")
    replan: bool = _option(False, "on drift: re-profile, re-plan and re-shard (state is kept)")
    state_bytes_per_param: float | None = _option(
        None, "training-state bytes per parameter (None: 4 x the master dtype's size, 16 for fp32)",
        shown="4 x the master dtype's size")
    print_plan: bool = _option(True, "print the plan table on rank 0 when training starts")
    quiet: bool = _option(False, "no progress bar, no log lines from the profiler and no end-of-training summary")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigurationError(f"mode must be 'layered', 'uniform' or None, got {self.mode!r}")
        for name in ("global_batch_size", "max_micro_batch"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigurationError(
                    f"CephaloCallback({name}={value!r}) must be an integer >= 1"
                    + (" (or None: the training DataLoader's batch_size)" if name == "global_batch_size" else ""))
        if self.watch_every_n_steps < 0 or self.drift_threshold <= 0:
            raise ConfigurationError("watch_every_n_steps must be >= 0 and drift_threshold > 0")
        object.__setattr__(self, "settings", dict(self.settings or {}))  # a private copy; {}: the device defaults
