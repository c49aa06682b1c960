"""One layer's forward and backward time, and its compute memory, at micro-batch sizes 1..k.

What is timed follows the layered schedule (:mod:`cephalo_lightning.runtime.layered`), whose cost
model (:mod:`cephalo_lightning.planner.cost.device_cost`) charges ``F(m)`` in the forward pass and
``F(m) + B(m)`` in the backward pass of every micro-batch:

* forward pass: the layer runs under ``torch.no_grad()`` (no graph is kept), so ``F(m)`` is the
  time of a **no-grad** forward;
* backward pass: the layer's forward is recomputed **with** grad enabled and backpropagated from
  the upstream gradient (``out.backward(grad)``), so ``B(m)`` is defined as that pass minus
  ``F(m)``: the backward plus the extra cost of recording the graph. ``F + B`` is then exactly what
  the backward pass pays per micro-batch, and ``2F + B`` what a micro-batch costs in all.

Both passes are timed inside the emulator's compute region, as the schedule runs them, so an
emulated slowdown of 3 measures about 3x. Like the schedule, which runs all of a layer's
micro-batches back to back in one region, a short call is repeated inside one region until it
lasts ``min_region_ms``, and every region is preceded by one untimed call: the figures are warm,
steady-state compute, whatever ran on the core just before (another rank's turn, the emulator's
wait), so a fast and a slow rank are measured alike. After ``warmup`` rounds, ``repeats`` rounds
interleave the micro-batch sizes so that drift affects them alike. The repeats are reduced to
their minimum on CPU (interference from a shared host only adds time) and their median on CUDA
(:func:`~.timing.default_statistic`).

Compute memory is the peak of a micro-batch's forward + backward of the layer, apart from the
training state, measured on the SECOND of two micro-batches, so that the layer's gradient
accumulated from the first is resident as it is whenever a rank runs more than one: the layer's gathered parameters (in the compute dtype) and buffers, the
micro-batch's input and upstream gradient, activations, temporaries, the input gradient and the
full parameter gradients; plus the flat gradient the runtime reduces the unit from (priced at every
parameter in the master dtype, see :func:`_flat_gradient_bytes`), added to that peak: on CUDA the reduction runs on a side
stream beside the next layer's backward, and a constant keeps the memory linear in m. On CPU it is
counted by a :class:`~cephalo_lightning.runtime.emulation.memory.MemoryTracker` in a separate untimed
pass (the accounting is slow); on CUDA it is the allocator's peak.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from cephalo_lightning._common.errors import ConfigurationError, UnsupportedError
from cephalo_lightning.profiling.options import ProfileOptions
from cephalo_lightning.profiling.region_timing import RegionTimer, default_statistic, summarize
from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator
from cephalo_lightning.runtime.emulation.memory import MemoryTracker
from cephalo_lightning.runtime.layered import Layer
from cephalo_lightning.runtime.sharding.flat_unit import master_dtype_for

MakeInput = Callable[[int], Any]  # m -> the layer's input for m samples, or (input, side inputs)
R = TypeVar("R")
RunStep = Callable[[Callable[[], Any]], Any]  # runs one piece of measurement, returns its result


def run_now(fn: Callable[[], R]) -> R:
    return fn()


@dataclass(frozen=True)
class LayerProfile:
    """One layer's measured costs at ``sizes`` (milliseconds, bytes)."""

    sizes: tuple[int, ...]
    fwd_ms: tuple[float, ...]  # F(m): the no-grad forward of the forward pass
    bwd_ms: tuple[float, ...]  # B(m): backward + graph-recording overhead; F + B = the backward pass
    compute_bytes: tuple[int, ...]  # peak bytes apart from the training state (0 if not measured)
    param_bytes: int  # the gathered parameters in the compute dtype
    resident_bytes: int  # parameters + buffers present while the layer computes
    numel: int  # parameters of the layer (what one all-gather moves)
    backward_pass_ms: tuple[float, ...] = ()  # measured recompute + backward per micro-batch (= F + B)
    graph_bytes: tuple[int, ...] = ()  # held after a forward that keeps its graph (saved tensors, output)
    samples: tuple[tuple[tuple[float, ...], tuple[float, ...]], ...] = ()  # per size: (forward, pass) repeats

    @property
    def step_ms(self) -> tuple[float, ...]:
        """Per micro-batch in the layered schedule: forward pass + backward pass = 2F + B."""
        return tuple(2 * f + b for f, b in zip(self.fwd_ms, self.bwd_ms))


def _check_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    out = tuple(sizes)
    if not out or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in out):
        raise ConfigurationError(f"micro-batch sizes must be a non-empty list of integers >= 1, got {list(sizes)!r}")
    if len(set(out)) != len(out):
        raise ConfigurationError(f"micro-batch sizes must be distinct, got {list(out)}")
    return out


