"""Sharded checkpoints keyed by logical tensor: save at one layout, load at any other.

Each parameter is saved as a 1-D global tensor under its ORIGINAL name; every rank writes only the
piece it owns, described with its explicit offset. Optimizer state is saved the same way
(``optim.<i>.state.<name>.<key>``), with the param groups stored by parameter name. On load,
torch.distributed.checkpoint (DCP) reads whatever overlaps the pieces the *current* layout asks
for, so a checkpoint written at shares [0.6, 0.3, 0.1] on 3 ranks loads at [0.25, 0.75] on 2 ranks,
at even shares on 4, or into a plain model with no process group at all.

A checkpoint is a directory: DCP's files plus ``meta.pt`` (everything that is not a sharded
tensor). It is written to a staging directory and renamed into place only when complete, so a
crash never leaves a checkpoint that looks whole.
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from cephalo_lightning.atomic_io import publish_directory, staging_path, write_bytes_atomic
from cephalo_lightning.runtime.engine import ShardedModel

META_FILE = "meta.pt"
LAYOUT_VERSION = 1


@contextmanager
def _quiet() -> Iterator[None]:
    # ShardedTensor is DCP's supported way to give explicit (uneven) shard offsets, but torch
    # marks it deprecated in favour of DTensor, which cannot express ratio shards.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.checkpoint")
        yield


def _sharded(local: torch.Tensor, start: int, total: int, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """A ShardedTensor for a 1-D tensor of ``total`` elements, this rank holding [start, start+len)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    if not dist.is_initialized():  # one process holds everything: a plain tensor says it all
        return local
    rank = dist.get_rank()
    device = local.device.type
    shards = [Shard(local, ShardMetadata([start], [local.numel()], f"rank:{rank}/{device}"))] if local.numel() else []
    metadata = ShardedTensorMetadata(
        shards_metadata=[
            ShardMetadata([a], [b - a], f"rank:{r}/{device}") for r, (a, b) in enumerate(bounds) if b > a
        ],
        size=torch.Size([total]),
        tensor_properties=TensorProperties(dtype=local.dtype),
    )
    with _quiet():
        # Every rank knows every rank's piece from the layout, so the global metadata is built
        # locally instead of with init_from_local_shards' all-gather per tensor. This private
        # constructor is the only one that takes it; it is used here and nowhere else.
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata)


def _pieces(sharded: ShardedModel) -> Iterator[tuple[str, nn.Parameter, int, int, list[tuple[int, int]]]]:
    """(name, local piece, start within the flattened parameter, numel, every rank's range)."""
    for unit in sharded.units:
        world = unit.layout.world_size
        for span, param in zip(unit.spans, unit.local_params):
            ranges = [unit.layout.param_piece(span, r) for r in range(world)]
            start, _ = ranges[sharded.rank]
            yield span.name, param, start, span.numel, ranges


def _buffers(sharded: ShardedModel) -> dict[str, torch.Tensor]:
    """Persistent buffers (replicated on every rank, saved once)."""
    params = {span.name for unit in sharded.units for span in unit.spans}
    return {k: v for k, v in sharded.module.state_dict().items() if k not in params}


def model_state(sharded: ShardedModel) -> dict[str, torch.Tensor]:
    """Every parameter as a 1-D global tensor of which this rank holds its own piece; buffers whole."""
    state = {name: _sharded(p.detach(), start, total, ranges) for name, p, start, total, ranges in _pieces(sharded)}
    return {**state, **_buffers(sharded)}


def full_model_state(sharded: ShardedModel) -> dict[str, torch.Tensor]:
    """Collective: the ordinary ``state_dict`` of the unsharded model (original shapes, fp32)."""
    return {**sharded.full_state_dict(), **{k: v.detach().clone() for k, v in _buffers(sharded).items()}}


def param_shapes(sharded: ShardedModel) -> dict[str, tuple[int, ...]]:
    return {span.name: span.shape for unit in sharded.units for span in unit.spans}


def optimizer_state(sharded: ShardedModel, optimizer: torch.optim.Optimizer, prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors for DCP, plain metadata) of one optimizer over the sharded model's local pieces."""
    by_param = {id(p): (name, p, start, total, ranges) for name, p, start, total, ranges in _pieces(sharded)}
    tensors: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    groups = []
    for group in optimizer.param_groups:
        names = []
        for p in group["params"]:
            if id(p) not in by_param:
                raise ValueError("the optimizer holds a parameter that is not a local piece of the sharded model")
            name, piece, start, total, ranges = by_param[id(p)]
            names.append(name)
            for key, value in optimizer.state.get(p, {}).items():
                full_key = f"{prefix}.state.{name}.{key}"
                if torch.is_tensor(value) and value.shape == piece.shape and key != "step":
                    tensors[full_key] = _sharded(value.detach(), start, total, ranges)
                elif torch.is_tensor(value):
                    tensors[full_key] = value.detach()  # replicated (e.g. Adam's step): same on every rank
                else:
                    scalars[full_key] = value
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return tensors, {"param_groups": groups, "scalars": scalars}


# -------------------------------------------------------------------------------- save


