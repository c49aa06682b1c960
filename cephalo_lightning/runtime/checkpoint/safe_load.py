"""Reading a checkpoint's pickles without running code from them.

[Note: nothing loaded executes code] ``meta.pt`` is read with ``torch.load(weights_only=True)``
and an explicit allow-list (:data:`SAFE_GLOBALS`); DCP's pickled ``.metadata`` is read by
:class:`SafeFileSystemReader`, whose unpickler admits only DCP's metadata classes; tensors are
read by DCP with ``weights_only=True``; everything else is JSON.
"""

from __future__ import annotations

import argparse
import collections
import io
import pathlib
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from cephalo_lightning.runtime.checkpoint.format import CheckpointError

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


# Besides tensors, containers and plain scalars: what Lightning's checkpoint dict holds from the
# standard library. The Lightning layer adds Lightning's own classes (lightning/checkpoint_io.py).
SAFE_GLOBALS: tuple[Any, ...] = (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath,
                                 argparse.Namespace, collections.defaultdict)


def safe_load(source: str | Path | io.BytesIO, extra_globals: Iterable[Any] = (), what: str = "",
              trusted: bool = False) -> Any:
    """``torch.load(weights_only=True)`` with :data:`SAFE_GLOBALS` (and ``extra_globals``) allowed.

    ``trusted``: the caller explicitly asked for full unpickling (``weights_only=False``). A file
    that is truncated or not a torch file is a :class:`CheckpointError` naming it."""
    try:
        if trusted:
            return torch.load(source, map_location="cpu", weights_only=False)
        with torch.serialization.safe_globals([*SAFE_GLOBALS, *extra_globals]):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{what or source} holds objects that can only be loaded by running code from the file, or is not a "
            f"checkpoint file at all (weights_only refused it: {_reason(err)}). Cephalo never loads those. If you "
            "trust the file and the classes are yours, pass CephaloStrategy(safe_globals=[TheClass])"
        ) from err
    except (RuntimeError, OSError, EOFError, ValueError, KeyError, IndexError) as err:
        if isinstance(err, FileNotFoundError):
            raise CheckpointError(f"{what or source} is missing") from err
        raise CheckpointError(
            f"{what or source} cannot be read as a checkpoint ({type(err).__name__}: {_reason(err)}): it is "
            "truncated, damaged or not a torch checkpoint file. Resume from an earlier checkpoint, or save it again"
        ) from err


_ADVICE = ("Weights only load failed", "Please file an issue", "Check the documentation", "In PyTorch 2.6")


def _reason(err: BaseException) -> str:
    """The line of torch's message that says what is wrong (not its general advice)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(_ADVICE)]
    return (useful or lines or [type(err).__name__])[0][:200]


def check_loadable(obj: Any, extra_globals: Iterable[Any] = (), what: str = "the checkpoint's metadata") -> None:
    """Raise now, not at load time, if ``obj`` could not be loaded back without running code."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    safe_load(buffer, extra_globals, what)
