"""DCP's public planners for logical tensors held as contiguous pieces of their flattened values.

A rank owns elements [start, stop) of a row-major tensor; :func:`boxes` decomposes that range
into the few rectangular chunks DCP stores. :class:`ShardSavePlanner` writes each rank's chunks,
:class:`ShardLoadPlanner` reads the overlap of the stored chunks with the ones a rank asks for,
whatever layout wrote them.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from cephalo_lightning.runtime.checkpoint.format import MODEL_PREFIX, CheckpointError

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes), one per dimension


def boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The rectangular chunks that elements [start, stop) of a row-major tensor of ``shape`` form.

    Each chunk is contiguous in the flattened tensor, in order; there are at most 2*ndim - 1.
    """
    shape = tuple(int(s) for s in shape)
    if stop <= start:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    out: list[Box] = []
    row = start // inner
    if start % inner:  # the partial first row
        end = min(stop, (row + 1) * inner)
        out += [((row, *o), (1, *s)) for o, s in boxes(shape[1:], start - row * inner, end - row * inner)]
        start, row = end, row + 1
    full = (stop - start) // inner
    if full:
        out.append(((row, *([0] * (len(shape) - 1))), (full, *shape[1:])))
        start, row = start + full * inner, row + full
    if start < stop:  # the partial last row
        out += [((row, *o), (1, *s)) for o, s in boxes(shape[1:], 0, stop - start)]
    return out


def _overlap(a: Box, b: Box) -> Box | None:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1]))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


@dataclass
class Entry:
    """One logical tensor this rank takes part in: its global shape and its local chunks.

    ``flat`` is this rank's contiguous piece (elements [start, start + numel) of the flattened
    tensor); each chunk is a view of it.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    flat: torch.Tensor
    start: int

    def chunks(self) -> Iterator[tuple[Box, torch.Tensor]]:
        offset = 0
        for box in boxes(self.shape, self.start, self.start + self.flat.numel()):
            n = math.prod(box[1])
            yield box, self.flat[offset : offset + n].view(box[1])
            offset += n


class ShardSavePlanner(SavePlanner):
    """Writes each rank's chunks of every entry; the global metadata lists them all.

    ``planner_data`` maps every key to its path in a nested dict (``("model", name)``, ...), so
    DCP's own loaders unflatten a consolidated checkpoint into ``{"model": {...}, ...}``.
    """

    def __init__(self, entries: Sequence[Entry]) -> None:
        self.entries = {e.fqn: e for e in entries}
        self._data: dict[MetadataIndex, torch.Tensor] = {}

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.storage_meta = storage_meta
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for entry in self.entries.values():
            for (offsets, sizes), view in entry.chunks():
                index = MetadataIndex(entry.fqn, torch.Size(offsets))
                self._data[index] = view
                items.append(WriteItem(
                    index=index, type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                                TensorProperties(dtype=entry.dtype), torch.Size(entry.shape)),
                ))
        return SavePlan(items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        md: dict[str, TensorStorageMetadata] = {}
        for plan in all_plans:
            for item in plan.items:
                data = item.tensor_data
                assert data is not None
                entry = md.setdefault(item.index.fqn, TensorStorageMetadata(data.properties, data.size, []))
                entry.chunks.append(data.chunk)
        mapping = {fqn: _nested_path(fqn) for fqn in md}
        return all_plans, Metadata(md, planner_data=mapping, storage_meta=self.storage_meta)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self._data[write_item.index]


def _nested_path(fqn: str) -> tuple[str, ...]:
    """Where a key lives in the nested (Lightning / DCP) view of the checkpoint."""
    if fqn.startswith(MODEL_PREFIX):
        return ("model", fqn[len(MODEL_PREFIX):])
    head, _, rest = fqn.partition(".")  # optimizer_<i>.state.<name>.<key>
    name, _, key = rest[len("state."):].rpartition(".")
    return (head, "state", name, key)


@dataclass
class Request:
    """Where one logical tensor's stored chunks are read into: this rank's piece (or a whole tensor)."""

    fqn: str
    shape: tuple[int, ...]
    flat: torch.Tensor
    start: int
    filled: int = 0

    def chunks(self) -> list[tuple[Box, torch.Tensor]]:
        return list(Entry(self.fqn, self.shape, self.flat.dtype, self.flat, self.start).chunks())


class ShardLoadPlanner(LoadPlanner):
    """Reads, for every request, the overlap of each stored chunk with each local chunk."""

    def __init__(self, requests: Sequence[Request]) -> None:
        self.requests = {r.fqn: r for r in requests}
        self._targets: dict[MetadataIndex, torch.Tensor] = {}

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        assert metadata is not None
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        stored_md = self.metadata.state_dict_metadata
        for request in self.requests.values():
            stored = stored_md.get(request.fqn)
            if not isinstance(stored, TensorStorageMetadata):
                raise CheckpointError(f"the checkpoint has no tensor {request.fqn!r}")
            if tuple(stored.size) != request.shape:
                raise CheckpointError(
                    f"{request.fqn!r} is stored with shape {tuple(stored.size)} but the model has {request.shape}: "
                    "the checkpoint is from another model (or another format version)"
                )
            for box, view in request.chunks():
                index = MetadataIndex(request.fqn, torch.Size(box[0]))
                self._targets[index] = view
                for chunk in stored.chunks:
                    hit = _overlap(box, (tuple(chunk.offsets), tuple(chunk.sizes)))
                    if hit is None:
                        continue
                    request.filled += math.prod(hit[1])
                    items.append(ReadItem(
                        type=LoadItemType.TENSOR, dest_index=index,
                        dest_offsets=torch.Size(l - b for l, b in zip(hit[0], box[0])),
                        storage_index=MetadataIndex(request.fqn, chunk.offsets),
                        storage_offsets=torch.Size(l - c for l, c in zip(hit[0], chunk.offsets)),
                        lengths=torch.Size(hit[1]),
                    ))
            if request.filled != request.flat.numel():
                raise CheckpointError(
                    f"{request.fqn!r}: the stored chunks cover {request.filled} of the {request.flat.numel()} "
                    "elements this rank needs; the checkpoint is incomplete"
                )
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:  # pragma: no cover - nothing is bytes
        raise CheckpointError(f"unexpected non-tensor item {read_item.dest_index.fqn!r} in a cephalo checkpoint")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self._targets[read_item.dest_index]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, offset, length)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # read in place


def dcp_call(what: str, fn: Callable[[], Any]) -> Any:
    """Run a DCP save/load; its CheckpointException (a BaseException) becomes a CheckpointError."""
    try:
        with warnings.catch_warnings():  # DCP announces single-process use, which is deliberate here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            return fn()
    except dcp.CheckpointException as err:
        failures = getattr(err, "failures", {}) or {}
        detail = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(failures.items())) or str(err)
        raise CheckpointError(f"{what} failed: {detail}") from err
