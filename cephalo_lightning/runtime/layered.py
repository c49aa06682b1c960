"""Layered gradient accumulation: any number of micro-batches per rank, fixed collectives.

The usual loop runs micro-batch-major: it re-gathers every unit for every micro-batch, or keeps
every unit's unsharded gradient resident, and ranks with different micro-batch counts issue
different numbers of collectives (and hang). This schedule runs *layer-major* instead:

forward   for each layer: gather it once, push ALL micro-batches through it without an autograd
          graph, stash each micro-batch's input to the layer, free the layer;
backward  for each layer in reverse: gather it once, recompute it from the stash for each
          micro-batch and backpropagate the upstream gradient, accumulate its full gradient,
          then reduce-scatter it once; free the layer and the stash as it goes.

Every rank therefore issues exactly 2 all-gathers and 1 reduce-scatter per layer per step, in the
same order, whatever its micro-batch count (even zero). Peak device memory is one gathered layer
(plus the next one, prefetched) and one micro-batch's activations of one layer; the stash is kept
on the host when offloading (on CUDA, copied on a side stream into pinned memory) and is reported
separately. The price is one extra forward.

[Note: the last layer's last micro-batch runs once] The backward begins where the forward ends:
the last layer, whose forward for the last micro-batch is the most recent. That one call runs
with autograd and keeps its graph and its loss's, and the backward takes it first (then recomputes the other
micro-batches of the layer in order), so it is not run twice; the peak is still one micro-batch's
activations of one layer. Where the last layer is costly (a discovered model's loss pass re-enters
the model's whole forward) this saves one such call per step. The others' forward calls stay:
their loss is the step's value, returned before the backward.

A rank with ONE micro-batch may skip that price (``recompute=False``): its forward keeps every
layer's autograd graph and the loss's (computed once), and its backward only backpropagates, layer
by layer, with the same collectives in the same order. It then holds the activations of the whole forward, which the
plan must allow for.

A layer is a :class:`Layer`: the module(s) forming its unit and how to call them. Besides the one
hidden state that needs a gradient, a layer may take *side inputs* (an attention mask, position
ids, rotary embeddings, ...): the model's ``prepare`` makes them for each micro-batch, once, with
the root unit and the first layer gathered, and every layer's call receives them unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cephalo_lightning.runtime.collectives import CudaStreams
from cephalo_lightning.runtime.sharding.flat_unit import FlatUnit
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

Side = Any  # a layer's side inputs for one micro-batch (anything the model's layer calls understand)
LayerCall = Callable[[torch.Tensor, Side], torch.Tensor]
# (micro-batch index, last layer's output, side inputs) -> the micro-batch's mean loss
LossFn = Callable[[int, torch.Tensor, Side], torch.Tensor]


@dataclass(frozen=True)
class Layer:
    """One layer of the schedule: the module(s) forming its shard unit, and how to run it.

    ``call(hidden, side) -> hidden``; by default the (single) module is called on the hidden
    state alone.
    """

    modules: tuple[nn.Module, ...]
    call: LayerCall | None = None
    name: str = ""

    @classmethod
    def of(cls, layer: nn.Module | Sequence[nn.Module] | Layer) -> Layer:
        if isinstance(layer, Layer):
            return layer
        if isinstance(layer, nn.Module):
            return cls((layer,))
        return cls(tuple(layer))

    def __call__(self, hidden: torch.Tensor, side: Side) -> torch.Tensor:
        if self.call is not None:
            return self.call(hidden, side)
        if len(self.modules) != 1:
            raise TypeError(f"layer {self.name or self.modules}: a layer of several modules needs a call")
        return self.modules[0](hidden)


def plain_input(micro_batch: torch.Tensor) -> tuple[torch.Tensor, Side]:
    """``prepare`` for micro-batches that are the first layer's input themselves (no side inputs)."""
    return micro_batch, None


@dataclass
class _Stashed:
    tensor: torch.Tensor  # the layer's input, on the host when offloading
    rng: tuple[torch.Tensor, list[torch.Tensor]]


