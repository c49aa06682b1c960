"""The fenced blocks of the user docs (README.md and docs/**/*.md) and how tests/test_docs.py runs them.

The convention (every page owner follows it):

* a ```python block runs as a standalone script: cwd a fresh temporary folder, the repository root
  on ``PYTHONPATH``, ``WANDB_MODE=offline``, ``COLUMNS=120``;
* a ```bash, ```sh or ```console block runs through ``bash -euo pipefail`` from the repository
  root with the test's Python environment first on ``PATH`` (a console block's ``$ `` lines are the
  commands, its other lines their output);
* a ```yaml block is parsed (``yaml.safe_load``);
* a block whose fence line is immediately preceded by ``<!-- docs-test: parse-only (REASON) -->``
  (e.g. ``(needs a GPU)``, ``(needs a SLURM cluster)``) is only parsed: python with ``ast.parse``,
  bash with ``bash -n``, yaml with ``safe_load``; so is a block whose fence carries a
  ``title="needs ..."`` attribute;
* a block preceded by ``<!-- docs-test: output -->`` (any language, or none) is what the block
  right before it prints on stdout, with nothing but blank lines between the two: that block runs
  and its stdout must equal this one after :func:`normalised`. A marker with no runnable block
  right before it is an error, so a page cannot show output that no test produces;
* a block preceded by ``<!-- docs-test: illustration (REASON) -->`` is shown output that no block
  on the page prints (a benchmark's measured times, a directory listing, a file's form); it is not
  run, and says why;
* blocks of any other language (none, ``text``, ``json`` with elisions) are not run.

The comparison of an ``output`` block (:func:`normalised`, both sides alike): trailing spaces of
each line and blank lines at the start and the end are dropped, the repository root's path reads
``<repo>`` and the block's working folder (a python block's temporary folder) ``<tmp>``. Nothing
else: every number is compared exactly, so a block that prints wall-clock measurements cannot be an
``output`` block (show them as an ``illustration (measured)``, or print predictions instead).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
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
    ILLUSTRATION = "illustration"


NEEDS_REASON = (Handling.PARSE_ONLY, Handling.ILLUSTRATION)


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # the fence's line, 1-based
    language: str  # python | bash | yaml
    code: str
    handling: Handling
    reason: str = ""
    prints: str | None = None  # the ``output`` block after it: what it must print (its fence's line in ``printed_at``)
    printed_at: int = 0

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
    return page_blocks(str(path.relative_to(ROOT)), path.read_text())


def page_blocks(page: str, text: str) -> list[Block]:
    """Every fenced block of the markdown ``text`` (of ``page``, for messages), in page order."""
    lines = text.splitlines()
    out: list[Block] = []
    previous: Block | None = None  # the block made of the fence before this one (None: that fence made none)
    previous_end = -1  # the line index of the previous fence's closing line
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
                                          "parse-only (REASON), output or illustration (REASON)") from None
            reason = marker.group("reason") or ""
            if handling in NEEDS_REASON and not reason.strip():
                raise DocsConventionError(f"{page}:{i}: a {handling.value} marker needs its reason, e.g. "
                                          f"<!-- docs-test: {handling.value} (needs a GPU) -->")
        title = re.search(r'title="(needs[^"]*)"', opened.group("attrs"))
        if title and handling is Handling.RUN:
            handling, reason = Handling.PARSE_ONLY, title.group(1)
        between = lines[previous_end + 1:i - 1]  # from the previous block's closing fence to the marker
        if handling is Handling.OUTPUT:
            if previous is None or previous is not out[-1] or any(line.strip() for line in between):
                raise DocsConventionError(
                    f"{page}:{i}: an output block must follow the python or bash block that prints it, with only "
                    "blank lines between them; for output no block on the page prints, write "
                    "<!-- docs-test: illustration (REASON) -->")
            out[-1] = _printing(previous, "\n".join(body) + "\n", f"{page}:{i}")
            previous = None  # a second output block after it has no block of its own
        elif language is not None:
            code = "\n".join(body) + "\n"
            if opened.group("lang").lower() == "console":
                code = _console_commands(code)
            previous = Block(page, i + 1, language, code, handling, reason)
            out.append(previous)
        else:
            previous = None
        previous_end = j
        i = j + 1
    return out


def _printing(block: Block, printed: str, where: str) -> Block:
    """``block``, which an ``output`` block (marker at ``where``) says prints ``printed``."""
    if block.handling is not Handling.RUN or block.language not in ("python", "bash"):
        raise DocsConventionError(f"{where}: an output block follows {block.id}, which the test does not run as a script "
                                  f"(a {block.language} block, {block.handling.value}); show the output as "
                                  "<!-- docs-test: illustration (REASON) -->")
    return replace(block, prints=printed, printed_at=int(where.rsplit(":", 1)[1]) + 1)


def normalised(text: str, folder: str | Path | None = None) -> str:
    """``text`` as an ``output`` block is compared (module docstring): trailing spaces and the blank
    lines around it dropped, the repository root ``<repo>``, ``folder`` (the block's cwd) ``<tmp>``."""
    for path, name in ((folder, "<tmp>"), (ROOT, "<repo>")):
        if path is not None:
            resolved = str(Path(path).resolve())
            text = text.replace(resolved, name).replace(str(path), name)
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")


def all_blocks() -> list[Block]:
    return [b for path in pages() for b in blocks(path)]
