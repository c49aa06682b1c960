"""Layered gradient accumulation: any number of micro-batches per rank, fixed collectives.

The usual loop runs micro-batch-major: it re-gathers every unit for every micro-batch, or keeps
every unit's unsharded gradient resident, and ranks with different micro-batch counts issue
different numbers of collectives (and hang). This schedule runs *layer-major* instead
(design brief, "Layered gradient accumulation"):

forward   for each layer: gather it once, push ALL micro-batches through it without an autograd
          graph, stash each micro-batch's input to the layer, free the layer;
backward  for each layer in reverse: gather it once, recompute it from the stash for each
          micro-batch and backpropagate the upstream gradient, accumulate its full gradient,
          then reduce-scatter it once; free the layer and the stash as it goes.

Every rank therefore issues exactly 2 all-gathers and 1 reduce-scatter per layer per step, in the
same order, whatever its micro-batch count (even zero). Peak device memory is one gathered layer
(plus the next one, prefetched) and one micro-batch's activations of one layer; the stash is kept
on the host when offloading (on CUDA) and is reported separately. The price is one extra forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from cephalo_lightning.runtime.engine import ShardedModel
from cephalo_lightning.runtime.flat_unit import FlatUnit
from cephalo_lightning.runtime.memory import on_host

LossFn = Callable[[int, torch.Tensor], torch.Tensor]  # (micro-batch index, last output) -> mean loss


@dataclass
class _Stashed:
    tensor: torch.Tensor  # the layer's input, on the host when offloading
    rng: tuple[torch.Tensor, list[torch.Tensor]]


def _rng_state(devices: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


@dataclass
class LayeredStats:
    """What one step kept where: for the memory accounting and the benchmarks."""

    stash_bytes: int = 0  # peak bytes of stashed layer inputs
    stash_on_host: bool = False
    micro_batches: int = 0


class LayeredSchedule:
    """Runs one optimizer step's micro-batches through ``layers`` layer by layer.

    ``sharded`` must have been built with ``units=layers`` (one unit per layer, in order);
    parameters outside the layers form the root unit, gathered for the step. The model's own
    hooks (for plain forwards, e.g. validation) are switched off while the schedule runs.
    """

    def __init__(
        self,
        sharded: ShardedModel,
        layers: Sequence[nn.Module],
        offload: bool | None = None,
        on_unit_reduced: Callable[[FlatUnit], None] | None = None,
    ) -> None:
        """``offload``: keep stashed inputs and boundary gradients on the host between uses
        (default: on CUDA yes, on CPU no; on CPU True emulates it for the memory accounting)."""
        if [id(m) for m in sharded.unit_modules] != [id(m) for m in layers]:
            raise ValueError("the sharded model's units must be exactly the layers, in order (units=layers)")
        self.sharded = sharded
        self.layers = list(layers)
        self.on_unit_reduced = on_unit_reduced
        self.device = sharded.root.device
        self.offload = (self.device.type == "cuda") if offload is None else offload
        self._cuda_devices = [self.device.index or 0] if self.device.type == "cuda" else []
        self._stash: list[list[_Stashed]] = []
        self._weights: list[float] = []
        self._loss_fn: LossFn | None = None
        self.stats = LayeredStats()

    # ------------------------------------------------------------------ host offload

    def _to_host(self, x: torch.Tensor) -> torch.Tensor:
        """Move a boundary tensor off the device between its uses (no-op without offload).

        On CUDA this is an async copy to pinned memory. On CPU it emulates one: a copy accounted
        as host memory by the active :class:`~.memory.MemoryTracker`, so an emulated device's
        figures match what a GPU would hold.
        """
        if not self.offload:
            return x
        if x.device.type == "cpu":
            with on_host():
                return x.detach().clone()
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host.copy_(x, non_blocking=True)
        return host

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        if not self.offload:
            return x
        if self.device.type == "cpu":
            return x.clone()
        return x.to(self.device, non_blocking=True)

    def _stash_bytes(self) -> int:
        return sum(s.tensor.numel() * s.tensor.element_size() for per_layer in self._stash for s in per_layer)

    # ------------------------------------------------------------------ the two passes

    def forward(self, inputs: Sequence[torch.Tensor], loss_fn: LossFn, weights: Sequence[float]) -> torch.Tensor:
        """Forward all micro-batches layer by layer; returns sum_k weights[k] * loss_k (detached).

        ``inputs[k]`` is micro-batch k's input to the first layer; ``weights[k]`` its share of the
        global mean (micro-batch size / global batch). Call :meth:`backward` next.
        """
        if len(inputs) != len(weights):
            raise ValueError("one weight per micro-batch")
        with torch.no_grad(), self.sharded.hooks_disabled():
            return self._forward(inputs, loss_fn, weights)

    def _forward(self, inputs: Sequence[torch.Tensor], loss_fn: LossFn, weights: Sequence[float]) -> torch.Tensor:
        sharded, units = self.sharded, self.sharded.units
        self._stash = [[] for _ in self.layers]
        self._weights = list(weights)
        self._loss_fn = loss_fn
        self.stats = LayeredStats(stash_on_host=self.offload, micro_batches=len(inputs))
        sharded.gather_root()
        xs = [self._to_host(x) for x in inputs]  # each layer's input doubles as its stash
        for index, layer in enumerate(self.layers, start=1):
            units[index].gather(sharded.comm)
            if sharded.prefetch and index + 1 < len(units):
                units[index + 1].start_gather(sharded.comm)
            sharded.emulator.begin_compute()
            for k, x in enumerate(xs):
                self._stash[index - 1].append(_Stashed(x, _rng_state(self._cuda_devices)))
                xs[k] = self._to_host(layer(self._to_device(x)))
            sharded.emulator.end_compute()
            units[index].free()
        self.stats.stash_bytes = self._stash_bytes()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for k, (out, w) in enumerate(zip(xs, self._weights)):
            total += w * loss_fn(k, self._to_device(out)).float()
        return total

    def backward(self, loss_scale: float = 1.0) -> None:
        """Backward layer by layer; leaves the reduced gradients on the local pieces.

        ``loss_scale`` multiplies every micro-batch's loss (a gradient scaler's scale).
        """
        if self._loss_fn is None:
            raise RuntimeError("LayeredSchedule.backward() without a forward()")
        with self.sharded.hooks_disabled():
            self._backward(loss_scale)

    def _reduce(self, unit: FlatUnit) -> None:
        self.sharded.reduce_unit(unit)
        if self.on_unit_reduced is not None and unit.trainable:
            self.on_unit_reduced(unit)

    def _backward(self, loss_scale: float) -> None:
        sharded, units = self.sharded, self.sharded.units
        upstream: list[torch.Tensor | None] = [None] * len(self._weights)
        last = len(self.layers)
        for index in range(last, 0, -1):
            layer = self.layers[index - 1]
            units[index].gather(sharded.comm)
            if sharded.prefetch and index - 1 >= 1:
                units[index - 1].start_gather(sharded.comm)
            sharded.emulator.begin_compute()
            stash = self._stash[index - 1]
            for k, item in enumerate(stash):
                x = self._to_device(item.tensor)
                needs_input_grad = index > 1 and x.is_floating_point()
                if needs_input_grad:
                    x = x.detach().requires_grad_(True)
                with torch.enable_grad(), torch.random.fork_rng(self._cuda_devices, enabled=True):
                    torch.set_rng_state(item.rng[0])
                    for device, state in zip(self._cuda_devices, item.rng[1]):
                        torch.cuda.set_rng_state(state, device)
                    out = layer(x)
                    if index == last:
                        objective = self._loss_fn(k, out) * (self._weights[k] * loss_scale)
                        objective.backward()
                    else:
                        out.backward(self._to_device(upstream[k]))
                upstream[k] = self._to_host(x.grad) if needs_input_grad else None
                stash[k] = None  # type: ignore[call-overload]  # free the stash as we go
            sharded.emulator.end_compute()
            units[index].free()
            self._reduce(units[index])
        # the root unit (parameters outside the layers, e.g. inside the loss) goes last
        self._reduce(sharded.root)
        sharded.root.free()
        self._stash = []
        self._loss_fn = None


class UnitOptimizers:
    """One optimizer per unit, stepped as soon as the unit's gradient is reduced (optional).

    The usual step waits for the whole backward, so every unit's local gradient is resident at
    once; stepping unit by unit frees each gradient before the next layer's backward runs, so only
    one unit's gradient is ever held. Use it as ``LayeredSchedule(..., on_unit_reduced=opts.step_unit)``
    with ``make_optimizer(params) -> Optimizer`` (the same hyperparameters for every unit). Gradient
    clipping by the global norm is not possible this way: the norm is known only at the end.
    """

    def __init__(self, sharded: ShardedModel, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.optimizers = {id(u): make_optimizer(u.local_params) for u in sharded.units if u.trainable}

    def step_unit(self, unit: FlatUnit) -> None:
        optimizer = self.optimizers[id(unit)]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
