"""Crash-safe writes: a file or directory is either absent or complete, never half written.

Torch-free; used by the planner (plan and cluster files) and the runtime (checkpoints).

[Note: publishing a directory] A new version of ``final`` is written in full beside it
(``.<name>.staging-<token>``) and then swapped in with one ``renameat2(RENAME_EXCHANGE)`` where
the OS and filesystem support it (Linux ext4, xfs, btrfs, tmpfs): at every instant ``final`` is
the complete old or the complete new version. Elsewhere it falls back to two renames (old aside,
new in); a crash between them leaves no ``final`` but both complete versions beside it, and
:func:`recover_directory` (run before every load and save) puts the newest complete one back.
Deleting renames the directory out of the way first (``.<name>.trash-<token>``), so a crash
during the deletion never leaves a partial directory under the real name.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | Path, data: bytes | memoryview) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename it into place.

    A full disk raises ``OSError(ENOSPC)`` naming ``path``, the size needed and what was written
    before it failed; the temporary file is removed (``path`` keeps its old contents)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        written = tmp.stat().st_size if tmp.exists() else 0
        raise OSError(err.errno, f"{os.strerror(err.errno)}: writing {path} needs {len(data)} bytes, {written} "
                                 f"were written, {shutil.disk_usage(path.parent).free} are free", str(path)) from err
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


def _aside(final: Path, kind: str) -> Path:
    return final.with_name(f".{final.name}.{kind}-{uuid.uuid4().hex[:8]}")


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux renameat2); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # pragma: no cover - not glibc / not Linux
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):  # pragma: no cover - filesystem-dependent
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")  # pragma: no cover


def remove_tree(path: str | Path) -> None:
    """Delete a file or directory; a directory is renamed out of the way first."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
        return
    if not path.exists():
        return
    trash = _aside(path, "trash")
    os.replace(path, trash)
    _fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def publish_directory(staging: str | Path, final: str | Path) -> None:
    """Make the fully written ``staging`` directory ``final``, replacing an older one (see the note)."""
    staging, final = Path(staging), Path(final)
    if final.exists() and _exchange(staging, final):
        _fsync_dir(final.parent)
        remove_tree(staging)  # now the old version
        return
    old = None
    if final.exists():
        old = _aside(final, "old")
        os.replace(final, old)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    if old is not None:
        remove_tree(old)


def siblings(final: str | Path, kind: str) -> list[Path]:
    """The ``.<name>.<kind>-*`` leftovers beside ``final`` (staging, old or trash), newest first."""
    final = Path(final)
    if not final.parent.is_dir():
        return []
    found = [p for p in final.parent.glob(f".{final.name}.{kind}-*") if p.is_dir() or p.is_file()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def recover_directory(final: str | Path, is_complete: Callable[[Path], bool]) -> Path | None:
    """Before using ``final``: if a crash during a publish left it missing, restore the newest
    complete version (a staging directory written in full, else the old one set aside); then
    delete leftovers that can never be published. Returns what was restored, if anything."""
    final = Path(final)
    restored = None
    if not final.exists():
        for candidate in siblings(final, "staging") + siblings(final, "old"):
            if is_complete(candidate):
                os.replace(candidate, final)
                _fsync_dir(final.parent)
                restored = candidate
                break
    for kind in ("staging", "old", "trash"):
        for leftover in siblings(final, kind):
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)
    return restored

