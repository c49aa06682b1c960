"""A sharded checkpoint as whole tensors and as one ordinary Lightning file; no process group.

What a tool, a plain ``nn.Module`` or another strategy reads: every stored tensor whole, in its
original shape (:func:`full_tensors`), the model's ``state_dict`` with every alias key
(:func:`load_full_state_dict`), and a single-file checkpoint with the optimizer state as
``torch.optim`` saves it (:func:`consolidate`).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from cephalo_lightning.runtime.checkpoint.dcp_planners import Request, ShardLoadPlanner, dcp_call
from cephalo_lightning.runtime.checkpoint.format import MODEL_PREFIX
from cephalo_lightning.runtime.checkpoint.frozen_base import refuse_without_base
from cephalo_lightning.runtime.checkpoint.manifest import verify
from cephalo_lightning.runtime.checkpoint.portable import set_aside_sampler_states
from cephalo_lightning.runtime.checkpoint.safe_load import SafeFileSystemReader, read_dcp_metadata
from cephalo_lightning.runtime.checkpoint.save_load import read_info, read_meta
from cephalo_lightning.runtime.checkpoint.single_file import write_file

OPTIMIZER_PREFIX = "optimizer_"


def _whole(path: Path, stored: Mapping[str, Any], prefixes: Sequence[str]) -> dict[str, dict[str, torch.Tensor]]:
    """For each prefix, every stored tensor under it, whole (keyed without the prefix): one DCP read."""
    out: dict[str, dict[str, torch.Tensor]] = {prefix: {} for prefix in prefixes}
    requests = []
    for fqn, md in stored.items():
        prefix = next((p for p in prefixes if fqn.startswith(p)), None)
        if prefix is not None and isinstance(md, TensorStorageMetadata):
            out[prefix][fqn[len(prefix):]] = tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            requests.append(Request(fqn, tuple(md.size), tensor.view(-1), 0))
    dcp_call(f"loading {path}", lambda: dcp.load({}, storage_reader=SafeFileSystemReader(path),
                                                 planner=ShardLoadPlanner(requests), no_dist=True))
    return out


def full_tensors(path: str | Path, prefix: str = MODEL_PREFIX) -> dict[str, torch.Tensor]:
    """Every stored tensor under ``prefix``, whole and in its original shape; needs no process group."""
    path = Path(path)
    return _whole(path, read_dcp_metadata(path).state_dict_metadata, [prefix])[prefix]


def _with_aliases(state: dict[str, torch.Tensor], info: dict[str, Any]) -> dict[str, torch.Tensor]:
    for alias, saved in info.get("aliases", {}).items():
        state[alias] = state[saved]
    return state


def load_full_state_dict(path: str | Path, verify_checksums: bool = True) -> dict[str, torch.Tensor]:
    """The whole model's ``state_dict`` (original names and shapes, every alias key); no process group."""
    path = Path(path)
    if verify_checksums:
        verify(path, collective=False)
    state = full_tensors(path)
    return _with_aliases(state, read_info(path))


def consolidate(path: str | Path, output: str | Path | io.BytesIO, safe_globals: Iterable[Any] = (),
                verify_checksums: bool = True) -> str | None:
    """Write an ordinary single-file Lightning checkpoint from a sharded one (no process group).

    The result loads with ``LightningModule.load_from_checkpoint`` / ``torch.load`` and trains on
    with any strategy: ``state_dict`` in original shapes, optimizer state keyed by parameter
    index as ``torch.optim`` saves it, and Lightning's loops and callbacks; it carries its own
    checksum (:mod:`.single_file`). The manifest's sizes are always checked;
    ``verify_checksums=False`` skips hashing, for a checkpoint this process has just written (and hashed).
    The sampler's position is set aside (:mod:`.portable`) so that any strategy resumes from the
    file; returns the line that says what that keeps, or None when the checkpoint had no position.
    """
    checkpoint = consolidated_dict(path, safe_globals, verify_checksums)
    note = set_aside_sampler_states(checkpoint)
    write_file(checkpoint, output)
    return note


def consolidated_dict(path: str | Path, safe_globals: Iterable[Any] = (), verify_checksums: bool = True) -> dict[str, Any]:
    """The single-file checkpoint of :func:`consolidate`, in memory (verified first)."""
    path = Path(path)
    verify(path, checksums=verify_checksums, collective=False)
    info = read_info(path)
    refuse_without_base(path, info, "write a single-file checkpoint")
    checkpoint = read_meta(path, safe_globals)
    tensors = _whole(path, read_dcp_metadata(path).state_dict_metadata, [MODEL_PREFIX, OPTIMIZER_PREFIX])
    checkpoint["state_dict"] = _with_aliases(tensors[MODEL_PREFIX], info)
    moments = tensors[OPTIMIZER_PREFIX]
    checkpoint["optimizer_states"] = [_torch_optimizer_state(i, saved, moments)
                                      for i, saved in enumerate(info.get("optimizers", []))]
    checkpoint["cephalo"] = {k: v for k, v in info.items() if k not in ("optimizers", "files")}
    return checkpoint


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
