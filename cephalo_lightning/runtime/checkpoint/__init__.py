"""Sharded checkpoints keyed by logical tensor: save at one layout, load at any other.

Every parameter is saved under its ORIGINAL name and shape through torch.distributed.checkpoint
(DCP), with public planners (:class:`ShardSavePlanner`, :class:`ShardLoadPlanner`): each rank
writes only the piece it owns, described as the few rectangular chunks a contiguous range of a
row-major tensor decomposes into (:func:`boxes`). Optimizer moments are saved the same way. On
load, every rank reads the overlap of the stored chunks with the pieces the *current* layout asks
for, so a checkpoint written at shares [0.6, 0.3, 0.1] on 3 ranks loads at [0.25, 0.75] on 2, at
even shares on 4, or without any process group; DCP's own tools (``dcp_to_torch_save``) and
Lightning's ``consolidate_checkpoint`` read it as an ordinary sharded checkpoint.

A checkpoint is a directory::

    .metadata, __<rank>_<i>.distcp   DCP: tensors under "model.<name>", "optimizer_<i>.state.<name>.<key>"
    meta.pt                          Lightning's other state (loops, callbacks, ...): weights-only data
    cephalo.json                     the plan, parameter shapes, optimizer groups by name, format version
    manifest.json                    every file's size and SHA-256, written LAST

[Note: nothing loaded executes code] ``meta.pt`` is read with ``torch.load(weights_only=True)``
and an explicit allow-list (:data:`SAFE_GLOBALS`); DCP's pickled ``.metadata`` is read by
:class:`SafeFileSystemReader`, whose unpickler admits only DCP's metadata classes; tensors are
read by DCP with ``weights_only=True``; everything else is JSON.

[Note: a checkpoint that loads is complete] It is written in a staging directory and published
atomically (:func:`~cephalo_lightning._common.atomic_io.publish_directory`); the manifest is written last
and verified before anything is read (sizes, and checksums shared out between the ranks), so a
truncated, corrupted or half-deleted checkpoint is refused with the name of the file.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import pickle
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import FileSystemReader
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

from cephalo_lightning._common.atomic_io import (
    publish_directory,
    recover_directory,
    remove_tree,
    staging_path,
    write_bytes_atomic,
)
from cephalo_lightning._common.errors import CephaloError
from cephalo_lightning.runtime.distributed import barrier, broadcast_object, gather_objects, is_distributed, rank_and_size
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

FORMAT = 2
META_FILE = "meta.pt"
INFO_FILE = "cephalo.json"
MANIFEST_FILE = "manifest.json"
MODEL_PREFIX = "model."


class CheckpointError(CephaloError, RuntimeError):
    """A checkpoint cannot be written or read: what is wrong, which file, what to do."""


# -------------------------------------------------------------------------------- chunks

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
class _Entry:
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

    def __init__(self, entries: Sequence[_Entry]) -> None:
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
class _Request:
    """Where one logical tensor's stored chunks are read into: this rank's piece (or a whole tensor)."""

    fqn: str
    shape: tuple[int, ...]
    flat: torch.Tensor
    start: int
    filled: int = 0

    def chunks(self) -> list[tuple[Box, torch.Tensor]]:
        return list(_Entry(self.fqn, self.shape, self.flat.dtype, self.flat, self.start).chunks())


class ShardLoadPlanner(LoadPlanner):
    """Reads, for every request, the overlap of each stored chunk with each local chunk."""

    def __init__(self, requests: Sequence[_Request]) -> None:
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


# -------------------------------------------------------------------------------- safe reading

# What DCP pickles into .metadata (torch 2.5 - 2.14): its dataclasses and enums, torch.Size, dtypes,
# layouts (by name, through torch.serialization._get_layout) and the checkpoint id (a path).
_DCP_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch", "Size"), ("torch", "device"), ("torch", "layout"), ("torch", "memory_format"),
    ("torch", "strided"), ("torch", "contiguous_format"), ("torch", "preserve_format"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
    ("torch._utils", "_rebuild_tensor_v2"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        if module == "torch.distributed.checkpoint._extension":  # transform descriptors (names only)
            return super().find_class(module, name)
        raise CheckpointError(
            f"the checkpoint's DCP .metadata refers to {module}.{name}, which is not one of DCP's metadata classes: "
            "it was not written by DCP (or was tampered with) and is not unpickled"
        )


def read_dcp_metadata(path: str | Path) -> Metadata:
    """DCP's ``.metadata`` of a checkpoint, unpickled with only DCP's metadata classes allowed."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except FileNotFoundError as err:
        raise CheckpointError(f"{file} is missing: the checkpoint is incomplete") from err
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"{file} is not a readable DCP metadata file ({type(err).__name__}: {err})") from err
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} does not hold DCP metadata (found {type(metadata).__name__})")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's filesystem reader with the ``.metadata`` unpickled safely (:func:`read_dcp_metadata`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _safe_globals_default() -> list[Any]:
    import argparse
    import collections
    import pathlib

    found: list[Any] = [pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath,
                        argparse.Namespace, collections.defaultdict]
    try:  # Lightning's hyperparameter container, when Lightning is installed
        from lightning.fabric.utilities.data import AttributeDict

        found.append(AttributeDict)
    except ImportError:  # pragma: no cover
        pass
    return found


