"""Time of the optimizer step per state parameter on this device, measured like the layers.

Each rank's optimizer updates only the parameters it owns (its state share r of P), so the cost
model charges ``optimizer_ns_per_param * r * P`` to the step; a slow GPU holding a big share pays
for it. The figure is one step of the optimizer (AdamW by default, as the runtime's fp32 master
parameters would take it) over one flat parameter of ``numel`` elements, inside the device
emulator's compute region (:class:`~cephalo_lightning.profiling.region_timing.RegionTimer`), after a first
step that allocates the optimizer's state; the fixed per-step overhead is spread over ``numel``,
which is why it is large (2**21 parameters by default).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning.profiling.region_timing import RegionTimer, default_statistic, summarize
from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerProfile:
    numel: int
    step_ms: float  # one step over numel parameters (the statistic of the repeats)
    ns_per_param: float


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def time_optimizer_step(
    device: torch.device | str = "cpu",
    emulator: DeviceEmulator | None = None,
    *,
    numel: int = 2**21,
    optimizer: OptimizerFactory | None = None,
    dtype: torch.dtype = torch.float32,
    warmup: int = 1,
    repeats: int = 5,
    statistic: str | None = None,
) -> OptimizerProfile:
    """One optimizer step's time over ``numel`` parameters of ``dtype``, per parameter (see module)."""
    if numel < 1 or repeats < 1 or warmup < 0:
        raise ConfigurationError(f"need numel >= 1, repeats >= 1 and warmup >= 0, got {numel}, {repeats}, {warmup}")
    device = torch.device(device)
    param = nn.Parameter(torch.zeros(numel, dtype=dtype, device=device))
    param.grad = torch.full_like(param, 1e-3)
    opt = (optimizer or _adamw)([param])
    timer = RegionTimer(device, emulator)
    opt.step()  # the first step allocates the optimizer's state: not a step's cost
    samples = []
    for i in range(warmup + repeats):
        timer.synchronize()
        _, ms = timer.time(opt.step)
        if i >= warmup:
            samples.append(ms)
    step_ms = summarize(samples, statistic or default_statistic(device))
    return OptimizerProfile(numel, step_ms, step_ms * 1e6 / numel)
