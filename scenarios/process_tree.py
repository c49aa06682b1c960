"""A started process and every process it started, ended together.

    tree(root) = root + children(root) + children(children(root)) + ...   (parent ids read from /proc)

A signal to the root alone is not enough for a launcher: torchrun starts each rank in a session of
its own (a signal to the launcher's process group misses them), and a rank whose launcher is gone
trains on, an orphan holding its ports. :func:`end_tree` SIGKILLs the root first (so it starts
nothing more), then every descendant found before, then reaps the root.

[Note: the tree is read before the root dies. Once it has, its children belong to init and their
parent ids no longer lead back to it, so the walk comes first and the kills after.]
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

PROC = Path("/proc")


def _parents() -> dict[int, int]:
    """Every running process's parent id, by process id (empty where there is no ``/proc``)."""
    parents = {}
    for stat in PROC.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # it ended while we read
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ")"
        parents[int(stat.parent.name)] = int(text[text.rindex(")") + 2:].split()[1])
    return parents


def descendants(pid: int) -> list[int]:
    """The process ids under ``pid`` (children first, then theirs), ``pid`` itself excluded."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, queue = [], list(children.get(pid, []))
    while queue:
        child = queue.pop(0)
        found.append(child)
        queue += children.get(child, [])
    return found


def end_tree(process: subprocess.Popen) -> None:
    """SIGKILL ``process`` and every process under it (see the module note), and reap ``process``."""
    under = descendants(process.pid) if process.poll() is None else []
    if process.poll() is None:
        process.kill()
    for pid in under:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended on its own meanwhile
            pass
    process.wait()
