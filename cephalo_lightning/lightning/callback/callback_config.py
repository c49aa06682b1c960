"""``CephaloCallback``'s options: one declaration, each with its default and meaning, checked once.

:class:`~cephalo_lightning.lightning.callback.cephalo_callback.CephaloCallback` takes these as keyword arguments (so
LightningCLI and YAML configs see them one by one) and builds a :class:`CallbackConfig` from them
at construction, so a bad value is refused before any process is launched. The API reference's
``CephaloCallback(...)`` table lists the same names and defaults (a test compares them).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from os import PathLike
from pathlib import Path
from typing import Any

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning._common.vocabulary import Schedule, member_of, values_of
from cephalo_lightning.lightning.strategy_config import check_flag
from cephalo_lightning.planner import PlanningError, Settings
from cephalo_lightning.planner.schema.cluster import parse_settings
from cephalo_lightning.planner.schema.files import check_writable

MODES = (None, *values_of(Schedule))


def _option(default: Any, meaning: str, shown: str | None = None) -> Any:
    """A field with its default, its one-line meaning and, where the default is ``None``, what
    ``None`` stands for (as the API reference's table shows it)."""
    return field(default=default, metadata={"meaning": meaning, "shown": shown})


@dataclass(frozen=True)
class CallbackConfig:
    """What :class:`~cephalo_lightning.lightning.callback.cephalo_callback.CephaloCallback` was asked to do."""

    global_batch_size: int | None = _option(
        None, "samples per optimizer step over all ranks (None: the strategy's, else the DataLoader's batch_size)",
        shown="DataLoader's")
    mode: Schedule | None = _option(None, "planner mode, 'layered' or 'uniform'", shown="what the module supports")
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
    calibrate_after_windows: int = _option(
        2, "once, fit the cost model's run-time terms to this many watch windows after the first, log the "
        "prediction before/after against the measured step and judge drift by the calibrated one (0: never)")
    switch_gain: float = _option(
        0.05, "after calibrating, switch in place to the calibrated optimum when it is predicted faster by more "
        "than this fraction")
    adapt: bool = _option(
        True, "once calibrated, re-time a drifting rank from its measured busy time, re-solve and switch plan in "
        "place (no re-profile, no files); it moves back when the rank recovers")
    min_dwell_windows: int = _option(2, "after a plan switch, watch windows without another decision (hysteresis)")
    state_bytes_per_param: float | None = _option(
        None, "training-state bytes per parameter (None: 4 x the master dtype's size, 16 for fp32)",
        shown="4 x the master dtype's size")
    print_plan: bool = _option(True, "print the plan table on rank 0 when training starts")
    quiet: bool = _option(False, "no progress bar, no log lines from the profiler and no end-of-training summary")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigurationError(f"CephaloCallback(mode={self.mode!r}): mode must be 'layered', 'uniform' or None, "
                                     f"got {self.mode!r}")
        object.__setattr__(self, "mode", member_of(Schedule, self.mode))
        for name in ("global_batch_size", "max_micro_batch"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigurationError(
                    f"CephaloCallback({name}={value!r}) must be an integer >= 1"
                    + (" (or None: the training DataLoader's batch_size)" if name == "global_batch_size" else ""))
        watch = self.watch_every_n_steps
        if isinstance(watch, bool) or not isinstance(watch, int) or watch < 0 or not _positive(self.drift_threshold):
            raise ConfigurationError(
                f"CephaloCallback(watch_every_n_steps={watch!r}, drift_threshold={self.drift_threshold!r}): "
                "watch_every_n_steps must be >= 0 and drift_threshold > 0 (an integer and a number, e.g. 10 and 0.3)")
        windows = self.calibrate_after_windows
        if isinstance(windows, bool) or not isinstance(windows, int) or windows < 0 or not _positive(self.switch_gain):
            raise ConfigurationError(
                f"CephaloCallback(calibrate_after_windows={windows!r}, switch_gain={self.switch_gain!r}): "
                "calibrate_after_windows must be an integer >= 0 (0: never) and switch_gain a number > 0, e.g. 2 and 0.05")
        if self.state_bytes_per_param is not None and not _positive(self.state_bytes_per_param):
            raise ConfigurationError(
                f"CephaloCallback(state_bytes_per_param={self.state_bytes_per_param!r}) must be a number > 0 "
                "(e.g. 16 for fp32 AdamW: master, gradient and two moments), or None: 4 x the master dtype's size")
        dwell = self.min_dwell_windows
        if isinstance(dwell, bool) or not isinstance(dwell, int) or dwell < 1:
            raise ConfigurationError(f"CephaloCallback(min_dwell_windows={dwell!r}) must be an integer >= 1 (windows "
                                     "without a decision after a plan switch), e.g. 2")
        for name in ("force_profile", "replan", "adapt", "print_plan", "quiet"):
            check_flag(name, getattr(self, name), owner="CephaloCallback")
        for name in ("cache_dir", "cluster_file", "plan_file"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (str, PathLike)) or str(value) == ""):
                raise ConfigurationError(
                    f"CephaloCallback({name}={value!r}) must be a path (a non-empty str or Path) or None")
        for name in ("cluster_file", "plan_file"):  # written after profiling: refuse a place that cannot take them now
            value = getattr(self, name)
            if value is not None:
                try:
                    check_writable(value, name)
                except PlanningError as err:
                    raise ConfigurationError(f"CephaloCallback({name}={str(value)!r}): {err}") from None
        object.__setattr__(self, "settings", checked_settings(self.settings))  # a private copy; {}: device defaults


def _positive(value: Any) -> bool:
    """A finite number > 0 (not a bool, not a numeric string)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def checked_settings(settings: Any) -> dict[str, Any]:
    """The cost-model settings to override, each key a :class:`~cephalo_lightning.planner.Settings`
    field and each value checked as a cluster file's ``settings:`` are (so a typo or a fraction of
    5 is refused here, not at ``on_fit_start`` or as an out-of-memory error mid-run)."""
    if settings is None:
        return {}
    if not isinstance(settings, Mapping):
        raise ConfigurationError(
            f"CephaloCallback(settings={settings!r}) must be a mapping of cost-model settings, got "
            f"{type(settings).__name__}; write e.g. settings={{'usable_memory_fraction': 0.9}}")
    known = [f.name for f in fields(Settings)]
    for key in settings:
        if key not in known:
            nearest = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {nearest[0]!r}? " if nearest else ""
            raise ConfigurationError(
                f"CephaloCallback(settings=...) has no setting {key!r}: {hint}the settings are {', '.join(known)}")
    try:
        parsed = parse_settings(dict(settings))
    except PlanningError as err:
        raise ConfigurationError(f"CephaloCallback(settings={dict(settings)!r}): {err}") from None
    return {key: getattr(parsed, key) for key in settings}
