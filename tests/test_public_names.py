"""Every public name is importable from where the documentation says, and YAML class paths resolve."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "examples").glob("*.md")),
        *sorted((ROOT / "examples").glob("*.py"))]  # the examples are documentation too
TEXT = "\n".join(p.read_text() for p in DOCS if p.exists())

FROM_IMPORT = re.compile(r"from (cephalo_lightning[\w.]*) import ([\w, ]+)")
DOTTED = re.compile(r"(?<![\w/.])(cephalo_lightning(?:\.[A-Za-z_]\w*)+)")


def _from_imports() -> list[tuple[str, str]]:
    pairs = {(module, name.strip().split(" as ")[0]) for module, names in FROM_IMPORT.findall(TEXT)
             for name in names.split(",") if name.strip()}
    return sorted(pairs)


def _resolve(dotted: str) -> object:
    """Import the longest module prefix of ``dotted`` and walk the rest as attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_documentation_names_public_imports():
    assert len(_from_imports()) >= 5 and len(set(DOTTED.findall(TEXT))) >= 5


@pytest.mark.parametrize("module,name", _from_imports())
def test_a_documented_import_works(module: str, name: str):
    assert hasattr(importlib.import_module(module), name), f"the docs import {name} from {module}, which lacks it"


@pytest.mark.parametrize("dotted", sorted(set(DOTTED.findall(TEXT))))
def test_a_documented_dotted_name_resolves(dotted: str):
    _resolve(dotted)


def _class_paths(node: object) -> list[str]:
    if isinstance(node, dict):
        own = [node["class_path"]] if isinstance(node.get("class_path"), str) else []
        return own + [p for value in node.values() for p in _class_paths(value)]
    if isinstance(node, list):
        return [p for value in node for p in _class_paths(value)]
    return []


CONFIG_FILES = sorted((ROOT / "configs").rglob("*.yaml")) + sorted((ROOT / "cephalo_lightning" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_class_path_in_the_shipped_configs_resolves(path: Path):
    for class_path in _class_paths(yaml.safe_load(path.read_text())):
        if class_path.startswith("cephalo_lightning"):
            assert isinstance(_resolve(class_path), type), class_path


@pytest.mark.parametrize("class_path", ["cephalo_lightning.CephaloStrategy", "cephalo_lightning.CephaloCallback"])
def test_the_root_class_paths_resolve(class_path: str):
    from cephalo_lightning import CephaloCallback, CephaloStrategy

    assert _resolve(class_path) in (CephaloStrategy, CephaloCallback)
