"""A whole model's per-layer profile: every distinct layer measured once, figures per average layer.

The planner prices a step as ``num_layers x`` one layer's cost (:mod:`cephalo_lightning.planner.cost.device_cost`).
The model's layers are not all alike (the embedding and the head differ from the blocks), so the
per-layer figures reported here are the **mean over the L layers**: ``sum_l F_l(m) / L``, which
makes ``num_layers x F(m)`` the whole model's cost. Compute memory is the **maximum** over the
layers, because the schedule holds one layer at a time and the worst one sets the peak.

Layers with the same structure, parameter shapes and input shape (every transformer block) share
one measurement. The layers are walked in order: each layer's inputs at micro-batch sizes 1..k come
from a no-grad pass of micro-batches of the sample (its rows repeated to reach m rows) through the
layers before it, so only one layer's inputs are held at a time. A sharded model is profiled in
place, one unit at a time (``unit_context(i)`` gathers layer i's unit on every rank), so
profiling never needs the whole model on one device.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning.profiling.layer import LayerProfile, RunStep, _output, measure_layer, prepare_layer, run_now
from cephalo_lightning.profiling.options import ProfileOptions
from cephalo_lightning.runtime.batching import index_batch, leading_size
from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator
from cephalo_lightning.runtime.layered import Layer


@dataclass(frozen=True)
class LayerKind:
    """Layers that share one measurement: their signature, positions and profile."""

    signature: str
    name: str  # the first such layer's class name, for reports
    indices: tuple[int, ...]
    profile: LayerProfile


@dataclass(frozen=True)
class ModelProfile:
    """One device's profile of the whole model, in the planner's per-layer terms."""

    sizes: tuple[int, ...]  # 1..k
    num_layers: int
    layer_fwd_ms: tuple[float, ...]  # mean over the layers of F_l(m)
    layer_bwd_ms: tuple[float, ...]  # mean over the layers of B_l(m)
    compute_memory_bytes: tuple[int, ...]  # max over the layers, prefetched neighbour included
    parameters: int  # trainable parameters of the layers
    layer_numels: tuple[int, ...]  # parameters of every layer (what its all-gather moves)
    kinds: tuple[LayerKind, ...]
    seconds: float  # wall time the profile took
    activation_memory_bytes: tuple[int, ...] = ()  # sum over the layers of the graph a kept forward holds
    # bytes of one sample's input to every layer (what the layered schedule stashes per sample and
    # layer), and of one sample's output of the last layer (held from the forward pass to the loss)
    input_bytes_per_sample: tuple[float, ...] = ()
    output_bytes_per_sample: float = 0.0
    layer_trainable_numels: tuple[int, ...] = ()  # trainable parameters of every layer (what its reduce-scatter moves)

    @property
    def kept_bytes_per_sample(self) -> float:
        """What one sample keeps between the layered passes when the stash stays on the device."""
        return float(sum(self.input_bytes_per_sample)) + self.output_bytes_per_sample


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def gathered_bytes(layer: nn.Module, compute_dtype: torch.dtype | None) -> int:
    """Bytes of the layer's parameters once gathered in the compute dtype (floating ones are cast)."""
    total = 0
    for p in layer.parameters():
        size = _dtype_size(compute_dtype) if compute_dtype is not None and p.is_floating_point() else p.element_size()
        total += p.numel() * size
    return total


def layer_signature(layer: nn.Module, sample: torch.Tensor, batch_dim: int = 0) -> str:
    """A digest of what a layer's cost depends on: module tree, parameter and buffer shapes, input shape.

    Two layers with the same signature cost the same, so one is measured for both.
    """
    shape = list(sample.shape)
    shape[batch_dim] = -1
    described = {
        "modules": [
            (name, type(m).__module__ + "." + type(m).__qualname__, m.training) for name, m in layer.named_modules()
        ],
        "params": [(n, list(p.shape), str(p.dtype), p.requires_grad) for n, p in layer.named_parameters()],
        "buffers": [(n, list(b.shape), str(b.dtype)) for n, b in layer.named_buffers()],
        "extra": [(name, m.extra_repr()) for name, m in layer.named_modules()],
        "input": (shape, str(sample.dtype)),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]


