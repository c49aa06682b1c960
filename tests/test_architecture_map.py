"""The map in docs/architecture.md against the package's tree: every subpackage (``path/``) and every
module (``path.py``, ``__init__.py`` aside: its subpackage's row stands for it) is named in the first
column of one of the map's tables, and the map names nothing that does not exist. Read from the
source; nothing is imported."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cephalo_lightning"
PAGE = ROOT / "docs" / "architecture.md"
MAP_ROW = re.compile(r"^\| ((?:`[^`]+`(?:, )?)+) \|", re.M)  # a table row whose first cell is backticked paths


def _map_section() -> str:
    text = PAGE.read_text()
    start = text.index("\n## The map\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def mapped_paths(section: str) -> list[str]:
    return [path for cell in MAP_ROW.findall(section) for path in re.findall(r"`([^`]+)`", cell)]


def tree_paths() -> set[str]:
    """Every module but ``__init__.py`` and every subpackage (a folder with an ``__init__.py``), relative
    to the package."""
    modules = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if p.name != "__init__.py" and "__pycache__" not in p.parts}
    packages = {f"{p.parent.relative_to(PACKAGE)}/" for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE}
    return modules | packages


def test_the_parser_reads_rows_of_one_or_several_paths() -> None:
    section = "| path | what |\n|---|---|\n| `a/` | x |\n| `a/b.py`, `a/c.py` | y, `z` |\n| plain | `w.py` |\n"
    assert mapped_paths(section) == ["a/", "a/b.py", "a/c.py"]


def test_the_map_names_every_module_and_subpackage_once_and_nothing_else() -> None:
    named = mapped_paths(_map_section())
    twice = sorted(path for path, count in Counter(named).items() if count > 1)
    tree = tree_paths()
    missing = sorted(tree - set(named))
    extra = sorted(set(named) - tree)
    assert not missing, f"add these to the map in docs/architecture.md (one row each, or beside their kin): {missing}"
    assert not extra, f"the map in docs/architecture.md names what the package does not have: {extra}"
    assert not twice, f"the map in docs/architecture.md names these more than once: {twice}"

