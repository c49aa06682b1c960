"""The manifest: every file's size and SHA-256, written last, checked before anything is read.

[Note: a checkpoint that loads is complete] The manifest is written after every other file, so
a directory without one was interrupted; :func:`verify` refuses a truncated, corrupted or
half-deleted checkpoint with the name of the file. Hashing is shared out between the ranks of
the process group that wrote (or reads) the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from cephalo_lightning._common.atomic_io import write_bytes_atomic
from cephalo_lightning.runtime.checkpoint.format import FORMAT, INFO_FILE, MANIFEST_FILE, META_FILE, CheckpointError
from cephalo_lightning.runtime.distributed import Group, broadcast_object, gather_objects, is_distributed, rank_and_size


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST_FILE)


def write_manifest(path: Path, group: Group = None) -> None:
    """Collective over ``group``: every rank hashes its share of the files, the group's first rank
    writes the manifest last."""
    rank, world = rank_and_size(group)
    names = broadcast_object(_files(path) if rank == 0 else None, group)
    mine = {name: {"size": (path / name).stat().st_size, "sha256": _sha256(path / name)}
            for i, name in enumerate(names) if i % world == rank}
    merged: dict[str, Any] = {}
    for part in gather_objects(mine, group):
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


def verify(path: str | Path, checksums: bool = True, collective: bool | None = None, group: Group = None) -> None:
    """Raise :class:`CheckpointError` unless every file of the manifest is there with its size and
    (``checksums``) its SHA-256. ``collective`` (default: where ``group`` has several ranks): every
    rank of ``group`` hashes its share of the files and every rank raises alike, naming the first
    bad file."""
    path = Path(path)
    collective = is_distributed(group) if collective is None else collective
    problem: str | None = None
    try:
        files = read_manifest(path)
        problem = _check_sizes(path, files)
        if problem is None and checksums:
            rank, world = rank_and_size(group) if collective else (0, 1)
            for i, (name, info) in enumerate(sorted(files.items())):
                if i % world == rank and _sha256(path / name) != info["sha256"]:
                    problem = f"{path / name} does not match its checksum in the manifest (corrupted or modified)"
                    break
    except CheckpointError as err:
        problem = str(err)
    problems = [p for p in (gather_objects(problem, group) if collective else [problem]) if p]
    if problems:
        raise CheckpointError(f"refusing to load {path}: {problems[0]}. Resume from an earlier checkpoint")