SAFE_GLOBALS: list[Any] = _safe_globals_default()  # besides tensors, containers and plain scalars


def safe_load(source: str | Path | io.BytesIO, extra_globals: Iterable[Any] = (), what: str = "",
              trusted: bool = False) -> Any:
    """``torch.load(weights_only=True)`` with :data:`SAFE_GLOBALS` (and ``extra_globals``) allowed.

    ``trusted``: the caller explicitly asked for full unpickling (``weights_only=False``)."""
    if trusted:
        return torch.load(source, map_location="cpu", weights_only=False)
    try:
        with torch.serialization.safe_globals([*SAFE_GLOBALS, *extra_globals]):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{what or source} holds objects that can only be loaded by running code from the file "
            f"(weights_only refused them: {str(err).splitlines()[0]}). Cephalo never loads those. If you trust the "
            "file and the classes are yours, pass CephaloStrategy(safe_globals=[TheClass])"
        ) from err


def check_loadable(obj: Any, extra_globals: Iterable[Any] = (), what: str = "the checkpoint's metadata") -> None:
    """Raise now, not at load time, if ``obj`` could not be loaded back without running code."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    safe_load(buffer, extra_globals, what)


# -------------------------------------------------------------------------------- manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST_FILE)


def _write_manifest(path: Path) -> None:
    """Collective: every rank hashes its share of the files, rank 0 writes the manifest last."""
    rank, world = rank_and_size()
    names = broadcast_object(_files(path) if rank == 0 else None)
    mine = {name: {"size": (path / name).stat().st_size, "sha256": _sha256(path / name)}
            for i, name in enumerate(names) if i % world == rank}
    merged: dict[str, Any] = {}
    for part in gather_objects(mine):
        merged.update(part)
    if rank == 0:
        write_bytes_atomic(path / MANIFEST_FILE, json.dumps({"format": FORMAT, "files": merged}, indent=1).encode())


def read_manifest(path: str | Path) -> dict[str, Any]:
    file = Path(path) / MANIFEST_FILE
    if not file.is_file():
        raise CheckpointError(
            f"{path} is not a complete cephalo checkpoint: {MANIFEST_FILE} (written last) is missing. It was "
            "interrupted while being written or deleted, or written by cephalo-lightning < 0.2"
        )
    try:
        manifest = json.loads(file.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{file} is not a valid manifest ({err})") from err
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {manifest.get('format')}, this version reads {FORMAT}")
    return files


def _check_sizes(path: Path, files: dict[str, Any]) -> str | None:
    for name, info in files.items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != info["size"]:
            return f"{file} has {file.stat().st_size} bytes, the manifest says {info['size']} (truncated or replaced)"
    return None


def is_complete(path: str | Path) -> bool:
    """The manifest is there and every file it lists has its size (checksums: :func:`verify`)."""
    path = Path(path)
    try:
        return _check_sizes(path, read_manifest(path)) is None
    except CheckpointError:
        return False


def is_checkpoint(path: str | Path) -> bool:
    """A cephalo checkpoint directory (complete or not)."""
    path = Path(path)
    return path.is_dir() and ((path / INFO_FILE).is_file() or (path / META_FILE).is_file())


def verify(path: str | Path, checksums: bool = True, collective: bool | None = None) -> None:
    """Raise :class:`CheckpointError` unless every file of the manifest is there with its size and
    (``checksums``) its SHA-256. ``collective`` (default: where a process group exists): every rank
    hashes its share of the files and every rank raises alike, naming the first bad file."""
    path = Path(path)
    collective = is_distributed() if collective is None else collective
    problem: str | None = None
    try:
        files = read_manifest(path)
        problem = _check_sizes(path, files)
        if problem is None and checksums:
            rank, world = rank_and_size() if collective else (0, 1)
            for i, (name, info) in enumerate(sorted(files.items())):
                if i % world == rank and _sha256(path / name) != info["sha256"]:
                    problem = f"{path / name} does not match its checksum in the manifest (corrupted or modified)"
                    break
    except CheckpointError as err:
        problem = str(err)
    problems = [p for p in (gather_objects(problem) if collective else [problem]) if p]
    if problems:
        raise CheckpointError(f"refusing to load {path}: {problems[0]}. Resume from an earlier checkpoint")


# -------------------------------------------------------------------------------- save


@dataclass
class SavedOptimizer:
    """How one optimizer's state is stored: tensors go to DCP, the rest to ``cephalo.json``."""

    entries: list[_Entry] = field(default_factory=list)
    replicated: dict[str, torch.Tensor] = field(default_factory=dict)  # fqn -> tensor (rank 0 writes)
    info: dict[str, Any] = field(default_factory=dict)  # param groups by name, scalars


