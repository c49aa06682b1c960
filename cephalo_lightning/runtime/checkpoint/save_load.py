"""Collective save and load of a sharded model's checkpoint, at any layout on either side.

Every collective step (the staging token, the barriers, DCP's planning, the manifest's hashing)
runs over the process group the model is sharded over (``sharded.world_group``, every replica's
ranks), and "rank 0" means the first rank of that group: a model on a subgroup checkpoints without
the other ranks. With several shard groups one replica writes (group 0's ranks: the replicas are
bitwise identical); every rank loads its own pieces, whatever the grouping that wrote them.
"""

from __future__ import annotations

import copy as copy_module
import io
import json
import os
import uuid
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from typing_extensions import override

from cephalo_lightning._common.atomic_io import (
    publish_directory,
    recover_directory,
    remove_tree,
    staging_path,
    write_bytes_atomic,
)
from cephalo_lightning.runtime.checkpoint.dcp_planners import Entry, Request, ShardLoadPlanner, ShardSavePlanner, dcp_call
from cephalo_lightning.runtime.checkpoint.entries import (
    buffers,
    local_pieces,
    model_entries,
    optimizer_entries,
    replicated_entries,
    state_dict_aliases,
)
from cephalo_lightning.runtime.checkpoint.format import (
    FORMAT,
    INFO_FILE,
    META_FILE,
    MODEL_PREFIX,
    NF4_KEY,
    TOKEN_KEY,
    CheckpointError,
    NoSpaceError,
    disk_full_cause,
    human_bytes,
)
from cephalo_lightning.runtime.checkpoint.frozen_base import INFO_KEY as FROZEN_BASE_KEY
from cephalo_lightning.runtime.checkpoint.frozen_base import FrozenBase, check_same_base
from cephalo_lightning.runtime.checkpoint.manifest import hash_files, is_complete, read_info, verify, write_manifest
from cephalo_lightning.runtime.checkpoint.safe_load import (
    SafeFileSystemReader,
    check_loadable,
    read_dcp_metadata,
    safe_load,
)
from cephalo_lightning.runtime.distributed import (
    Group,
    barrier,
    broadcast_object,
    gather_objects,
    is_distributed,
    rank_and_size,
)
from cephalo_lightning.runtime.quantized.nf4_storage import Nf4Storage
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

SINGLE_FILE_STAGING = "sharded"


def _token(group: Group) -> str:
    return broadcast_object(uuid.uuid4().hex[:12], group)


def save(path: str | Path, sharded: ShardedModel, optimizers: Sequence[torch.optim.Optimizer],
         meta: dict[str, Any], info: dict[str, Any], safe_globals: Iterable[Any] = (),
         trainable_only: bool = False) -> Path:
    """Collective: write a checkpoint directory atomically (every rank calls it).

    ``meta``: plain data besides the tensors (for Lightning: loops, callbacks, ...), written as
    ``meta.pt`` and checked to be loadable without running code; ``info``: JSON-able extras
    (the plan). ``trainable_only``: no frozen parameter is written (``info`` then records the frozen
    base, :mod:`.frozen_base`). Returns the published path. A save that fails (a full disk:
    :class:`NoSpaceError`) removes what it wrote on every rank alike; the checkpoint already at
    ``path`` stays as it was.
    """
    group = sharded.world_group
    return write_prepared(path, prepare(sharded, optimizers, meta, safe_globals, trainable_only=trainable_only),
                          info, group)


@dataclass(frozen=True)
class PreparedSave:
    """Everything a save writes, taken from the model at one instant (:func:`prepare`)."""

    token: str
    entries: list[Entry]  # this rank's DCP entries
    meta: bytes  # meta.pt's content (with the token)
    document: dict[str, Any]  # cephalo.json's model-side part (shapes, aliases, optimizer groups)
    on_first_rank: bool  # this rank writes meta.pt, cephalo.json, the manifest and publishes


