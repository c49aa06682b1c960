"""Crash-safe writes: a file or directory is either absent or complete, never half written.

Torch-free; used by the planner (plan and cluster files) and the runtime (checkpoints).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def staging_path(final: str | Path, token: str) -> Path:
    """Where the pieces of ``final`` are written before it is published (same filesystem)."""
    final = Path(final)
    return final.with_name(f".{final.name}.staging-{token}")


def publish_directory(staging: str | Path, final: str | Path) -> None:
    """Move a fully written ``staging`` directory to ``final``, replacing an older one.

    The old directory is first renamed aside, so at every instant ``final`` is either the complete
    old checkpoint or the complete new one; a crash between the two renames leaves the old one in
    ``.<name>.old-*`` and the new one complete at ``final`` or still in staging.
    """
    staging, final = Path(staging), Path(final)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    if old is not None:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


@contextmanager
def atomic_directory(final: str | Path, token: str | None = None) -> Iterator[Path]:
    """Single-process helper: yield a staging directory, publish it as ``final`` on success."""
    staging = staging_path(final, token or uuid.uuid4().hex[:8])
    staging.mkdir(parents=True, exist_ok=False)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_directory(staging, final)