def _pieces(sharded: ShardedModel) -> Iterator[tuple[str, nn.Parameter, tuple[int, ...], int]]:
    """(name, local piece, original shape, start of the piece within the flattened parameter)."""
    for unit in sharded.units:
        for index, (span, param) in enumerate(zip(unit.spans, unit.local_params)):
            yield span.name, param, span.shape, unit.local_range(index)[0]


def buffers(sharded: ShardedModel) -> dict[str, torch.Tensor]:
    """Persistent buffers under their canonical names (replicated on every rank, saved once)."""
    module = sharded.module
    non_persistent = {(id(m), n) for m in module.modules() for n in getattr(m, "_non_persistent_buffers_set", ())}
    out = {}
    for mod_name, mod in module.named_modules():
        for attr, buf in mod._buffers.items():
            if buf is not None and (id(mod), attr) not in non_persistent:
                out[f"{mod_name}.{attr}" if mod_name else attr] = buf
    return out


def state_dict_aliases(sharded: ShardedModel) -> dict[str, str]:
    """Every other key ``module.state_dict()`` has for a tensor saved once, and its saved name.

    Tied parameters (``lm_head.weight`` of a tied embedding) and modules reachable by two paths
    appear in a state dict under several keys; the checkpoint stores each tensor once, and a
    consolidated state dict repeats it under every key, so ``load_state_dict`` (strict) works.
    """
    canonical: dict[int, str] = {}
    for unit in sharded.units:
        for slot in unit.slots:
            for holder, attr in slot.holders:
                canonical[id(holder._parameters[attr])] = slot.name
    names = set(canonical.values())
    tensors = {**{id(t): n for n, t in buffers(sharded).items()}, **canonical}
    aliases = {}
    for key, value in sharded.module.state_dict(keep_vars=True).items():
        saved = tensors.get(id(value))
        if saved is not None and key != saved and key not in names:
            aliases[key] = saved
    return aliases


def model_entries(sharded: ShardedModel) -> list[_Entry]:
    return [_Entry(MODEL_PREFIX + name, shape, piece.dtype, piece.detach().reshape(-1), start)
            for name, piece, shape, start in _pieces(sharded)]


def optimizer_entries(sharded: ShardedModel, optimizer: torch.optim.Optimizer, prefix: str) -> SavedOptimizer:
    """One optimizer over the sharded model's local pieces, as DCP entries and plain info."""
    by_param = {id(p): (name, p, shape, start) for name, p, shape, start in _pieces(sharded)}
    saved = SavedOptimizer()
    groups, scalars = [], {}
    for group in optimizer.param_groups:
        names = []
        for p in group["params"]:
            if id(p) not in by_param:
                raise CheckpointError("the optimizer holds a parameter that is not a local piece of the sharded model")
            name, piece, shape, start = by_param[id(p)]
            names.append(name)
            for key, value in optimizer.state.get(p, {}).items():
                fqn = f"{prefix}.state.{name}.{key}"
                if torch.is_tensor(value) and value.shape == piece.shape and key != "step":
                    saved.entries.append(_Entry(fqn, shape, value.dtype, value.detach().reshape(-1), start))
                elif torch.is_tensor(value):
                    saved.replicated[fqn] = value.detach()  # replicated (Adam's step): same on every rank
                else:
                    scalars[f"{name}.{key}"] = value
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    saved.info = {"param_groups": groups, "scalars": scalars}
    return saved