def prepare(sharded: ShardedModel, optimizers: Sequence[torch.optim.Optimizer], meta: dict[str, Any],
            safe_globals: Iterable[Any] = (), copy: bool = False, trainable_only: bool = False) -> PreparedSave:
    """Collective (the token): what a save of the model as it is now writes. ``copy``: the tensors
    are copied to host memory (a snapshot that later optimizer steps do not change); otherwise
    they are views of the live pieces and must be written before the model changes."""
    group = sharded.world_group
    rank, _ = rank_and_size(group)
    check_loadable(meta, safe_globals)  # fail before writing, on every rank alike
    token = _token(group)
    buffer_entries = replicated_entries({MODEL_PREFIX + k: v for k, v in buffers(sharded).items()}, rank)
    writes = sharded.group_index == 0  # one replica writes the pieces
    entries = (model_entries(sharded, trainable_only) if writes else []) + buffer_entries
    optimizer_info = []
    replicated: dict[str, torch.Tensor] = {}
    for i, optimizer in enumerate(optimizers):
        saved = optimizer_entries(sharded, optimizer, f"optimizer_{i}")
        entries += saved.entries if writes else []
        replicated.update(saved.replicated)
        optimizer_info.append(saved.info)
    entries += replicated_entries(replicated, rank)
    if copy:
        entries = [Entry(e.fqn, e.shape, e.dtype, e.flat.detach().to("cpu", copy=True), e.start) for e in entries]
        optimizer_info = copy_module.deepcopy(optimizer_info)
    buffer = io.BytesIO()
    if rank == 0:
        torch.save({**meta, TOKEN_KEY: token}, buffer)
    document = {
        "param_shapes": {name: list(shape) for name, _, shape, _ in local_pieces(sharded, trainable_only)},
        "units": [[span.name for span in unit.spans] for unit in sharded.units],  # an export reads unit by unit
        "aliases": state_dict_aliases(sharded),
        "optimizers": optimizer_info,
    }
    quantised = [name for unit in sharded.units if isinstance(unit.frozen, Nf4Storage)
                 for name in unit.frozen.quantised_names()]
    if quantised:  # saved as their dequantised values; an export says so (see export.NF4_KEY)
        document[NF4_KEY] = quantised
    return PreparedSave(token, entries, buffer.getvalue(), document, rank == 0)


def write_prepared(path: str | Path, prepared: PreparedSave, info: dict[str, Any], group: Group) -> Path:
    """Collective over ``group``: write ``prepared`` in a staging directory, hash it, write the
    manifest and publish it atomically (see :func:`save`). ``group`` may be another process group
    over the same ranks than the model's (a background writer's own)."""
    path = Path(path)
    rank, _ = rank_and_size(group)
    token, entries = prepared.token, prepared.entries
    staging = staging_path(path, token)
    needed = sum(gather_objects(sum(e.flat.numel() * e.flat.element_size() for e in entries), group))
    try:
        on_first_rank(group, lambda: (recover_directory(path, is_complete), staging.mkdir(parents=True)))
        dcp_call(f"saving {path}", lambda: dcp.save({}, storage_writer=_Writer(staging),
                                                    planner=ShardSavePlanner(entries), process_group=group,
                                                    no_dist=not is_distributed(group)))
        on_first_rank(group, lambda: write_bytes_atomic(staging / META_FILE, prepared.meta))
        dcp_files = hash_files(staging, group)  # .metadata and the shards (and meta.pt, for the manifest)
        document = {
            "format": FORMAT,
            "token": token,
            "files": {name: entry for name, entry in dcp_files.items() if name != META_FILE},
            **prepared.document,
            **info,
        }
        on_first_rank(group, lambda: (
            write_bytes_atomic(staging / INFO_FILE, json.dumps(document, indent=1, default=_json_default).encode()),
            write_manifest(staging, token, dcp_files),
            publish_directory(staging, path),
        ))
    except Exception as err:
        written = _remove_failed(staging) if rank == 0 else 0
        cause = disk_full_cause(err)
        if cause is None:
            raise
        raise NoSpaceError(
            f"no space left on device (errno ENOSPC) saving checkpoint {path}: it needs about {human_bytes(needed)} "
            f"of tensors, {human_bytes(written)} had been written when the disk filled up ({cause}). What the save "
            "wrote was removed and the previous checkpoint at that path, if any, is untouched. Free space on that "
            "disk, keep fewer checkpoints (ModelCheckpoint(save_top_k=...)) or save to another directory", path,
        ) from err
    return path