def take_rows(x: torch.Tensor, m: int, batch_dim: int = 0) -> torch.Tensor:
    """``m`` rows of ``x`` along ``batch_dim``, cycling through its rows when it has fewer."""
    rows = x.shape[batch_dim]
    index = torch.arange(m, device=x.device) % rows
    return x.index_select(batch_dim, index)


def _on_device(layer: nn.Module, device: torch.device) -> bool:
    tensors = list(layer.parameters()) + list(layer.buffers())
    return all(t.device == device for t in tensors) if tensors else True


def _signature(layer: nn.Module | Layer, sample: torch.Tensor, batch_dim: int) -> str:
    modules = layer.modules if isinstance(layer, Layer) else (layer,)
    parts = [layer_signature(module, sample, batch_dim) for module in modules]
    return parts[0] if len(parts) == 1 else hashlib.sha256("+".join(parts).encode()).hexdigest()[:16]


def _modules(layer: nn.Module | Layer) -> tuple[nn.Module, ...]:
    return layer.modules if isinstance(layer, Layer) else (layer,)


def _rows(sample: Any, m: int, batch_dim: int) -> Any:
    """A micro-batch of ``m`` rows of the sample (a tensor or a nested batch), rows repeated as needed."""
    if isinstance(sample, torch.Tensor):
        return take_rows(sample, m, batch_dim)
    rows = leading_size(sample) or 1
    return index_batch(sample, torch.arange(m) % rows)


@dataclass(frozen=True)
class ModelHooks:
    """How the profiled model is driven beyond its layers' own calls (every hook is optional)."""

    prepare: Callable[[Any], tuple[torch.Tensor, Any]] | None = None  # micro-batch -> (first input, side inputs)
    loss: Callable[[torch.Tensor, Any, Any], torch.Tensor] | None = None  # loss(last output, micro_batch, side)
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None  # loss_fn(last output): the loss behind the last layer
    unit_context: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None  # gathers layer i's unit


@dataclass(frozen=True)
class Pacing:
    """How this rank's measurement is paced among the ranks, and reported."""

    run_step: RunStep | None = None  # runs each piece of measurement (a TurnTaker takes turns)
    layer_turns: Callable[[], contextlib.AbstractContextManager[RunStep]] | None = None  # a fresh turn-taker per layer
    on_progress: Callable[[int, int], None] | None = None  # (done, total) after every measurement round
    measure: bool = True  # False: only follow the unit gathers (a rank another one measures for)