def _replicated_entries(tensors: dict[str, torch.Tensor]) -> list[_Entry]:
    """Tensors every rank holds whole: rank 0 writes them (one chunk covering everything)."""
    rank, _ = rank_and_size()
    if rank != 0:
        return []
    return [_Entry(fqn, tuple(t.shape), t.dtype, t.detach().reshape(-1).cpu(), 0) for fqn, t in tensors.items()]


def _token() -> str:
    return broadcast_object(uuid.uuid4().hex[:12])


def _dcp_call(what: str, fn: Callable[[], Any]) -> Any:
    """Run a DCP save/load; its CheckpointException (a BaseException) becomes a CheckpointError."""
    try:
        with warnings.catch_warnings():  # DCP announces single-process use, which is deliberate here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            return fn()
    except dcp.CheckpointException as err:
        failures = getattr(err, "failures", {}) or {}
        detail = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(failures.items())) or str(err)
        raise CheckpointError(f"{what} failed: {detail}") from err


def save(path: str | Path, sharded: ShardedModel, optimizers: Sequence[torch.optim.Optimizer],
         meta: dict[str, Any], info: dict[str, Any], safe_globals: Iterable[Any] = ()) -> Path:
    """Collective: write a checkpoint directory atomically (every rank calls it).

    ``meta``: plain data besides the tensors (for Lightning: loops, callbacks, ...), written as
    ``meta.pt`` and checked to be loadable without running code; ``info``: JSON-able extras
    (the plan). Returns the published path.
    """
    path = Path(path)
    rank, _ = rank_and_size()
    check_loadable(meta, safe_globals)  # fail before writing, on every rank alike
    token = _token()
    staging = staging_path(path, token)
    if rank == 0:
        recover_directory(path, is_complete)
        staging.mkdir(parents=True)
    barrier()
    entries = model_entries(sharded) + _replicated_entries({MODEL_PREFIX + k: v for k, v in buffers(sharded).items()})
    optimizer_info = []
    replicated: dict[str, torch.Tensor] = {}
    for i, optimizer in enumerate(optimizers):
        saved = optimizer_entries(sharded, optimizer, f"optimizer_{i}")
        entries += saved.entries
        replicated.update(saved.replicated)
        optimizer_info.append(saved.info)
    entries += _replicated_entries(replicated)
    _dcp_call(f"saving {path}", lambda: dcp.save({}, storage_writer=dcp.FileSystemWriter(staging),
                                                 planner=ShardSavePlanner(entries), no_dist=not is_distributed()))
    if rank == 0:
        buffer = io.BytesIO()
        torch.save(meta, buffer)
        write_bytes_atomic(staging / META_FILE, buffer.getvalue())
        document = {
            "format": FORMAT,
            "param_shapes": {name: list(shape) for name, _, shape, _ in _pieces(sharded)},
            "aliases": state_dict_aliases(sharded),
            "optimizers": optimizer_info,
            **info,
        }
        write_bytes_atomic(staging / INFO_FILE, json.dumps(document, indent=1, default=_json_default).encode())
    barrier()
    _write_manifest(staging)
    barrier()
    if rank == 0:
        publish_directory(staging, path)
    barrier()
    return path


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


# -------------------------------------------------------------------------------- load


def read_info(path: str | Path) -> dict[str, Any]:
    file = Path(path) / INFO_FILE
    try:
        return json.loads(file.read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"{path} is not a cephalo checkpoint directory ({INFO_FILE} is missing)") from err
    except ValueError as err:
        raise CheckpointError(f"{file} is not valid JSON ({err})") from err


def read_meta(path: str | Path, safe_globals: Iterable[Any] = (), trusted: bool = False) -> dict[str, Any]:
    """Lightning's non-tensor state of a checkpoint (``meta.pt``), loaded without running code."""
    file = Path(path) / META_FILE
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: the checkpoint is incomplete")
    return safe_load(file, safe_globals, str(file), trusted)


