"""The names of a checkpoint's files and keys, its format version, and the errors every refusal raises."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from cephalo_lightning._common.errors import CephaloError

FORMAT = 3  # 3: the save's token and the DCP files' checksums in cephalo.json, the token in meta.pt
META_FILE = "meta.pt"
INFO_FILE = "cephalo.json"
MANIFEST_FILE = "manifest.json"
DCP_METADATA_FILE = ".metadata"
MODEL_PREFIX = "model."
NF4_KEY = "nf4_base"  # in cephalo.json: the frozen matrices stored as 4-bit NF4 blocks, saved dequantised
TOKEN_KEY = "cephalo_save_token"  # in meta.pt: which save wrote it (cephalo.json and the manifest say too)


class CheckpointError(CephaloError, RuntimeError):
    """A checkpoint cannot be written or read: what is wrong, which file, what to do."""


class NoSpaceError(CheckpointError, OSError):
    """A save ran out of disk space (``errno`` is ``ENOSPC``); what it wrote was removed again."""

    def __init__(self, message: str, path: str | Path) -> None:
        super().__init__(message)
        self.errno = errno.ENOSPC
        self.strerror = os.strerror(errno.ENOSPC)
        self.filename = str(path)

    def __str__(self) -> str:
        return str(self.args[0])


def disk_full_cause(err: BaseException) -> OSError | None:
    """The ``ENOSPC``/``EDQUOT`` error behind ``err``, wherever it hides: torch's zip writer reports
    a failed write as ``enforce fail at inline_container.cc`` with the OSError as its context, DCP
    as a per-rank failure of its CheckpointException."""
    stack: list[object] = [err]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, tuple):
            stack.extend(item)
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, OSError) and item.errno in (errno.ENOSPC, errno.EDQUOT):
            return item
        failures = getattr(item, "failures", None)
        stack.extend([item.__cause__, item.__context__, *(failures.values() if isinstance(failures, dict) else ())])
    return None


def human_bytes(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count} bytes"
