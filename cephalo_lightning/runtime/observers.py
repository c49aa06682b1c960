"""What the runtime tells the outside world: compute regions, collectives, hand-made allocations.

Timing, emulation, memory accounting and the callback's watch are *observers* attached to a
:class:`~cephalo_lightning.runtime.sharding.sharded_model.ShardedModel`. The runtime reports events to its
:class:`Observers`; with none attached every report is one truth test of an empty list, so a
real-device run without observers reads no clock, creates no CUDA event and keeps no state.

Every event also opens a ``torch.profiler.record_function`` range (``cephalo::all_gather``,
``cephalo::layer_forward``, ...), so a torch profiler trace shows the schedule. Outside a profiler
a range costs a few microseconds per unit and step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.profiler import record_function


class Observer:
    """Base class of runtime observers: every method does nothing; override what you need.

    ``region`` names a compute region (``"layer_forward"``, ``"layer_backward"``,
    ``"optimizer_step"``, ...); ``op`` a collective (``"all_gather"``, ``"reduce_scatter"``,
    ``"all_to_all"``); an asynchronous collective is heard twice, at its issue and at its wait.
    Regions may nest (an observer that measures should count the outermost).
    """

    def compute_begin(self, region: str) -> None:
        pass

    def compute_end(self, region: str) -> None:
        pass

    def collective_begin(self, op: str, unit: str, numel: int) -> None:
        pass

    def collective_end(self, op: str, unit: str, numel: int) -> None:
        pass

    def storage_resized(self, old_bytes: int, new_bytes: int) -> None:
        """A buffer the runtime resized by hand (a unit's gathered parameters)."""

    def host_allocations(self) -> contextlib.AbstractContextManager[None]:
        """Allocations inside this context are host memory (an offloaded stash), not device memory."""
        return contextlib.nullcontext()


class Observers:
    """The observers attached to one runtime object, notified in attachment order."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: list[Observer] = []

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Observer]:
        return iter(self._items)

    def attach(self, observer: Observer, outermost: bool = False) -> Observer:
        """Add ``observer``; ``outermost``: its regions enclose every other observer's (it begins
        first and ends last), e.g. a timer that must include an emulator's waits."""
        if observer not in self._items:
            if outermost:
                self._items.insert(0, observer)
            else:
                self._items.append(observer)
        return observer

    def detach(self, observer: Observer) -> None:
        if observer in self._items:
            self._items.remove(observer)

    @contextlib.contextmanager
    def attached(self, observer: Observer) -> Iterator[Observer]:
        """``observer`` is attached inside the block only (unless it was attached before)."""
        present = observer in self._items
        self.attach(observer)
        try:
            yield observer
        finally:
            if not present:
                self.detach(observer)

    def compute_begin(self, region: str) -> None:
        """A compute region opens (in attachment order); for regions whose end is another event's
        (a unit's forward opens in one hook and closes in the next), else use :meth:`compute`."""
        for observer in self._items:
            observer.compute_begin(region)

    def compute_end(self, region: str) -> None:
        """A compute region closes (in reverse attachment order: the outermost observer last)."""
        for observer in reversed(self._items):
            observer.compute_end(region)

    @contextlib.contextmanager
    def compute(self, region: str) -> Iterator[None]:
        with record_function(f"cephalo::{region}"):
            if not self._items:
                yield
                return
            self.compute_begin(region)
            try:
                yield
            finally:
                self.compute_end(region)

    @contextlib.contextmanager
    def collective(self, op: str, unit: str, numel: int) -> Iterator[None]:
        with record_function(f"cephalo::{op}"):
            items = self._items
            if not items:
                yield
                return
            for observer in items:
                observer.collective_begin(op, unit, numel)
            try:
                yield
            finally:
                for observer in reversed(items):
                    observer.collective_end(op, unit, numel)

    def storage_resized(self, old_bytes: int, new_bytes: int) -> None:
        for observer in self._items:
            observer.storage_resized(old_bytes, new_bytes)

    @contextlib.contextmanager
    def host_allocations(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for observer in self._items:
                stack.enter_context(observer.host_allocations())
            yield
