"""Which rank died? A heartbeat per rank, read when a collective fails.

When a peer dies mid-step, the survivors' next collective fails with a backend message such as
gloo's ``Connection reset by peer``, which names no rank. Each rank therefore touches a small file
(``rank-<r>.json``: host, pid) every ``period`` seconds from a daemon thread, in a directory every
rank can see; after a failure, :meth:`Heartbeat.suspects` names the ranks whose process on this
host is gone or whose heartbeat stopped. Torch-free.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path


class Heartbeat:
    def __init__(self, directory: str | Path, rank: int, world_size: int, period: float = 1.0) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self.world_size = world_size
        self.period = period
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _file(self, rank: int) -> Path:
        return self.directory / f"rank-{rank}.json"

    def start(self) -> Heartbeat:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._file(self.rank).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        self._thread = threading.Thread(target=self._beat, name=f"cephalo-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.period):
            try:
                os.utime(self._file(self.rank))
            except OSError:  # the directory went away (teardown): nothing left to report to
                return

    def stop(self) -> None:
        self._stop.set()
        self._file(self.rank).unlink(missing_ok=True)
        try:
            self.directory.rmdir()  # the last rank out removes the directory
        except OSError:
            pass

    def suspects(self, wait: float | None = None) -> list[str]:
        """Ranks that look dead, as readable lines; waits up to ``wait`` s (default 3 periods) for a
        stopped heartbeat to become visible."""
        deadline = time.monotonic() + (3 * self.period if wait is None else wait)
        host = socket.gethostname()
        while True:
            found = []
            for rank in range(self.world_size):
                if rank == self.rank:
                    continue
                file = self._file(rank)
                try:
                    info = json.loads(file.read_text())
                    age = time.time() - file.stat().st_mtime
                except (OSError, ValueError):
                    found.append(f"rank {rank} (no heartbeat file: it never started or has exited)")
                    continue
                where = f"{info.get('host')}, pid {info.get('pid')}"
                if info.get("host") == host and not _alive(int(info.get("pid", -1))):
                    found.append(f"rank {rank} ({where}): its process is gone")
                elif age > 3 * self.period:
                    found.append(f"rank {rank} ({where}): no heartbeat for {age:.1f} s")
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(self.period / 2)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - someone else's process with that pid
        return True
    return True


def looks_like_lost_peer(error: BaseException) -> bool:
    """A collective failed because a peer went away (gloo / NCCL / store messages)."""
    text = f"{type(error).__name__}: {error}".lower()
    markers = ("connection reset", "connection closed", "connection refused", "broken pipe", "socket timeout",
               "nccl", "gloo", "distbackenderror", "timed out", "remote process exited", "peer")
    return any(m in text for m in markers)
