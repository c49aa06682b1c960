"""How to profile: one frozen set of options, passed whole from the cluster profiler down to each layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning._common.vocabulary import Collective, values_of
from cephalo_lightning.profiling.region_timing import STATISTICS


@dataclass(frozen=True)
class ProfileOptions:
    """How to profile. The defaults take seconds for the demo GPT on CPU."""

    max_micro_batch: int = 4  # profile micro-batch sizes 1..k; the planner extrapolates linearly beyond
    warmup: int = 1  # rounds over the sizes measured and dropped
    repeats: int = 5  # rounds kept, reduced to one figure by `statistic`
    min_region_ms: float = 5.0  # short calls are repeated back to back in one timed region
    compute_dtype: torch.dtype | None = None  # the runtime's compute dtype (None: the parameters' own)
    prefetch: bool = True  # the runtime gathers the next layer while one computes
    resident_bytes: int = 0  # held for the whole step besides one layer (e.g. the gathered root unit)
    measure_memory: bool = True  # measure each layer's compute memory (else 0)
    batch_dim: int = 0  # the samples' dimension of a layer's input
    collectives: bool = True  # time the all-gather / reduce-scatter (else keep the settings' values)
    collective_modes: tuple[Collective, ...] = (Collective.PADDED,)  # the first is the runtime's mode
    collective_repeats: int = 5
    link_probe_bytes: int = 4 * 2**20  # each rank's shard when the links within / between nodes are timed
    share_measurements: bool = True  # identical devices (same name and emulation) measure once
    serialize: bool | None = None  # measuring ranks take turns (default: on CPU, where they share cores)
    statistic: str | None = None  # how repeats are reduced: "min" | "median" (default: min on CPU, median on CUDA)
    smooth: bool | None = None  # report the least-squares line a + b*m through the times (default: on CPU)

    def __post_init__(self) -> None:
        if isinstance(self.max_micro_batch, bool) or not isinstance(self.max_micro_batch, int) or self.max_micro_batch < 1:
            raise ConfigurationError(f"max_micro_batch must be an integer >= 1, got {self.max_micro_batch!r}")
        if isinstance(self.link_probe_bytes, bool) or not isinstance(self.link_probe_bytes, int) \
                or self.link_probe_bytes < 4:
            raise ConfigurationError(f"link_probe_bytes must be an integer >= 4, got {self.link_probe_bytes!r}")
        if self.warmup < 0 or self.repeats < 1 or self.collective_repeats < 1:
            raise ConfigurationError("need warmup >= 0, repeats >= 1 and collective_repeats >= 1")
        if self.statistic is not None and self.statistic not in STATISTICS:
            raise ConfigurationError(f"statistic must be one of {STATISTICS} or None, got {self.statistic!r}")
        if not self.collective_modes or any(m not in values_of(Collective) for m in self.collective_modes):
            raise ConfigurationError(
                f"collective_modes must be a non-empty subset of {values_of(Collective)}, got {self.collective_modes}"
            )
        object.__setattr__(self, "collective_modes", tuple(Collective(m) for m in self.collective_modes))