def _token() -> str:
    token = [uuid.uuid4().hex[:12]]
    if dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    return token[0]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save(path: str | Path, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
    """Collective: write a checkpoint directory atomically (every rank calls it)."""
    path = Path(path)
    staging = staging_path(path, _token())
    if _is_rank_zero():
        for stale in path.parent.glob(f".{path.name}.staging-*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    with _quiet():
        dcp.save(tensors, checkpoint_id=staging, no_dist=not dist.is_initialized())
    _barrier()
    if _is_rank_zero():
        import io

        buffer = io.BytesIO()
        torch.save({**meta, "layout_version": LAYOUT_VERSION}, buffer)
        write_bytes_atomic(staging / META_FILE, buffer.getvalue())
        publish_directory(staging, path)
    _barrier()


def save_sharded(
    path: str | Path,
    sharded: ShardedModel,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    extra: dict[str, Any] | None = None,
) -> None:
    """Model and optimizers of a sharded run, plus ``extra`` (any picklable metadata)."""
    tensors: dict[str, Any] = dict(model_state(sharded))
    optim_meta = []
    for i, opt in enumerate(optimizers):
        opt_tensors, opt_meta = optimizer_state(sharded, opt, f"optim.{i}")
        tensors.update(opt_tensors)
        optim_meta.append(opt_meta)
    save(path, tensors, {"param_shapes": param_shapes(sharded), "optimizers": optim_meta, **(extra or {})})


# -------------------------------------------------------------------------------- load


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def read_meta(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not is_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a cephalo checkpoint directory (no {META_FILE} inside)")
    return torch.load(path / META_FILE, map_location="cpu", weights_only=False)


def _stored_keys(path: Path) -> dict[str, Any]:
    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def load_sharded(
    path: str | Path,
    sharded: ShardedModel,
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> dict[str, Any]:
    """Collective: fill the local pieces (and optimizer state) from a checkpoint of any layout."""
    path = Path(path)
    meta = read_meta(path)
    stored = _stored_keys(path)
    model_tensors = model_state(sharded)
    missing = sorted(set(model_tensors) - set(stored))
    if missing:
        raise KeyError(f"checkpoint {path} lacks parameters {missing[:5]}{'...' if len(missing) > 5 else ''}: was it saved from another model?")
    request: dict[str, Any] = dict(model_tensors)
    pieces = {name: (p, start, total, ranges) for name, p, start, total, ranges in _pieces(sharded)}
    names = {id(p): name for name, (p, *_rest) in pieces.items()}
    saved_optims = meta.get("optimizers", [])
    if len(saved_optims) < len(optimizers):
        raise ValueError(f"checkpoint {path} has {len(saved_optims)} optimizer(s), the run has {len(optimizers)}")
    restores: list[tuple[torch.optim.Optimizer, nn.Parameter, str, torch.Tensor]] = []
    for i, opt in enumerate(optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                name = names[id(p)]
                piece, start, total, ranges = pieces[name]
                prefix = f"optim.{i}.state.{name}."
                for key in (k for k in stored if k.startswith(prefix)):
                    state_key, md = key[len(prefix):], stored[key]
                    if list(md.size) == [total] and state_key != "step":
                        target = torch.zeros(piece.numel(), dtype=md.properties.dtype, device=piece.device)
                        request[key] = _sharded(target, start, total, ranges)
                    else:  # replicated: every rank reads the whole (small) tensor
                        target = request[key] = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
                    restores.append((opt, p, state_key, target))
    with _quiet():
        dcp.load(request, checkpoint_id=path, no_dist=not dist.is_initialized())
    # DCP loaded in place: the model request holds views of the local pieces themselves
    for opt, p, state_key, target in restores:
        opt.state[p][state_key] = target
    for i, opt in enumerate(optimizers):
        _restore_groups(opt, saved_optims[i], pieces, names)
    return meta


def _restore_groups(opt: torch.optim.Optimizer, saved: dict[str, Any], pieces: dict[str, Any], names: dict[int, str]) -> None:
    """Hyperparameters by parameter name (group indices may differ between runs)."""
    group_of = {name: g for g in saved["param_groups"] for name in g["params"]}
    for group in opt.param_groups:
        for p in group["params"]:
            saved_group = group_of.get(names[id(p)])
            if saved_group is not None:
                group.update({k: v for k, v in saved_group.items() if k != "params"})
                break
    for key, value in saved.get("scalars", {}).items():
        _, _, rest = key.partition(".state.")
        name, _, state_key = rest.rpartition(".")
        if name in pieces:
            opt.state[pieces[name][0]][state_key] = value


def load_full_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's parameters with their original shapes; needs no process group."""
    path = Path(path)
    meta = read_meta(path)
    shapes: dict[str, tuple[int, ...]] = meta["param_shapes"]
    stored = _stored_keys(path)
    request = {
        name: torch.zeros(int(torch.Size(shapes[name]).numel()) if name in shapes else tuple(md.size), dtype=md.properties.dtype)
        for name, md in stored.items()
        if not name.startswith("optim.")
    }
    with _quiet():
        dcp.load(request, checkpoint_id=path, no_dist=True)
    return {name: value.view(shapes[name]) if name in shapes else value for name, value in request.items()}


def remove(path: str | Path) -> None:
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        os.remove(path)