def profile_model(
    layers: Sequence[nn.Module | Layer],
    sample_input: Any,
    options: ProfileOptions | None = None,
    *,
    device: torch.device | str = "cpu",
    emulator: DeviceEmulator | None = None,
    hooks: ModelHooks = ModelHooks(),
    pacing: Pacing = Pacing(),
) -> ModelProfile | None:
    """Profile ``layers`` (the model in execution order) at micro-batch sizes ``1..options.max_micro_batch``.

    ``sample_input``: the first layer's input for a sample batch (any number of rows >= 1); or,
    with ``hooks.prepare(micro_batch) -> (first input, side inputs)``, a sample *batch* (a layered
    model's, :class:`~cephalo_lightning.models.protocol.LayeredModel`) and ``hooks.loss(output,
    micro_batch, side)`` for the last layer. ``options.prefetch``: the runtime gathers the next
    layer while one computes (its default), so a neighbour's gathered parameters count in each
    layer's compute memory. ``options.resident_bytes``: memory held for the whole step on top (e.g.
    the gathered root unit). ``hooks.loss_fn(last_output) -> loss``: measure the last layer with the
    loss behind it (its time and, above all, its memory: a softmax over a vocabulary).

    A sharded model: ``hooks.unit_context(i)`` gathers layer i's unit around everything done with
    it (every rank enters it, in order, measuring or not), the layers are measured in place, and
    ``pacing.layer_turns()`` hands out a fresh turn-taker per layer (measuring ranks take turns;
    the others only follow the gathers, with ``pacing.measure=False``, and get ``None`` back).
    """
    options = options or ProfileOptions()
    batch_dim, measure = options.batch_dim, pacing.measure
    if not layers:
        raise ConfigurationError("profile_model needs at least one layer")
    if hooks.prepare is None and (not isinstance(sample_input, torch.Tensor) or sample_input.dim() <= batch_dim
                                  or sample_input.shape[batch_dim] < 1):
        shape = tuple(sample_input.shape) if isinstance(sample_input, torch.Tensor) else type(sample_input).__name__
        raise ConfigurationError(f"sample_input of shape {shape} needs at least one sample along dimension {batch_dim}")
    started = time.perf_counter()
    device = torch.device(device)
    sizes = tuple(range(1, options.max_micro_batch + 1))
    in_place = hooks.unit_context is not None
    unit_context = hooks.unit_context or (lambda index: contextlib.nullcontext())
    layer_turns = pacing.layer_turns or (lambda: contextlib.nullcontext(pacing.run_step or run_now))
    batches = {m: _rows(sample_input, m, batch_dim) for m in sizes}
    sides: dict[int, Any] = {m: None for m in sizes}  # each size's side inputs, from hooks.prepare (first layer)
    loss_fn = hooks.loss_fn
    if hooks.loss is not None and loss_fn is None:
        model_loss = hooks.loss

        def loss_fn(out: torch.Tensor) -> torch.Tensor:  # the micro-batch and side inputs of the output's size
            m = out.shape[batch_dim]
            return model_loss(out, batches[m], sides[m])
    total = len(layers) * (options.warmup + options.repeats)  # at most: identical layers are measured once
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if pacing.on_progress is not None:
            pacing.on_progress(done, total)

    if pacing.on_progress is not None and measure:
        pacing.on_progress(0, total)
    xs: dict[int, torch.Tensor] = {}
    inputs: list[float] = []  # bytes per sample of every layer's input, measured on the largest size
    output = 0.0
    kinds: dict[str, LayerKind] = {}
    of_layer: dict[int, LayerProfile] = {}
    gathered: list[int] = []
    numels: list[tuple[int, int]] = []  # every layer's (parameters, trainable ones), counted while gathered
    cuda_devices = [device.index or 0] if device.type == "cuda" else []
    for index, layer in enumerate(layers):
        with unit_context(index), layer_turns() as step:
            gathered.append(sum(gathered_bytes(module, options.compute_dtype) for module in _modules(layer)))
            numels.append(_numels(layer))
            if not measure:
                continue
            if index == 0:
                def first() -> dict[int, torch.Tensor]:
                    with torch.no_grad(), torch.random.fork_rng(cuda_devices):
                        out = {}
                        for m in sizes:
                            out[m], sides[m] = hooks.prepare(batches[m]) if hooks.prepare is not None else (batches[m], None)
                        return {m: x.to(device) for m, x in out.items()}
                xs = step(first)
            last = index == len(layers) - 1
            top = sizes[-1]
            inputs.append(_tensor_bytes(xs[top]) / top)
            signature = _signature(layer, xs[1], batch_dim) + ("+loss" if last and loss_fn else "")
            if signature in kinds:
                kinds[signature] = replace(kinds[signature], indices=kinds[signature].indices + (index,))
            else:
                runnable = layer if isinstance(layer, Layer) else (Layer((layer,)) if in_place else layer)
                profile = measure_layer(
                    runnable, lambda m: (xs[m], sides[m]), sizes, options, device=device, emulator=emulator,
                    input_requires_grad=index > 0, loss_fn=loss_fn if last else None, in_place=in_place,
                    on_round=tick, run_step=step,
                )
                name = type(_modules(layer)[0]).__name__
                kinds[signature] = LayerKind(signature, name, (index,), profile)
            of_layer[index] = kinds[signature].profile
            if last:  # the last layer's output, which the forward pass holds for the loss
                run_last = layer if isinstance(layer, Layer) else Layer((layer,))

                def last_output() -> float:
                    with torch.no_grad(), torch.random.fork_rng(cuda_devices):
                        work = run_last if in_place or isinstance(layer, Layer) else _copied(layer, device)
                        out = _output(work(xs[top], sides[top]), f"layer {index} ({type(_modules(layer)[0]).__name__})")
                        return _tensor_bytes(out) / top
                output = step(last_output)
            if index + 1 < len(layers):
                run = layer if isinstance(layer, Layer) else Layer((layer,))

                def advance() -> dict[int, torch.Tensor]:
                    with torch.no_grad(), torch.random.fork_rng(cuda_devices):
                        work = run if in_place or isinstance(layer, Layer) else _copied(layer, device)
                        return {m: _output(work(xs[m], sides[m]), f"layer {index} ({type(_modules(layer)[0]).__name__})")
                                for m in sizes}
                xs = step(advance)
    if not measure:
        return None
    profile = _per_average_layer(numels, sizes, of_layer, gathered, tuple(kinds.values()), options,
                                 time.perf_counter() - started)
    return replace(profile, input_bytes_per_sample=tuple(inputs), output_bytes_per_sample=output)