class _Writer(dcp.FileSystemWriter):
    """DCP's writer, with a full disk reported as the OSError it is: torch's zip writer hides it as
    ``enforce fail at inline_container.cc`` (the OSError only as its context, which is lost when
    DCP hands the failure to the other ranks). A rank with nothing to write (a replica that does
    not write, a rank with an empty share) writes no file: DCP would leave an empty one that its
    ``.metadata`` does not name."""

    @override
    def write_data(self, plan: Any, planner: Any) -> Any:
        if not plan.items:
            done: torch.futures.Future = torch.futures.Future()
            done.set_result([])
            return done
        try:
            return super().write_data(plan, planner)
        except Exception as err:
            cause = disk_full_cause(err)
            if cause is None:
                raise
            raise OSError(cause.errno, f"{os.strerror(cause.errno)}: writing {self.path} failed ({err})") from err


def on_first_rank(group: Group, step: Callable[[], Any]) -> None:
    """Run ``step`` on the group's first rank; every rank raises if it failed (none waits forever)."""
    rank, _ = rank_and_size(group)
    error: Exception | None = None
    if rank == 0:
        try:
            step()
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            error = err
    cause = disk_full_cause(error) if error is not None else None
    failed = broadcast_object(None if error is None else (f"{type(error).__name__}: {error}", cause and cause.errno),
                              group)
    if error is not None:
        raise error
    if failed is not None:
        message, code = failed
        raise CheckpointError(f"the save failed on the group's first rank: {message}") from (
            OSError(code, message) if code else None)


def _remove_failed(staging: Path) -> int:
    """Delete a failed save's staging directory; returns how many bytes it held."""
    if not staging.exists():
        return 0
    written = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
    remove_tree(staging)
    return written


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


# -------------------------------------------------------------------------------- load


def read_meta(path: str | Path, safe_globals: Iterable[Any] = (), trusted: bool = False) -> dict[str, Any]:
    """Lightning's non-tensor state of a checkpoint (``meta.pt``), loaded without running code."""
    file = Path(path) / META_FILE
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: the checkpoint is incomplete")
    meta = safe_load(file, safe_globals, str(file), trusted)
    token = read_info(path).get("token")
    if not isinstance(meta, dict) or meta.get(TOKEN_KEY) != token:
        found = meta.get(TOKEN_KEY) if isinstance(meta, dict) else None
        raise CheckpointError(
            f"refusing to load {path}: {file} belongs to save {found}, {INFO_FILE} to save {token}: the directory "
            "mixes files of two checkpoints. Resume from an earlier checkpoint"
        )
    return {k: v for k, v in meta.items() if k != TOKEN_KEY}


def _prepare(path: str | Path, verify_checksums: bool, group: Group) -> Path:
    path = Path(path)
    rank, _ = rank_and_size(group)
    if rank == 0:
        restored = recover_directory(path, is_complete)
        if restored is not None:
            warnings.warn(f"Cephalo: {path} was missing after an interrupted save; restored it from {restored.name}",
                          stacklevel=3)
    barrier(group)
    verify(path, checksums=verify_checksums, group=group)
    return path


