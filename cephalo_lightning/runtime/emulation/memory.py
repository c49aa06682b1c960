"""Live accounting of tensor memory on CPU, with an optional capacity (emulated device memory).

CUDA reports allocator statistics; the CPU does not, so :class:`MemoryTracker` counts it itself:
a ``TorchDispatchMode`` sees every tensor an operator returns and follows its storage until the
storage dies (storages keep their Python object alive exactly as long as they live). The tracker is
also a runtime :class:`~.observers.Observer`: attached to a sharded model it hears of the buffers
the runtime resizes by hand (a unit's gathered parameters), and tensors created inside its
:meth:`~MemoryTracker.host_allocations` count as host memory (an offloaded stash), reported
separately. Past ``capacity_bytes`` the tracker raises :class:`EmulatedOutOfMemoryError`, a
``torch.OutOfMemoryError``, as CUDA would. :class:`SampledTracking` is the ``with`` block a
training loop puts around each step.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # the public way to observe every op

from cephalo_lightning._common.errors import CephaloError, ConfigurationError
from cephalo_lightning._common.units import GIB
from cephalo_lightning.runtime.batching import tensors_in
from cephalo_lightning.runtime.observers import Observer, Observers


class EmulatedOutOfMemoryError(CephaloError, torch.OutOfMemoryError):
    """Raised when a rank's accounted memory passes its emulated capacity."""


class MemoryTracker(TorchDispatchMode, Observer):
    """Counts the bytes of live tensor storages created while it is active."""

    def __init__(self, capacity_bytes: float | None = None, baseline_bytes: int = 0, label: str = "") -> None:
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self.label = label
        self.current_bytes = int(baseline_bytes)
        self.peak_bytes = self.current_bytes
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self._live: dict[int, tuple[int, bool]] = {}
        self._host_depth = 0
        self._depth = 0

    # ------------------------------------------------------------------ bookkeeping

    def _grow(self, nbytes: int, on_host: bool) -> None:
        if on_host:
            self.host_bytes += nbytes
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
            return
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        if self.capacity_bytes is not None and self.current_bytes > self.capacity_bytes:
            raise EmulatedOutOfMemoryError(
                f"Emulated out of memory{f' on {self.label}' if self.label else ''}: tried to allocate "
                f"{nbytes / 2**20:.2f} MiB; {self.current_bytes / GIB:.3f} GiB would be in use of an emulated "
                f"capacity of {self.capacity_bytes / GIB:.3f} GiB. Lower this rank's micro-batch size or state "
                "share (re-plan with the true capacity), or raise its emulated memory_gb."
            )

    def _shrink(self, key: int) -> None:
        nbytes, on_host = self._live.pop(key, (0, False))
        if on_host:
            self.host_bytes -= nbytes
        else:
            self.current_bytes -= nbytes

    @staticmethod
    def _storage(tensor: torch.Tensor) -> Any:
        if tensor.device.type == "meta":
            return None
        try:
            return tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
            return None

    def _see(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        storage = self._storage(tensor)
        if storage is None:
            return
        key = id(storage)
        nbytes = storage.nbytes()
        # an output that aliases an input (a view, an in-place op, a collective's output buffer)
        # allocated nothing, even when the input's storage predates the tracker
        if key in self._live or key in inputs or nbytes == 0:
            return
        on_host = self._host_depth > 0
        self._live[key] = (nbytes, on_host)
        weakref.finalize(storage, self._shrink, key)
        self._grow(nbytes, on_host)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {id(st) for t in tensors_in([args, kwargs]) if (st := self._storage(t)) is not None}
        for tensor in tensors_in(out):
            self._see(tensor, inputs)
        return out

    # ------------------------------------------------------------------ public

    def __enter__(self) -> MemoryTracker:
        super().__enter__()
        self._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        super().__exit__(*exc)

    @property
    def active(self) -> bool:
        """Whether it is counting now. It may be left and re-entered: what it counted stays
        counted and frees are still seen while it is out (only new allocations are missed)."""
        return self._depth > 0

    @contextlib.contextmanager
    def host_allocations(self) -> Iterator[None]:
        """Tensors created inside count as host memory (an offloaded stash), not device memory."""
        self._host_depth += 1
        try:
            yield
        finally:
            self._host_depth -= 1

    def storage_resized(self, old_bytes: int, new_bytes: int) -> None:
        if not self.active:
            return
        if new_bytes > old_bytes:
            self._grow(new_bytes - old_bytes, False)
        else:
            self.current_bytes -= old_bytes - new_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes
        self.peak_host_bytes = self.host_bytes


class SampledTracking:
    """Counts a training step's tensors with ``tracker``, on the first steps and every N-th.

    Counting every tensor is slow on CPU, and steps repeat the same allocations, so steps
    ``< first`` and every ``every``-th step are counted and the others run at full speed. Use
    :meth:`step` as the ``with`` block around each piece of a step (forward, backward,
    optimizer step); the tracker is attached to ``observers`` for the same block, so the
    runtime's hand-resized buffers and offloaded stash are counted too.
    """

    def __init__(self, tracker: MemoryTracker, observers: Observers, every: int, first: int = 3) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigurationError(f"memory_check_every_n_steps must be an integer >= 1, got {every!r}")
        self.tracker = tracker
        self.observers = observers
        self.every = every
        self.first = first

    def counts(self, step: int) -> bool:
        return step < self.first or step % self.every == 0

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if self.tracker.active or not self.counts(step):  # nested, or a step run at full speed
            yield
            return
        with self.observers.attached(self.tracker), self.tracker:
            yield