def _tensor_bytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _numels(layer: nn.Module | Layer) -> tuple[int, int]:
    """A layer's parameters and its trainable ones. Counted inside the layer's unit context: a sharded
    layer's parameters outside it are the rank's shard or empty, not what its all-gather moves."""
    params = [p for module in _modules(layer) for p in module.parameters()]
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def _per_average_layer(numels: Sequence[tuple[int, int]], sizes: tuple[int, ...], of_layer: dict[int, LayerProfile],
                       gathered: Sequence[int], kinds: tuple[LayerKind, ...], options: ProfileOptions,
                       seconds: float) -> ModelProfile:
    """Every layer's measurement as the planner's per-layer figures (see the module docstring)."""
    num_layers = len(numels)
    fwd = tuple(sum(of_layer[i].fwd_ms[j] for i in range(num_layers)) / num_layers for j in range(len(sizes)))
    bwd = tuple(sum(of_layer[i].bwd_ms[j] for i in range(num_layers)) / num_layers for j in range(len(sizes)))
    memory = []
    for j in range(len(sizes)):
        worst = 0
        for i in range(num_layers):
            neighbour = max(gathered[i - 1] if i > 0 else 0, gathered[i + 1] if i + 1 < num_layers else 0)
            worst = max(worst, of_layer[i].compute_bytes[j] + (neighbour if options.prefetch else 0))
        memory.append(worst + int(options.resident_bytes))
    return ModelProfile(
        sizes=sizes,
        num_layers=num_layers,
        layer_fwd_ms=fwd,
        layer_bwd_ms=bwd,
        compute_memory_bytes=tuple(memory),
        activation_memory_bytes=tuple(sum(of_layer[i].graph_bytes[j] for i in range(num_layers))
                                      for j in range(len(sizes))) if all(of_layer[i].graph_bytes for i in of_layer) else (),
        parameters=sum(trainable for _, trainable in numels),
        layer_numels=tuple(total for total, _ in numels),
        layer_trainable_numels=tuple(trainable for _, trainable in numels),
        kinds=kinds,
        seconds=seconds,
    )


def _copied(layer: nn.Module, device: torch.device) -> Layer:
    """A layer that still lives elsewhere (the host) run as a temporary copy on ``device``."""
    run = layer if _on_device(layer, device) else prepare_layer(layer, device, None)
    return Layer((run,))
