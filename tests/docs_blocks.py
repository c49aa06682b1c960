"""The fenced blocks of the user docs (README.md and docs/**/*.md) and how tests/test_docs.py runs them.

The convention (every page owner follows it):

* a ```python block runs as a standalone script: cwd a fresh temporary folder, the repository root
  on ``PYTHONPATH``, ``WANDB_MODE=offline``;
* a ```bash, ```sh or ```console block runs through ``bash -euo pipefail`` from the repository
  root with the test's Python environment first on ``PATH`` (a console block's ``$ `` lines are the
  commands, its other lines their output);
* a ```yaml block is parsed (``yaml.safe_load``);
* a block whose fence line is immediately preceded by ``<!-- docs-test: parse-only (REASON) -->``
  (e.g. ``(needs a GPU)``, ``(needs a SLURM cluster)``) is only parsed: python with ``ast.parse``,
  bash with ``bash -n``, yaml with ``safe_load``; so is a block whose fence carries a
  ``title="needs ..."`` attribute;
* a block preceded by ``<!-- docs-test: output -->`` is expected output and is not run;
* blocks of any other language (none, ``text``, ``json`` with elisions) are not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<kind>[a-z-]+)\s*(?:\((?P<reason>[^)]*)\))?\s*-->")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)(?P<attrs>.*)$")
LANGUAGES = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash", "console": "bash",
             "yaml": "yaml", "yml": "yaml"}


class Handling(Enum):
    RUN = "run"
    PARSE_ONLY = "parse-only"
    OUTPUT = "output"


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # the fence's line, 1-based
    language: str  # python | bash | yaml
    code: str
    handling: Handling
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


class DocsConventionError(ValueError):
    """A marker that is malformed or precedes no block."""


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _console_commands(code: str) -> str:
    lines = code.splitlines()
    if not any(line.startswith("$ ") for line in lines):
        return code
    return "\n".join(line[2:] for line in lines if line.startswith("$ ")) + "\n"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` the convention runs or parses, in page order."""
    page = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            marker = MARKER.search(lines[i])
            if marker and (i + 1 >= len(lines) or not FENCE.match(lines[i + 1])):
                raise DocsConventionError(f"{page}:{i + 1}: a docs-test marker must be the line right before a fence")
            i += 1
            continue
        indent, fence = opened.group("indent"), opened.group("fence")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence) and lines[j].strip().strip(fence[0]) == ""):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        if j >= len(lines):
            raise DocsConventionError(f"{page}:{i + 1}: the block opened here is never closed")
        language = LANGUAGES.get(opened.group("lang").lower())
        handling, reason = Handling.RUN, ""
        marker = MARKER.search(lines[i - 1]) if i > 0 else None
        if marker:
            try:
                handling = Handling(marker.group("kind"))
            except ValueError:
                raise DocsConventionError(f"{page}:{i}: unknown docs-test marker {marker.group('kind')!r}; use "
                                          "parse-only (REASON) or output") from None
            reason = marker.group("reason") or ""
            if handling is Handling.PARSE_ONLY and not reason.strip():
                raise DocsConventionError(f"{page}:{i}: a parse-only marker needs its reason, e.g. "
                                          "<!-- docs-test: parse-only (needs a GPU) -->")
        title = re.search(r'title="(needs[^"]*)"', opened.group("attrs"))
        if title and handling is Handling.RUN:
            handling, reason = Handling.PARSE_ONLY, title.group(1)
        if language is not None:
            code = "\n".join(body) + "\n"
            if opened.group("lang").lower() == "console":
                code = _console_commands(code)
            out.append(Block(page, i + 1, language, code, handling, reason))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for path in pages() for b in blocks(path)]