def _prepare(path: str | Path, verify_checksums: bool) -> Path:
    path = Path(path)
    rank, _ = rank_and_size()
    if rank == 0:
        restored = recover_directory(path, is_complete)
        if restored is not None:
            import warnings

            warnings.warn(f"Cephalo: {path} was missing after an interrupted save; restored it from {restored.name}",
                          stacklevel=3)
    barrier()
    verify(path, checksums=verify_checksums)
    return path


def load(path: str | Path, sharded: ShardedModel, optimizers: Sequence[torch.optim.Optimizer] = (),
         safe_globals: Iterable[Any] = (), verify_checksums: bool = True,
         trusted: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective: fill the local pieces (and optimizer state) from a checkpoint of any layout.

    Returns ``(meta, info)``: Lightning's state and the JSON extras.
    """
    path = _prepare(path, verify_checksums)
    info = read_info(path)
    meta = read_meta(path, safe_globals, trusted)
    stored = read_dcp_metadata(path).state_dict_metadata
    requests: list[_Request] = []
    for name, piece, shape, start in _pieces(sharded):
        requests.append(_Request(MODEL_PREFIX + name, shape, piece.detach().view(-1), start))
    for name, buf in buffers(sharded).items():  # persistent buffers are saved: one missing is an error too
        requests.append(_Request(MODEL_PREFIX + name, tuple(buf.shape), buf.detach().view(-1), 0))
    missing = sorted(r.fqn[len(MODEL_PREFIX):] for r in requests if r.fqn not in stored)
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks parameters or buffers {missing[:5]}{'...' if len(missing) > 5 else ''}: was it "
            "saved from another model?"
        )
    saved_optimizers = info.get("optimizers", [])
    if len(saved_optimizers) < len(optimizers):
        raise CheckpointError(f"checkpoint {path} has {len(saved_optimizers)} optimizer(s), the run has {len(optimizers)}")
    restores: list[tuple[torch.optim.Optimizer, nn.Parameter, str, torch.Tensor]] = []
    pieces = {name: (piece, shape, start) for name, piece, shape, start in _pieces(sharded)}
    names = {id(piece): name for name, (piece, _, _) in pieces.items()}
    for i, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = names[id(p)]
                piece, shape, start = pieces[name]
                prefix = f"optimizer_{i}.state.{name}."
                for key in (k for k in stored if k.startswith(prefix)):
                    state_key, md = key[len(prefix):], stored[key]
                    if tuple(md.size) == shape and state_key != "step":
                        target = torch.zeros(piece.shape, dtype=md.properties.dtype, device=piece.device)
                        requests.append(_Request(key, shape, target.view(-1), start))
                    else:  # replicated: every rank reads the whole (small) tensor
                        target = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
                        requests.append(_Request(key, tuple(md.size), target.view(-1), 0))
                    restores.append((optimizer, p, state_key, target))
    _dcp_call(f"loading {path}", lambda: dcp.load({}, storage_reader=SafeFileSystemReader(path),
                                                  planner=ShardLoadPlanner(requests), no_dist=not is_distributed()))
    for optimizer, p, state_key, target in restores:
        optimizer.state[p][state_key] = target
    for i, optimizer in enumerate(optimizers):
        _restore_groups(optimizer, saved_optimizers[i], pieces, names)
    return meta, info


def _restore_groups(optimizer: torch.optim.Optimizer, saved: dict[str, Any], pieces: dict[str, Any],
                    names: dict[int, str]) -> None:
    """Hyperparameters by parameter name (group indices may differ between runs)."""
    group_of = {name: g for g in saved["param_groups"] for name in g["params"]}
    for group in optimizer.param_groups:
        for p in group["params"]:
            saved_group = group_of.get(names[id(p)])
            if saved_group is not None:
                group.update({k: v for k, v in saved_group.items() if k != "params"})
                break
    for key, value in saved.get("scalars", {}).items():
        name, _, state_key = key.rpartition(".")
        if name in pieces:
            optimizer.state[pieces[name][0]][state_key] = value


# -------------------------------------------------------------------------------- consolidation


def full_tensors(path: str | Path, prefix: str = MODEL_PREFIX) -> dict[str, torch.Tensor]:
    """Every stored tensor under ``prefix``, whole and in its original shape; needs no process group."""
    path = Path(path)
    stored = read_dcp_metadata(path).state_dict_metadata
    requests = []
    out: dict[str, torch.Tensor] = {}
    for fqn, md in stored.items():
        if fqn.startswith(prefix) and isinstance(md, TensorStorageMetadata):
            out[fqn[len(prefix):]] = tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            requests.append(_Request(fqn, tuple(md.size), tensor.view(-1), 0))
    _dcp_call(f"loading {path}", lambda: dcp.load({}, storage_reader=SafeFileSystemReader(path),
                                                  planner=ShardLoadPlanner(requests), no_dist=True))
    return out


def load_full_state_dict(path: str | Path, verify_checksums: bool = True) -> dict[str, torch.Tensor]:
    """The whole model's ``state_dict`` (original names and shapes, every alias key); no process group."""
    path = Path(path)
    if verify_checksums:
        verify(path, collective=False)
    state = full_tensors(path)
    for alias, saved in read_info(path).get("aliases", {}).items():
        state[alias] = state[saved]
    return state


def consolidate(path: str | Path, output: str | Path | io.BytesIO, safe_globals: Iterable[Any] = ()) -> None:
    """Write an ordinary single-file Lightning checkpoint from a sharded one (no process group).

    The result loads with ``LightningModule.load_from_checkpoint`` / ``torch.load`` and trains on
    with any strategy: ``state_dict`` in original shapes, optimizer state keyed by parameter
    index as ``torch.optim`` saves it, and Lightning's loops and callbacks.
    """
    path = Path(path)
    verify(path, collective=False)
    info = read_info(path)
    checkpoint = read_meta(path, safe_globals)
    checkpoint["state_dict"] = load_full_state_dict(path, verify_checksums=False)
    moments = full_tensors(path, prefix="optimizer_")
    checkpoint["optimizer_states"] = [_torch_optimizer_state(i, saved, moments)
                                      for i, saved in enumerate(info.get("optimizers", []))]
    checkpoint["cephalo"] = {k: v for k, v in info.items() if k not in ("optimizers",)}
    if isinstance(output, io.BytesIO):
        torch.save(checkpoint, output)
        output.seek(0)
        return
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    write_bytes_atomic(output, buffer.getvalue())


def _torch_optimizer_state(index: int, saved: dict[str, Any], moments: dict[str, torch.Tensor]) -> dict[str, Any]:
    """An optimizer ``state_dict()`` with parameters numbered in group order, as ``torch.optim`` does."""
    state: dict[int, dict[str, Any]] = {}
    groups = []
    number = 0
    scalars = saved.get("scalars", {})
    for group in saved["param_groups"]:
        numbers = []
        for name in group["params"]:
            entry: dict[str, Any] = {}
            prefix = f"{index}.state.{name}."
            for key, value in moments.items():
                if key.startswith(prefix):
                    entry[key[len(prefix):]] = value
            for key, value in scalars.items():
                if key.rpartition(".")[0] == name:
                    entry[key.rpartition(".")[2]] = value
            if entry:
                state[number] = entry
            numbers.append(number)
            number += 1
        groups.append({**group, "params": numbers})
    return {"state": state, "param_groups": groups}


def consolidated(path: str | Path, safe_globals: Iterable[Any] = ()) -> io.BytesIO:
    """The consolidated checkpoint in memory, for ``YourModule.load_from_checkpoint(consolidated(dir))``."""
    buffer = io.BytesIO()
    consolidate(path, buffer, safe_globals)
    return buffer


def remove(path: str | Path) -> None:
    """Delete a checkpoint; it stops looking like one at once (renamed away, then deleted)."""
    remove_tree(path)


def clean_stale(directory: str | Path) -> None:
    """Rank 0 at start: restore checkpoints an interrupted save left missing; drop leftovers."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    names = set()
    for leftover in directory.glob(".*"):
        stem, dot, rest = leftover.name[1:].rpartition(".")
        if dot and rest.split("-", 1)[0] in ("staging", "old", "trash"):
            names.add(stem)
    for name in sorted(names):
        recover_directory(directory / name, is_complete)


__all__ = [
    "CheckpointError", "SAFE_GLOBALS", "SafeFileSystemReader", "ShardLoadPlanner", "ShardSavePlanner", "boxes",
    "check_loadable", "clean_stale", "consolidate", "consolidated", "full_tensors", "is_checkpoint", "is_complete",
    "load", "load_full_state_dict", "read_dcp_metadata", "read_info", "read_manifest", "read_meta", "remove",
    "safe_load", "save", "verify",
]
