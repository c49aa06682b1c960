"""Checkpoints that do not stop training: a snapshot in host memory, written by a background thread.

:meth:`BackgroundWriter.submit` blocks only while the model's pieces (and the optimizer state)
are copied to host memory (:func:`~.save_load.prepare` with ``copy=True``); one worker thread
then writes that snapshot with the same code as a synchronous save
(:func:`~.save_load.write_prepared`): staging directory, DCP shards, ``meta.pt``, checksums,
manifest written last, atomic publish (rename-exchange). Every guarantee of a synchronous save
holds, and a kill at any instant of the background write leaves the checkpoints as a kill during
a synchronous save would: the previous ones complete, the new one absent or complete.

[Note: its own process group] The worker's collectives (DCP's planning, the hashing, the
publish's broadcasts) run over a gloo group of the same ranks made for it
(:func:`writer_group`), never over the training's group, where they would interleave with the
training thread's collectives. Every rank submits the same saves in the same order (a save is
collective), so the worker threads meet in the same collectives.

At most one save is in flight: :meth:`submit` first waits for the previous save to finish (its
error, if it failed, is raised there, on every rank). A deletion submitted after a save
(:meth:`remove`: Lightning's top-k bookkeeping) runs after that save has published, on the same
thread, so a newer checkpoint is complete before an older one goes. :meth:`wait` (end of fit,
before a load or a stop) returns when everything submitted is done.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cephalo_lightning.runtime.checkpoint.format import CheckpointError
from cephalo_lightning.runtime.checkpoint.save_load import PreparedSave, prepare, remove, write_prepared
from cephalo_lightning.runtime.distributed import Group, is_distributed
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

THREAD_NAME = "cephalo-checkpoint-writer"


def writer_group(group: Group) -> Group:
    """Collective over the default group (every rank, also those outside ``group``): a gloo group
    of ``group``'s ranks for the background writer; None when there is no process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return dist.new_group(ranks=ranks, backend="gloo")


@dataclass(frozen=True)
class SaveTimes:
    """One background save, measured: the snapshot (training blocked) and the write (not)."""

    path: Path
    snapshot_s: float
    write_s: float


class BackgroundWriter:
    """One fit's asynchronous saves (see the module docstring)."""

    def __init__(self, sharded: ShardedModel, group: Group) -> None:
        self.sharded = sharded
        self.group = group  # the writer's own (writer_group), over the model group's ranks
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self.published: Path | None = None  # the newest checkpoint this writer completed
        self.times: list[SaveTimes] = []
        self._thread = threading.Thread(target=self._work, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def submit(self, path: Path, optimizers: Sequence[torch.optim.Optimizer], meta: dict[str, Any],
               info: dict[str, Any], safe_globals: Sequence[Any] = (), trainable_only: bool = False) -> Path:
        """Collective: snapshot the model now (``trainable_only``: no frozen parameter) and write it in
        the background; returns ``path``."""
        self.wait()  # at most one save in flight
        started = time.perf_counter()
        prepared = prepare(self.sharded, optimizers, meta, safe_globals, copy=True, trainable_only=trainable_only)
        snapshot_s = time.perf_counter() - started
        self._enqueue(lambda: self._write(path, prepared, info, snapshot_s))
        return path

    def remove(self, path: str | Path) -> None:
        """Delete a checkpoint after every save submitted before has published."""
        self._enqueue(lambda: remove(path))

    def wait(self) -> None:
        """Return when everything submitted is done; raises a failed save's error (once)."""
        with self._idle:
            while self._pending:
                self._idle.wait()
            error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"a background checkpoint save failed: {type(error).__name__}: {error}") from error

    def close(self) -> None:
        """Finish what was submitted and stop the thread."""
        try:
            self.wait()
        finally:
            self._jobs.put(None)
            self._thread.join()

    @property
    def in_flight(self) -> bool:
        with self._idle:
            return self._pending > 0

    def _enqueue(self, job: Callable[[], None]) -> None:
        with self._idle:
            self._pending += 1
        self._jobs.put(job)

    def _write(self, path: Path, prepared: PreparedSave, info: dict[str, Any], snapshot_s: float) -> None:
        started = time.perf_counter()
        write_prepared(path, prepared, info, self.group if is_distributed(self.group) else None)
        self.published = Path(path)
        self.times.append(SaveTimes(Path(path), snapshot_s, time.perf_counter() - started))

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if self._error is None:  # after a failure, nothing more is written until wait() reports it
                    job()
            except BaseException as err:  # noqa: BLE001 - handed to the training thread by wait()
                self._error = err
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
