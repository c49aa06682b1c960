"""Reading and writing the planner's files (cluster files, plans) with one-line errors.

Whatever a file holds (binary bytes, nesting deeper than the parser's stack, a path that is a
directory), reading it raises a :class:`PlanningError` naming the file, the problem and the fix,
never a ``UnicodeDecodeError`` or ``RecursionError`` from deep inside a parser.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from cephalo_lightning.planner.schema.planning_error import PlanningError

MAX_EXACT_INTEGER = 2**53  # above it a number no longer converts to a float exactly (or at all)


def read_document(path: str | Path, what: str, fix: str, *, json_only: bool = False) -> Any:
    """The parsed content of a JSON (by suffix, or ``json_only``) or YAML file; ``what`` names the
    file's kind in errors ("cluster file") and ``fix`` says how to get a good one."""
    path = Path(path)
    if not path.exists():
        raise PlanningError(f"{what} {str(path)!r} does not exist; {fix}")
    if not path.is_file():
        raise PlanningError(f"{what} {str(path)!r} is a directory, not a file; give the file's path")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise PlanningError(f"{path}: not a text file ({what}s are UTF-8 {'JSON' if json_only else 'JSON or YAML'}; byte {err.start} is "
                            f"{err.object[err.start]:#04x}); {fix}") from None
    except OSError as err:
        raise PlanningError(f"{path}: cannot read the {what} ({err.strerror or err}); check its permissions") from None
    try:
        if json_only or path.suffix.lower() == ".json":
            try:
                return json.loads(text)
            except json.JSONDecodeError as err:
                raise PlanningError(f"{path}: not valid JSON ({err}); {fix}") from None
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as err:
            first = " ".join(str(err).split())
            raise PlanningError(f"{path}: not valid YAML ({first}); {fix}") from None
    except RecursionError:
        raise PlanningError(f"{path}: nested too deeply to be a {what} (more levels than the parser's stack); "
                            f"{fix}") from None


def check_output(path: str | Path, flag: str) -> Path:
    """``path`` as a file to write, or a PlanningError when it cannot be one (a directory, no name)."""
    path = Path(path)
    if path.is_dir() or not path.name or path.name in (".", ".."):
        example = "cluster.yaml" if "cluster" in flag else "plan.json"
        raise PlanningError(f"{flag} {str(path)!r} is a directory; give a file name, e.g. {flag} "
                            f"{path / example}")
    return path


def check_writable(path: str | Path, flag: str) -> Path:
    """``path`` as a file this process can write later (its missing folders made then), checked
    before any work: a PlanningError when it is a directory, when the nearest existing folder above
    it is a file, or when that folder does not take a new file (tried with a temporary file)."""
    path = check_output(path, flag)
    if path.exists():
        if not os.access(path, os.W_OK):
            raise PlanningError(f"{flag} {str(path)!r} exists and this process may not overwrite it; choose another "
                                f"{flag}, or get permission to write it")
        return path
    folder = path.absolute().parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise PlanningError(f"{flag} {str(path)!r}: {str(folder)!r} is a file, not a folder; choose another {flag}")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise PlanningError(f"{flag} {str(path)!r}: cannot write in {str(folder)!r} ({err.strerror or err}); choose "
                            f"another {flag}, or get permission to write there") from None
    return path


def write_error(path: str | Path, err: OSError, flag: str) -> PlanningError:
    """The one-line error for a file that could not be written."""
    return PlanningError(f"cannot write {path} ({err.strerror or err}); choose another {flag}, or make room or "
                         f"permission to write there")


def shown_number(value: Any) -> str:
    """A number for a message: an integer too large to print usefully is described by its digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_EXACT_INTEGER:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1:,} digits"
    return repr(value)