def _prepare_input(x: object, m: int, device: torch.device, dtype: torch.dtype | None, batch_dim: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise UnsupportedError(f"make_input({m}) must return a tensor (a layer takes one hidden tensor), got {type(x).__name__}")
    if x.dim() <= batch_dim or x.shape[batch_dim] != m:
        raise ConfigurationError(
            f"make_input({m}) returned shape {tuple(x.shape)}: dimension {batch_dim} must be the micro-batch size {m}"
        )
    x = x.detach().to(device)
    if dtype is not None and x.is_floating_point():
        x = x.to(dtype)
    return x.contiguous()


def _output(out: object, what: str) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise UnsupportedError(
            f"{what} returned {type(out).__name__}; the layered protocol needs every layer to return ONE tensor"
        )
    return out


def prepare_layer(layer: nn.Module, device: torch.device, compute_dtype: torch.dtype | None) -> nn.Module:
    """A private copy of ``layer`` on ``device`` in the compute dtype (the user's layer is untouched).

    The runtime computes with a gathered copy of the layer's parameters in the compute dtype; a
    copy also keeps the profiling's gradients off the user's parameters.
    """
    work = copy.deepcopy(layer).to(device)
    if compute_dtype is not None:
        work = work.to(compute_dtype)  # floating-point parameters and buffers only
    for p in work.parameters():
        p.grad = None
    return work


class _Runnable:
    """What is measured: a layer's modules (a private copy, or the modules themselves) and its call."""

    def __init__(self, modules: Sequence[nn.Module], call: Callable[[torch.Tensor, Any], torch.Tensor], name: str) -> None:
        self.modules = list(modules)
        self.call = call
        self.name = name

    def __call__(self, x: torch.Tensor, side: Any) -> torch.Tensor:
        return self.call(x, side)

    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for module in self.modules:
            for p in module.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def buffers(self) -> list[torch.Tensor]:
        return [b for module in self.modules for b in module.buffers()]


def _runnable(layer: nn.Module | Layer, device: torch.device, compute_dtype: torch.dtype | None, in_place: bool) -> _Runnable:
    if isinstance(layer, Layer):
        if not in_place and layer.call is not None:
            raise ConfigurationError("a Layer with a call of its own is profiled in place (in_place=True): a copy of its "
                             "modules would not be the modules its call runs")
        if layer.call is not None:
            return _Runnable(layer.modules, layer.call, layer.name or type(layer.modules[0]).__name__)
        layer = layer.modules[0]
    work = layer if in_place else prepare_layer(layer, device, compute_dtype)
    return _Runnable([work], lambda x, side: work(x), type(layer).__name__)


def _bytes(tensors: Sequence[torch.Tensor]) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors))


def _check_region(min_region_ms: float) -> None:
    if min_region_ms < 0:
        raise ConfigurationError(f"min_region_ms must be >= 0, got {min_region_ms}")


def _calibrate(fn: Callable[[], object], min_region_ms: float, timer: RegionTimer) -> int:
    """How many back-to-back calls make a compute region of at least ``min_region_ms``.

    Timed bare (no emulator), so that every rank packs the same amount of compute into a region
    whatever its emulated slowdown.
    """
    fn()  # warm caches and lazy initialisation
    timer.synchronize()
    start = time.perf_counter()
    fn()
    timer.synchronize()
    elapsed_ms = (time.perf_counter() - start) * 1e3
    return max(1, math.ceil(min_region_ms / max(elapsed_ms, 1e-6)))