def _rng_state(devices: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


class _Offload:
    """Moves boundary tensors off the device between their uses (a no-op when disabled).

    CUDA: pinned host memory, copied on the side copy stream (the compute stream goes on; a
    copy back waits only for its own tensor). CPU: an emulated offload, a copy accounted as host
    memory by an attached memory tracker, so an emulated device's figures match a GPU's.
    """

    def __init__(self, enabled: bool, device: torch.device, streams: CudaStreams | None, sharded: ShardedModel) -> None:
        self.enabled = enabled
        self.device = device
        self.streams = streams
        self.sharded = sharded

    def to_host(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        if x.device.type == "cpu":
            with self.sharded.observers.host_allocations():
                return x.detach().clone()
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)  # pragma: no cover - CUDA only
        if self.streams is None:  # pragma: no cover - CUDA only
            host.copy_(x, non_blocking=True)
            return host
        with self.streams.side(self.streams.copy):  # pragma: no cover - CUDA only
            host.copy_(x, non_blocking=True)
            x.record_stream(self.streams.copy)
        return host  # pragma: no cover - CUDA only

    def to_device(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        if self.device.type == "cpu":
            return x.clone()
        if self.streams is None:  # pragma: no cover - CUDA only
            return x.to(self.device, non_blocking=True)
        copy = self.streams.copy  # pragma: no cover - CUDA only
        with torch.cuda.stream(copy):  # pragma: no cover - CUDA only  (ordered after the copy to the host)
            y = x.to(self.device, non_blocking=True)
        current = torch.cuda.current_stream(self.device)  # pragma: no cover - CUDA only
        current.wait_stream(copy)
        y.record_stream(current)
        return y


@dataclass(eq=False)
class LayeredPass:
    """One step's forward, handed to its backward: the step's weighted loss and what the backward
    reruns or backpropagates (the stash, the kept graphs and losses).

    [Note: one backward per forward] The caller owns the pass (the schedule keeps nothing between
    the two): :meth:`LayeredSchedule.backward` consumes it, freeing what it holds as it goes, and
    refuses it a second time; a pass dropped without a backward (:meth:`LayeredSchedule.evaluate`)
    frees it all with it.
    """

    loss: torch.Tensor  # sum_k weights[k] * loss_k over this rank's micro-batches, detached
    side: list[Side]
    weights: list[float]
    loss_fn: LossFn
    recompute: bool
    stash: list[list[_Stashed | None]] = field(default_factory=list)  # per layer, per micro-batch
    graphs: list[list[tuple[torch.Tensor, torch.Tensor] | None]] = field(default_factory=list)  # no-recompute
    losses: list[torch.Tensor | None] = field(default_factory=list)  # per micro-batch: its loss where the graph is kept
    consumed: bool = False  # its backward has run (or failed): nothing left to backpropagate

    def release(self) -> None:
        """Drop what the backward would use (its tensors go with it) and mark the pass consumed."""
        self.side, self.stash, self.graphs, self.losses = [], [], [], []
        self.consumed = True


class LayeredSchedule:
    """Runs one optimizer step's micro-batches through ``layers`` layer by layer.

    ``sharded`` must have been built with one unit per layer, in order (``units=[layer.modules
    ...]``); parameters outside the layers form the root unit, gathered for the step. The model's
    own hooks (for plain forwards, e.g. validation) stand aside while the schedule runs.
    """

    def __init__(
        self,
        sharded: ShardedModel,
        layers: Sequence[Layer | nn.Module | Sequence[nn.Module]],
        offload: bool | None = None,
        on_unit_reduced: Callable[[FlatUnit], None] | None = None,
    ) -> None:
        """``offload``: keep stashed inputs and boundary gradients on the host between uses
        (default: on CUDA yes, on CPU no; on CPU True emulates it for the memory accounting)."""
        self.layers = [Layer.of(layer) for layer in layers]
        if not self.layers:
            raise ValueError("a layered schedule needs at least one layer (its last computes the loss)")
        if [[id(m) for m in g] for g in sharded.unit_groups] != [[id(m) for m in layer.modules] for layer in self.layers]:
            raise ValueError("the sharded model's units must be exactly the layers' modules, in order")
        self.sharded = sharded
        self.on_unit_reduced = on_unit_reduced
        self.device = sharded.root.device
        enabled = (self.device.type == "cuda") if offload is None else offload
        self.offload = enabled
        self._moves = _Offload(enabled, self.device, sharded.comm.streams, sharded)
        self._cuda_devices = [self.device.index or 0] if self.device.type == "cuda" else []

    # ------------------------------------------------------------------ the two passes

    def forward(
        self,
        micro_batches: Sequence[Any],
        prepare: Callable[[Any], tuple[torch.Tensor, Side]],
        loss_fn: LossFn,
        weights: Sequence[float],
        recompute: bool = True,
    ) -> LayeredPass:
        """Forward all micro-batches layer by layer; returns the pass, whose ``loss`` is
        sum_k weights[k] * loss_k (detached).

        ``prepare(micro_batch) -> (first layer's input, side inputs)`` runs with the root unit and
        the first layer gathered (it may use their parameters, e.g. position embeddings; no
        gradient flows through it). ``weights[k]``: micro-batch k's share of the global mean loss
        (its items over the global batch's). ``recompute=False`` needs at most one micro-batch.
        Call :meth:`backward` next, with the pass (see [Note: one backward per forward]).
        """
        if len(micro_batches) != len(weights):
            raise ValueError("one weight per micro-batch")
        if not recompute and len(micro_batches) > 1:
            raise ValueError(f"recompute=False keeps one micro-batch's graph; this step has {len(micro_batches)}")
        with self.sharded.scheduled():
            if recompute:
                with torch.no_grad():
                    return self._forward(micro_batches, prepare, loss_fn, weights, recompute)
            return self._forward(micro_batches, prepare, loss_fn, weights, recompute)

    def evaluate(self, micro_batches: Sequence[Any], prepare: Callable[[Any], tuple[torch.Tensor, Side]],
                 loss_fn: LossFn, weights: Sequence[float]) -> torch.Tensor:
        """:meth:`forward`'s value with no backward to follow (a check of the loss): the same
        gathers in the same order; what the backward would use is dropped and every unit freed."""
        try:
            return self.forward(micro_batches, prepare, loss_fn, weights).loss.detach()
        finally:  # the pass, dropped with the frame, takes the stash with it
            self.sharded.free_all()

    def _forward(self, micro_batches: Sequence[Any], prepare: Callable[[Any], tuple[torch.Tensor, Side]],
                 loss_fn: LossFn, weights: Sequence[float], recompute: bool) -> LayeredPass:
        sharded, units, moves = self.sharded, self.sharded.units, self._moves
        observers = sharded.observers
        sharded.gather_root()
        sharded.gather(1)
        with torch.no_grad():
            prepared = [prepare(mb) for mb in micro_batches]
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        step = LayeredPass(total, [side for _, side in prepared], list(weights), loss_fn, recompute)
        step.stash = [[] for _ in self.layers]
        step.graphs = [[] for _ in self.layers]
        xs = [x for x, _ in prepared]
        if recompute:
            xs = [moves.to_host(x) for x in xs]  # each layer's input doubles as its stash
        last = len(self.layers)
        step.losses = [None] * len(xs)
        for index, layer in enumerate(self.layers, start=1):
            sharded.gather(index, prefetch=index + 1)
            with observers.compute("layer_forward"):
                for k, x in enumerate(xs):
                    # every graph without recomputation; with it, [Note: the last layer's last micro-batch runs once]
                    if not recompute or (index == last and k == len(xs) - 1 and step.weights[k]):
                        if recompute:
                            step.stash[index - 1].append(None)
                        x_in = (moves.to_device(x) if recompute else x).detach()
                        x_in.requires_grad_(index > 1 and x_in.is_floating_point())
                        with torch.enable_grad():
                            out = layer(x_in, step.side[k])
                        graphs = step.graphs[index - 1]
                        graphs.extend([None] * (k - len(graphs)))  # the recomputed micro-batches keep none
                        graphs.append((x_in, out))
                        y = out.detach()
                    else:
                        step.stash[index - 1].append(_Stashed(x, _rng_state(self._cuda_devices)))
                        y = layer(moves.to_device(x), step.side[k])
                    if index < last:
                        xs[k] = moves.to_host(y) if recompute else y
                        continue
                    # the last layer's output goes into its micro-batch's loss at once (one output held at a
                    # time); a micro-batch without items (all labels ignored) adds nothing, not 0 * nan
                    xs[k] = None
                    if not step.weights[k]:
                        continue
                    kept = step.graphs[index - 1][k] if len(step.graphs[index - 1]) > k else None
                    if kept is None:
                        with torch.no_grad():
                            total += step.weights[k] * loss_fn(k, y, step.side[k]).float()
                    else:  # the graph is kept: so is the loss's, and the backward starts from it (computed once)
                        with torch.enable_grad():
                            step.losses[k] = loss_fn(k, kept[1], step.side[k])
                        total += step.weights[k] * step.losses[k].detach().float()
                    del y
            units[index].free()
        return step

    def backward(self, step: LayeredPass, loss_scale: float | torch.Tensor = 1.0) -> None:
        """Backward layer by layer through ``step`` (the pass :meth:`forward` returned, consumed
        here); leaves the reduced gradients on the local pieces.

        ``loss_scale`` multiplies every micro-batch's loss (a gradient scaler's scale; a tensor
        stays on the device, no host sync).
        """
        if step.consumed:
            raise RuntimeError(
                "LayeredSchedule.backward(): this forward's pass has already been backpropagated (its stash and "
                "graphs are freed); run forward() again for another backward")
        with self.sharded.scheduled():
            try:
                self._backward(step, loss_scale)
            finally:
                step.release()

    def _reduce(self, unit: FlatUnit) -> None:
        self.sharded.reduce_unit(unit)
        if self.on_unit_reduced is not None and unit.trainable:
            self.sharded.wait_reductions()
            self.on_unit_reduced(unit)

    def _run_backward(self, index: int, k: int, x: torch.Tensor, out: torch.Tensor, step: LayeredPass,
                      upstream: list[torch.Tensor | None], loss_scale: float | torch.Tensor) -> None:
        last = len(self.layers)
        if index == last:
            loss, step.losses[k] = step.losses[k], None  # the forward's, where it kept the graph, or none yet
            if loss is None:
                loss = step.loss_fn(k, out, step.side[k])
            objective = loss * (step.weights[k] * loss_scale)
            objective.backward()
        elif out.requires_grad:  # else a frozen layer whose input needs no gradient: nothing to do
            out.backward(self._moves.to_device(upstream[k]))
        upstream[k] = self._moves.to_host(x.grad) if x.requires_grad and x.grad is not None else None

    def _backward(self, step: LayeredPass, loss_scale: float | torch.Tensor) -> None:
        sharded, units = self.sharded, self.sharded.units
        observers = sharded.observers
        n = len(step.weights)
        upstream: list[torch.Tensor | None] = [None] * n
        live = [bool(w) for w in step.weights]  # micro-batches without items contribute nothing
        last = len(self.layers)
        for index in range(last, 0, -1):
            layer = self.layers[index - 1]
            sharded.gather(index, prefetch=index - 1)
            kept = step.recompute and index == last and bool(step.graphs[index - 1])
            order = [n - 1, *range(n - 1)] if kept else range(n)  # [Note: the last layer's last micro-batch runs once]
            with observers.compute("layer_backward"):
                for k in order:
                    if step.recompute and not (kept and k == n - 1):
                        item = step.stash[index - 1][k]
                        step.stash[index - 1][k] = None  # free the stash as we go
                        if not live[k] or item is None:
                            continue
                        x = self._moves.to_device(item.tensor)
                        if index > 1 and x.is_floating_point():
                            x = x.detach().requires_grad_(True)
                        with torch.enable_grad(), torch.random.fork_rng(self._cuda_devices, enabled=True):
                            torch.set_rng_state(item.rng[0])
                            for device, state in zip(self._cuda_devices, item.rng[1]):
                                torch.cuda.set_rng_state(state, device)
                            out = layer(x, step.side[k])
                            self._run_backward(index, k, x, out, step, upstream, loss_scale)
                    else:
                        graph = step.graphs[index - 1][k]
                        step.graphs[index - 1][k] = None
                        if not live[k] or graph is None:
                            continue
                        x, out = graph
                        graph = None  # the inputs and outputs go with the iteration, not with the loop
                        self._run_backward(index, k, x, out, step, upstream, loss_scale)
                        x = out = None
            units[index].free()
            self._reduce(units[index])
        # the root unit (parameters outside the layers, tied ones, ones inside the loss) goes last
        self._reduce(sharded.root)
        sharded.root.free()
        sharded.wait_reductions()
