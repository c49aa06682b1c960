"""Configs that ship inside the package, so an installed wheel runs the demo without a clone.

Each file here is a byte-for-byte copy of the same file in the repository's top-level
``configs/`` (the copy users read and edit; ``tests/test_install.py`` fails when they differ).
``cephalo-train fit --config quickstart`` and ``python -m cephalo_lightning demo`` find them by name.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def names() -> list[str]:
    """The packaged configs, by name (``quickstart``, ...)."""
    return sorted(p.stem for p in HERE.glob("*.yaml"))


def packaged(name: str) -> Path | None:
    """The packaged config called ``name`` (with or without ``.yaml``), or None."""
    stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
    path = HERE / f"{stem}.yaml"
    return path if "/" not in name and "\\" not in name and path.is_file() else None


def resolve(value: str) -> str:
    """A ``--config`` value: an existing file as given, else the packaged config of that name.

    Anything else (a missing path, inline YAML) is returned unchanged for jsonargparse to judge.
    """
    if Path(value).is_file():
        return value
    path = packaged(value)
    return str(path) if path is not None else value