def profile_layer(
    layer: nn.Module | Layer,
    make_input: MakeInput,
    sizes: Sequence[int],
    *,
    device: torch.device | str = "cpu",
    emulator: DeviceEmulator | None = None,
    compute_dtype: torch.dtype | None = None,
    warmup: int = 1,
    repeats: int = 5,
    min_region_ms: float = 5.0,
    input_requires_grad: bool | None = None,
    measure_memory: bool = True,
    batch_dim: int = 0,
    on_round: Callable[[], None] | None = None,
    run_step: RunStep | None = None,
    statistic: str | None = None,
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    in_place: bool = False,
) -> LayerProfile:
    """Time (and size) one layer at each micro-batch size; see the module docstring for the definitions.

    ``layer``: a module (called on the hidden state) or a :class:`~cephalo_lightning.runtime.layered.Layer`
    (its modules and a ``call(hidden, side)``); ``make_input(m)`` may return ``(hidden, side)``.
    ``in_place``: measure the layer's own modules (e.g. a sharded unit gathered for the purpose,
    already in the compute dtype) instead of a private copy; gradients are cleared afterwards.

    ``loss_fn`` (for the last layer): backpropagate ``loss_fn(out)`` instead of a random upstream
    gradient, so the loss's own time and memory (e.g. a softmax over the vocabulary) are counted.

    ``make_input(m)`` returns the layer's input for a micro-batch of ``m`` samples (``m`` along
    ``batch_dim``). ``input_requires_grad``: whether the backward also computes the input's
    gradient (default: for floating-point inputs, as every layer but the first does in the
    layered schedule). ``min_region_ms``: the shortest compute region; short calls are repeated
    back to back inside one region, as the schedule runs a layer's micro-batches back to back.
    ``on_round`` is called after every round over the sizes (progress). ``run_step(fn)`` runs
    each piece of measurement (the calibration, every timed region, the memory pass); ranks that
    share a host pass one that takes turns (:class:`~.turns.TurnTaker`). ``statistic``: how the
    repeats are reduced, ``"min"`` or ``"median"`` (default: :func:`~.timing.default_statistic`).
    The layer is profiled on a private copy (unless ``in_place``); the global RNG state is left as it was.
    """
    sizes = _check_sizes(sizes)
    if warmup < 0 or repeats < 1:
        raise ConfigurationError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    _check_region(min_region_ms)
    device = torch.device(device)
    summarize([0.0], statistic or default_statistic(device))  # refused in these words, before ProfileOptions would
    options = ProfileOptions(max_micro_batch=max(sizes), warmup=warmup, repeats=repeats, min_region_ms=min_region_ms,
                             compute_dtype=compute_dtype, measure_memory=measure_memory, batch_dim=batch_dim,
                             statistic=statistic)
    return measure_layer(layer, make_input, sizes, options, device=device, emulator=emulator,
                         input_requires_grad=input_requires_grad, loss_fn=loss_fn, in_place=in_place,
                         on_round=on_round, run_step=run_step)


def measure_layer(
    layer: nn.Module | Layer,
    make_input: MakeInput,
    sizes: Sequence[int],
    options: ProfileOptions,
    *,
    device: torch.device,
    emulator: DeviceEmulator | None = None,
    input_requires_grad: bool | None = None,
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    in_place: bool = False,
    on_round: Callable[[], None] | None = None,
    run_step: RunStep | None = None,
) -> LayerProfile:
    """:func:`profile_layer` with the options whole (``max_micro_batch`` aside: ``sizes`` are measured)."""
    sizes = _check_sizes(sizes)
    _check_region(options.min_region_ms)
    step: RunStep = run_step or run_now
    statistic = options.statistic or default_statistic(device)
    compute_dtype, measure_memory = options.compute_dtype, options.measure_memory
    cuda_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(cuda_devices):
        torch.manual_seed(0)  # the same inputs and upstream gradients on every rank and every run
        work = _runnable(layer, device, compute_dtype, in_place)
        params = work.parameters()
        param_bytes = _bytes(params)
        resident_bytes = param_bytes + _bytes(work.buffers())
        inputs, sides = {}, {}
        for m in sizes:
            given = make_input(m)
            x, sides[m] = given if isinstance(given, tuple) and len(given) == 2 else (given, None)
            inputs[m] = _prepare_input(x, m, device, compute_dtype, options.batch_dim)
        needs_grad = {
            m: x.is_floating_point() and (input_requires_grad is None or input_requires_grad)
            for m, x in inputs.items()
        }
        with torch.no_grad():
            grads = {m: torch.randn_like(_output(work(x, sides[m]), f"{work.name}.forward")) for m, x in inputs.items()}
        timer = RegionTimer(device, emulator)

        def forward_pass(m: int) -> None:
            with torch.no_grad():
                work(inputs[m], sides[m])

        def backward_pass(m: int) -> None:
            _forward_backward(work, inputs[m], sides[m], grads[m], needs_grad[m], loss_fn, copy_inputs=False)

        def region(call: Callable[[int], None], m: int, count: int) -> float:
            def run() -> None:
                for _ in range(count):
                    call(m)

            call(m)  # untimed: warm the caches, whatever ran on this core before (another rank, a wait)
            timer.synchronize()
            for p in params:  # gradients accumulate over the region, as over a layer's micro-batches
                p.grad = None
            return timer.time(run)[1] / count

        counts = step(lambda: {
            m: (
                _calibrate(lambda: forward_pass(m), options.min_region_ms, timer),
                _calibrate(lambda: backward_pass(m), options.min_region_ms, timer),
            )
            for m in sizes
        })
        fwd_samples: dict[int, list[float]] = {m: [] for m in sizes}
        pass_samples: dict[int, list[float]] = {m: [] for m in sizes}

        for round_index in range(options.warmup + options.repeats):
            for m in sizes:
                # one region per step: with turns, the other ranks measure between two regions
                t_fwd = step(lambda: region(forward_pass, m, counts[m][0]))
                t_pass = step(lambda: region(backward_pass, m, counts[m][1]))
                if round_index >= options.warmup:
                    fwd_samples[m].append(t_fwd)
                    pass_samples[m].append(t_pass)
            if on_round is not None:
                on_round()
        for p in params:
            p.grad = None
        compute = step(lambda: tuple(
            _peak_bytes(work, inputs[m], sides[m], grads[m], needs_grad[m], resident_bytes, device, loss_fn)
            if measure_memory else 0
            for m in sizes
        ))
        graph = step(lambda: tuple(
            _graph_bytes(work, inputs[m], sides[m], needs_grad[m], device) if measure_memory else 0 for m in sizes))
    fwd = tuple(summarize(fwd_samples[m], statistic) for m in sizes)
    passes = tuple(summarize(pass_samples[m], statistic) for m in sizes)
    return LayerProfile(
        sizes=sizes,
        fwd_ms=fwd,
        bwd_ms=tuple(max(0.0, p - f) for f, p in zip(fwd, passes)),
        compute_bytes=compute,
        param_bytes=param_bytes,
        resident_bytes=resident_bytes,
        numel=sum(p.numel() for p in params),
        backward_pass_ms=passes,
        graph_bytes=graph,
        samples=tuple((tuple(fwd_samples[m]), tuple(pass_samples[m])) for m in sizes),
    )


