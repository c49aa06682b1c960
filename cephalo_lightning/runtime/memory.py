"""Live accounting of tensor memory on CPU, with an optional capacity (emulated device memory).

CUDA reports allocator statistics; the CPU does not, so :class:`MemoryTracker` counts it itself:
a ``TorchDispatchMode`` sees every tensor an operator returns and follows its storage until the
storage dies (storages keep their Python object alive exactly as long as they live). Buffers the
runtime resizes by hand (a unit's gathered parameters) are reported with :func:`note_resize`.
Tensors created under :meth:`MemoryTracker.host` count as host memory (an offloaded stash) and are
reported separately. Past ``capacity_bytes`` the tracker raises :class:`EmulatedOutOfMemoryError`,
a ``torch.OutOfMemoryError``, as CUDA would.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # the public way to observe every op

from cephalo_lightning.runtime.batching import tensors_in

_ACTIVE: list[MemoryTracker] = []


class EmulatedOutOfMemoryError(torch.OutOfMemoryError):
    """Raised when a rank's accounted memory passes its emulated capacity."""


class MemoryTracker(TorchDispatchMode):
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

    # ------------------------------------------------------------------ bookkeeping

    def _grow(self, nbytes: int, on_host: bool) -> None:
        if on_host:
            self.host_bytes += nbytes
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
            return
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        if self.capacity_bytes is not None and self.current_bytes > self.capacity_bytes:
            gib = 2**30
            raise EmulatedOutOfMemoryError(
                f"Emulated out of memory{f' on {self.label}' if self.label else ''}: tried to allocate "
                f"{nbytes / 2**20:.2f} MiB; {self.current_bytes / gib:.3f} GiB would be in use of an emulated "
                f"capacity of {self.capacity_bytes / gib:.3f} GiB. Lower this rank's micro-batch size or state "
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
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        super().__exit__(*exc)

    @property
    def active(self) -> bool:
        """Whether it is counting now. It may be left and re-entered: what it counted stays
        counted and frees are still seen while it is out (only new allocations are missed)."""
        return self in _ACTIVE

    @contextlib.contextmanager
    def host(self) -> Iterator[None]:
        """Tensors created inside count as host memory (an offloaded stash), not device memory."""
        self._host_depth += 1
        try:
            yield
        finally:
            self._host_depth -= 1

    def resized(self, old_bytes: int, new_bytes: int) -> None:
        if new_bytes > old_bytes:
            self._grow(new_bytes - old_bytes, False)
        else:
            self.current_bytes -= old_bytes - new_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes
        self.peak_host_bytes = self.host_bytes


def active_tracker() -> MemoryTracker | None:
    return _ACTIVE[-1] if _ACTIVE else None


def note_resize(old_bytes: int, new_bytes: int) -> None:
    """Report a storage resized by hand (it bypasses the operators the tracker watches)."""
    tracker = active_tracker()
    if tracker is not None and old_bytes != new_bytes:
        tracker.resized(old_bytes, new_bytes)


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """Allocations inside count as host memory for the active tracker, if any."""
    tracker = active_tracker()
    if tracker is None:
        yield
    else:
        with tracker.host():
            yield
