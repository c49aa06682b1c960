"""A single-file checkpoint that carries its own checksum and stays an ordinary Lightning file.

[Note: a single file vouches for itself] torch's zip reader checks no CRC, so one flipped byte in
a tensor loads silently. A single file cephalo writes holds, under :data:`INTEGRITY_KEY`, the
SHA-256 of its content: every tensor's dtype, shape and bytes and every other value, walked in
the dict's order (:func:`content_sha256`). It is still a plain dict of tensors and plain data, so
``torch.load(weights_only=True)`` and ``LightningModule.load_from_checkpoint`` read it as before
(they ignore the key, and cannot check it); cephalo's own loads (``Trainer.fit(ckpt_path=FILE)``
under the strategy, :func:`load_file`, :func:`verify_file`) recompute it and refuse a mismatch.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from cephalo_lightning._common.atomic_io import write_bytes_atomic
from cephalo_lightning.runtime.checkpoint.format import CheckpointError, NoSpaceError, disk_full_cause, human_bytes
from cephalo_lightning.runtime.checkpoint.safe_load import safe_load

INTEGRITY_KEY = "cephalo_integrity"
_SCHEME = "sha256-content-1"


def _feed(digest: Any, value: Any) -> None:
    kind = type(value)
    digest.update(f"<{kind.__module__}.{kind.__qualname__}".encode())
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        if tensor.numel():
            digest.update(ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size()))
    elif isinstance(value, Mapping):
        digest.update(str(len(value)).encode())
        for key, item in value.items():
            _feed(digest, key)
            _feed(digest, item)
    elif isinstance(value, (list, tuple)):
        digest.update(str(len(value)).encode())
        for item in value:
            _feed(digest, item)
    elif isinstance(value, (set, frozenset)):  # iteration order differs between processes
        for part in sorted(content_sha256(item) for item in value):
            digest.update(part.encode())
    elif isinstance(value, (str, bytes, int, float, complex, bool, type(None))):
        digest.update(repr(value).encode())
    elif hasattr(value, "__dict__"):
        _feed(digest, vars(value))
    else:
        digest.update(repr(value).encode())
    digest.update(b">")


def content_sha256(value: Any) -> str:
    """The SHA-256 of a checkpoint's content, the same before ``torch.save`` and after ``torch.load``."""
    digest = hashlib.sha256()
    _feed(digest, value)
    return digest.hexdigest()


def seal(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with its integrity record (the note above), the record last."""
    content = {k: v for k, v in checkpoint.items() if k != INTEGRITY_KEY}
    return {**content, INTEGRITY_KEY: {"scheme": _SCHEME, "sha256": content_sha256(content)}}


def write_file(checkpoint: dict[str, Any], output: str | Path | io.BytesIO) -> None:
    """Write a sealed single-file checkpoint; a file is replaced atomically, and a full disk is a
    :class:`NoSpaceError` after which ``output`` keeps its previous contents."""
    buffer = io.BytesIO()
    torch.save(seal(checkpoint), buffer)
    if isinstance(output, io.BytesIO):
        output.write(buffer.getbuffer())
        output.seek(0)
        return
    try:
        write_bytes_atomic(output, buffer.getbuffer())
    except OSError as err:
        if disk_full_cause(err) is None:
            raise
        raise NoSpaceError(
            f"no space left on device (errno ENOSPC) writing checkpoint {output}: it needs "
            f"{human_bytes(buffer.getbuffer().nbytes)} ({err}). The partial file was removed and {output} keeps its "
            "previous contents, if any. Free space on that disk or save to another directory", output,
        ) from err


def load_file(path: str | Path, safe_globals: Iterable[Any] = (), trusted: bool = False) -> tuple[dict[str, Any], bool]:
    """A single-file checkpoint without its integrity record, and whether it carried one (then it
    was checked: a mismatch, a truncated or an unreadable file is a :class:`CheckpointError`).
    Files that Lightning or other tools wrote carry none and load unchecked."""
    loaded = safe_load(path, safe_globals, str(path), trusted)
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path} does not hold a checkpoint dict (found {type(loaded).__name__})")
    record = loaded.pop(INTEGRITY_KEY, None)
    if record is None:
        return loaded, False
    if not isinstance(record, dict) or record.get("scheme") != _SCHEME:
        raise CheckpointError(f"{path} has an integrity record this version cannot check ({record!r:.100})")
    if record.get("sha256") != content_sha256(loaded):
        raise CheckpointError(
            f"refusing to load {path}: its content does not match the checksum it was saved with (the file was "
            "corrupted or modified). Resume from an earlier checkpoint, or consolidate it again from the sharded one"
        )
    return loaded, True


def verify_file(path: str | Path, safe_globals: Iterable[Any] = ()) -> None:
    """Raise :class:`CheckpointError` unless ``path`` is a single-file checkpoint whose content
    matches its integrity record: what to run before a loader cephalo does not control
    (``LightningModule.load_from_checkpoint``, ``torch.load``)."""
    _, checked = load_file(path, safe_globals)
    if not checked:
        raise CheckpointError(
            f"{path} carries no integrity record ({INTEGRITY_KEY}): it was not written by cephalo-lightning, so "
            "nothing can tell whether it is intact"
        )