def _forward_backward(
    work: _Runnable, x: torch.Tensor, side: Any, grad: torch.Tensor, needs_grad: bool,
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None, copy_inputs: bool = True,
) -> None:
    """One recompute-with-grad and backward of the layer, as the layered schedule runs it.

    ``copy_inputs``: the micro-batch's input and upstream gradient are brought to the device
    from the stash, so for the memory count they are fresh copies.
    """
    if copy_inputs:
        x, grad = x.clone(), grad.clone()
    x = x.detach().requires_grad_(True) if needs_grad else x
    with torch.enable_grad():
        out = work(x, side)
        if loss_fn is not None:
            loss_fn(out).backward()
        elif out.requires_grad:  # else nothing to differentiate: no trainable parameter, no input grad
            out.backward(grad)


def _graph_bytes(work: _Runnable, x: torch.Tensor, side: Any, needs_grad: bool, device: torch.device) -> int:
    """Bytes a forward that keeps its autograd graph holds afterwards: what a rank that does not
    recompute keeps of this layer until its backward (saved activations and the output)."""
    x = x.detach().requires_grad_(True) if needs_grad else x
    if device.type == "cuda":  # pragma: no cover - CUDA only
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        with torch.enable_grad():
            out = work(x, side)
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_allocated(device) - base
        del out
        return int(held)
    with MemoryTracker(label="profiler") as tracker, torch.enable_grad():
        out = work(x, side)
        held = tracker.current_bytes
        del out
    return int(held)


def _flat_gradient_bytes(params: Sequence[nn.Parameter]) -> int:
    """Bytes priced for the flat gradient the runtime reduces a unit of ``params`` from: every
    parameter in the master dtype (fp32; fp64 for an fp64 model), none without a trainable one (such
    a unit is not reduced). The flat gradient itself holds the trainable parameters only
    ([Note: a frozen part holds no gradient]); the frozen ones' place bounds what a prefetched
    all-gather of a unit with frozen parameters holds beside it and no other term prices: its send
    buffer, this rank's shard of the unit assembled in the compute dtype."""
    if not any(p.requires_grad for p in params):
        return 0
    return sum(p.numel() * master_dtype_for(p.dtype).itemsize for p in params)


def _peak_bytes(
    work: _Runnable, x: torch.Tensor, side: Any, grad: torch.Tensor, needs_grad: bool, resident_bytes: int,
    device: torch.device, loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> int:
    """Peak bytes of one forward + backward and the reduction's flat gradient, counting the resident
    layer (see the module docstring)."""
    params = work.parameters()
    for p in params:
        p.grad = None
    flat = _flat_gradient_bytes(params)
    try:
        if device.type == "cuda":  # pragma: no cover - CUDA only
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            for _ in range(2):
                _forward_backward(work, x, side, grad, needs_grad, loss_fn)
            torch.cuda.synchronize(device)
            return int(torch.cuda.max_memory_allocated(device) - base + resident_bytes + flat)
        # the layer was built before the tracker started: its bytes are the baseline
        with MemoryTracker(baseline_bytes=resident_bytes, label="profiler") as tracker:
            for _ in range(2):  # the second micro-batch runs beside the first one's gradient
                _forward_backward(work, x, side, grad, needs_grad, loss_fn)
        return int(tracker.peak_bytes) + flat
    finally:
        for p in params:
            p.grad = None
