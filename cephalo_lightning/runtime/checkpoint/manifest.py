"""The manifest: every file's size and SHA-256, written last, checked before anything is read.

[Note: a checkpoint that loads is complete] The manifest is written after every other file, so
a directory without one was interrupted; :func:`verify` refuses a truncated, corrupted,
half-deleted or mixed checkpoint with the name of the file. Hashing is shared out between the ranks of
the process group that wrote (or reads) the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from cephalo_lightning._common.atomic_io import write_bytes_atomic
from cephalo_lightning.runtime.checkpoint.format import (
    DCP_METADATA_FILE,
    FORMAT,
    INFO_FILE,
    MANIFEST_FILE,
    META_FILE,
    CheckpointError,
)
from cephalo_lightning.runtime.checkpoint.safe_load import read_dcp_metadata
from cephalo_lightning.runtime.distributed import Group, broadcast_object, gather_objects, is_distributed, rank_and_size


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST_FILE)


def hash_files(path: Path, group: Group = None) -> dict[str, dict[str, Any]]:
    """Collective over ``group``: every file of ``path`` (but the manifest) with its size and
    SHA-256, each rank hashing its share; the result on every rank."""
    rank, world = rank_and_size(group)
    names = broadcast_object(_files(path) if rank == 0 else None, group)
    mine = {name: {"size": (path / name).stat().st_size, "sha256": _sha256(path / name)}
            for i, name in enumerate(names) if i % world == rank}
    merged: dict[str, Any] = {}
    for part in gather_objects(mine, group):
        merged.update(part)
    return dict(sorted(merged.items()))


def write_manifest(path: Path, token: str, files: dict[str, dict[str, Any]]) -> None:
    """The group's first rank, last: ``files`` (from :func:`hash_files`) and the files written
    since, hashed here, under the save's ``token``."""
    files = dict(files)
    for name in _files(path):
        if name not in files:
            files[name] = {"size": (path / name).stat().st_size, "sha256": _sha256(path / name)}
    document = {"format": FORMAT, "token": token, "files": dict(sorted(files.items()))}
    write_bytes_atomic(path / MANIFEST_FILE, json.dumps(document, indent=1).encode())


def read_manifest(path: str | Path) -> dict[str, Any]:
    return read_manifest_document(path)["files"]


def _nothing_there(path: Path) -> str | None:
    """Why ``path`` holds no checkpoint at all (it does not exist, or is an empty directory), or None."""
    if not path.exists():
        parent = path.parent if str(path.parent) else Path(".")
        near = sorted(p.name for p in parent.iterdir())[:6] if parent.is_dir() else []
        holds = f"; {parent} holds {', '.join(near)}" if near else ""
        return (f"{path}: no such file or directory (a typo in the path, or nothing was saved there){holds}. Check "
                f"the path, e.g. Trainer.fit(ckpt_path='checkpoints/last.ckpt'), or ckpt_path='last' for the last save")
    if path.is_dir() and not any(path.iterdir()):
        return (f"{path} is an empty directory: no checkpoint was ever saved in it (a save writes its files first and "
                f"{MANIFEST_FILE} last). Check the path, e.g. Trainer.fit(ckpt_path='checkpoints/last.ckpt')")
    return None


class NoCheckpointError(CheckpointError):
    """The path holds no checkpoint at all: it does not exist, or is an empty directory."""


def read_manifest_document(path: str | Path) -> dict[str, Any]:
    nothing = _nothing_there(Path(path))
    if nothing is not None:
        raise NoCheckpointError(nothing)
    file = Path(path) / MANIFEST_FILE
    if not file.is_file():
        raise CheckpointError(
            f"{path} is not a complete cephalo checkpoint: {MANIFEST_FILE}, which a save writes after every other "
            "file, is missing. The save was interrupted (its process stopped while writing), files were deleted from "
            "it, or the directory is not a cephalo checkpoint"
        )
    try:
        manifest = json.loads(file.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{file} is not a valid manifest ({err})") from err
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} has checkpoint format {manifest.get('format')}, this version reads {FORMAT}: load it with the "
            "version that wrote it (and consolidate it to one file there), or resume from a newer checkpoint"
        )
    if not isinstance(files, dict):
        raise CheckpointError(f"{file} is not a valid manifest (its 'files' is not a mapping)")
    return manifest


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