def load(path: str | Path, sharded: ShardedModel, optimizers: Sequence[torch.optim.Optimizer] = (),
         safe_globals: Iterable[Any] = (), verify_checksums: bool = True,
         trusted: bool = False, frozen: Callable[[], FrozenBase | None] = lambda: None,
         rename: dict[str, str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective: fill the local pieces (and optimizer state) from a checkpoint of any layout.

    A checkpoint of the trainable parameters alone fills those and leaves the frozen ones as they
    are, once ``frozen()`` (collective: this run's frozen base) is the base it was trained over.
    Returns ``(meta, info)``: Lightning's state and the JSON extras. ``rename``: a piece's name in
    ``sharded`` -> its name in the checkpoint (a pipeline stage's pieces, :mod:`~.pipelining.stage_checkpoint`).
    """
    group = sharded.world_group
    renamed = rename or {}

    def named(name: str) -> str:
        return renamed.get(name, name)

    path = _prepare(path, verify_checksums, group)
    info = read_info(path)
    meta = read_meta(path, safe_globals, trusted)
    saved_base = info.get(FROZEN_BASE_KEY)
    if saved_base is not None:
        check_same_base(path, saved_base, frozen)
    stored = read_dcp_metadata(path).state_dict_metadata
    requests: list[Request] = []
    # a quantised frozen piece loads into its values, stored again below (restore_frozen)
    values = {id(unit): unit.local_values() for unit in sharded.units}
    for unit in sharded.units:
        for index, (span, piece, trainable) in enumerate(zip(unit.spans, values[id(unit)], unit.requires_grad)):
            if trainable or saved_base is None:
                requests.append(Request(MODEL_PREFIX + named(span.name), span.shape, piece.detach().view(-1),
                                        unit.local_range(index)[0]))
    for name, buf in buffers(sharded).items():  # persistent buffers are saved: one missing is an error too
        requests.append(Request(MODEL_PREFIX + name, tuple(buf.shape), buf.detach().view(-1), 0))
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
    pieces = {named(name): (piece, shape, start) for name, piece, shape, start in local_pieces(sharded)}
    names = {id(piece): name for name, (piece, _, _) in pieces.items()}
    for i, optimizer in enumerate(optimizers):
        for param_group in optimizer.param_groups:
            for p in param_group["params"]:
                name = names[id(p)]
                piece, shape, start = pieces[name]
                prefix = f"optimizer_{i}.state.{name}."
                for key in (k for k in stored if k.startswith(prefix)):
                    state_key, md = key[len(prefix):], stored[key]
                    if tuple(md.size) == shape and state_key != "step":
                        target = torch.zeros(piece.shape, dtype=md.properties.dtype, device=piece.device)
                        requests.append(Request(key, shape, target.view(-1), start))
                    else:  # replicated: every rank reads the whole (small) tensor
                        target = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
                        requests.append(Request(key, tuple(md.size), target.view(-1), 0))
                    restores.append((optimizer, p, state_key, target))
    dcp_call(f"loading {path}", lambda: dcp.load({}, storage_reader=SafeFileSystemReader(path),
                                                 planner=ShardLoadPlanner(requests), process_group=group,
                                                 no_dist=not is_distributed(group)))
    for optimizer, p, state_key, target in restores:
        optimizer.state[p][state_key] = target
    if saved_base is None:
        for unit in sharded.units:
            if any(p.is_meta for p in unit.local_params):
                unit.restore_frozen([v for v, rg in zip(values[id(unit)], unit.requires_grad) if not rg])
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


def remove(path: str | Path) -> None:
    """Delete a checkpoint; it stops looking like one at once (renamed away, then deleted)."""
    remove_tree(path)


def clean_stale(directory: str | Path) -> None:
    """Rank 0 at start: restore checkpoints an interrupted save left missing; drop leftovers
    (staging, set-aside and trash directories, a single-file save's temporary file and the hidden
    ``.NAME.sharded`` directory it consolidates from)."""
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
    for leftover in directory.glob(".*"):
        stem, dot, rest = leftover.name[1:].rpartition(".")
        if dot and stem and ((rest == SINGLE_FILE_STAGING and leftover.is_dir())
                             or (rest.startswith("tmp-") and leftover.is_file())):
            remove_tree(leftover)


def single_file_staging(path: str | Path) -> Path:
    """Where a single-file save writes the sharded checkpoint it consolidates (removed after)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{SINGLE_FILE_STAGING}")