def read_info(path: str | Path) -> dict[str, Any]:
    file = Path(path) / INFO_FILE
    try:
        return json.loads(file.read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"{path} is not a cephalo checkpoint directory ({INFO_FILE} is missing)") from err
    except ValueError as err:
        raise CheckpointError(f"{file} is not valid JSON ({err})") from err


def _binding_problem(path: Path, manifest: dict[str, Any]) -> str | None:
    """[Note: one checkpoint, every file vouched for] Every file a load reads must be in the
    manifest, and the DCP files (``.metadata`` and the shards it names) must be the ones
    ``cephalo.json`` recorded at the save (token and checksums): a manifest regenerated over
    files of two checkpoints still disagrees with that record. ``meta.pt`` carries the token
    itself (checked where it is read, after its safe unpickling)."""
    files = manifest["files"]
    storage = read_dcp_metadata(path).storage_data or {}
    dcp_files = {DCP_METADATA_FILE} | {getattr(info, "relative_path", DCP_METADATA_FILE) for info in storage.values()}
    for name in sorted({INFO_FILE, META_FILE} | dcp_files):
        if name not in files:
            return (f"{path / name} is read by a load but is not in the manifest, so nothing vouches for it (the "
                    "manifest was edited or regenerated)")
    info = read_info(path)
    token, recorded = info.get("token"), info.get("files")
    if not token or not isinstance(recorded, dict):
        return f"{path / INFO_FILE} does not record the save's token and files (edited, or not written by a save)"
    if manifest.get("token", token) != token:
        return (f"{path / MANIFEST_FILE} belongs to save {manifest.get('token')}, {INFO_FILE} to save {token}: the "
                "directory mixes files of two checkpoints")
    for name in sorted(dcp_files | set(recorded)):
        if name not in recorded:
            return (f"{path / name} is not one of the files save {token} wrote ({INFO_FILE} does not record it): "
                    "the directory mixes files of two checkpoints")
        if name not in dcp_files:
            return (f"{path / name} was written by save {token} but {path / DCP_METADATA_FILE} does not use it: the "
                    f"{DCP_METADATA_FILE} comes from another checkpoint")
        if recorded[name] != {"size": files[name]["size"], "sha256": files[name]["sha256"]}:
            return (f"{path / name} is not the file save {token} wrote (its checksum differs from the one {INFO_FILE} "
                    "recorded): the directory mixes files of two checkpoints")
    return None


def verify(path: str | Path, checksums: bool = True, collective: bool | None = None, group: Group = None) -> None:
    """Raise :class:`CheckpointError` unless every file of the manifest is there with its size and
    (``checksums``) its SHA-256, and the files are those of one save (the note above). ``collective``
    (default: where ``group`` has several ranks): every rank of ``group`` hashes its share of the
    files and every rank raises alike, naming the first bad file."""
    path = Path(path)
    collective = is_distributed(group) if collective is None else collective
    problem: str | None = None
    absent = False  # nothing there at all: no earlier checkpoint to suggest
    try:
        manifest = read_manifest_document(path)
        files = manifest["files"]
        problem = _check_sizes(path, files)
        if problem is None and checksums:
            rank, world = rank_and_size(group) if collective else (0, 1)
            for i, (name, info) in enumerate(sorted(files.items())):
                if i % world == rank and _sha256(path / name) != info["sha256"]:
                    problem = f"{path / name} does not match its checksum in the manifest (corrupted or modified)"
                    break
        if problem is None:
            problem = _binding_problem(path, manifest)
    except NoCheckpointError as err:
        problem, absent = str(err), True
    except CheckpointError as err:
        problem = str(err)
    problems = [p for p in (gather_objects((problem, absent), group) if collective else [(problem, absent)]) if p[0]]
    if problems:
        problem, absent = problems[0]
        if absent:
            raise NoCheckpointError(f"no checkpoint to load: {problem}")
        raise CheckpointError(f"refusing to load {path}: {problem}. Resume from an earlier checkpoint")
