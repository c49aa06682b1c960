"""Who is alive: a heartbeat per rank, read when a collective fails, and one run per folder.

When a peer dies mid-step, the survivors' next collective fails with a backend message such as
gloo's ``Connection reset by peer``, which names no rank. Each rank therefore touches a small file
(``rank-<r>.json``: host, pid) every ``period`` seconds from a daemon thread, in a directory every
rank can see; after a failure, :meth:`Heartbeat.suspects` names the ranks whose process on this
host is gone or whose heartbeat stopped. Torch-free.

[Note: whose files may be removed] A file naming a process (a heartbeat, a :class:`RunLock`) is
stale only when :func:`owner_alive` says False: the process is on this host and gone (or its pid
now belongs to a later process). A process on another host cannot be checked from here, so its
files are trusted until removed by hand; the messages say which file and how. Nothing is removed
for its age, which a stalled filesystem or a clock skew between hosts would make a guess.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cephalo_lightning._common.errors import ConfigurationError

LOCK_NAME = "cephalo-run.lock"  # visible: it says which run writes the folder


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
        # a rank that stops early removes the directory while it is empty (stop), which can fall
        # between another rank's mkdir and its write, or inside its mkdir (which then finds the
        # directory there, then gone, and raises FileExistsError): make it again and write once more
        for attempt in range(3):
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._file(self.rank).write_text(json.dumps(process_identity()))
                break
            except (FileNotFoundError, FileExistsError):
                if attempt == 2:
                    raise
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


def process_identity() -> dict[str, Any]:
    """This process as files name it: host, pid, its start (wall clock, and the kernel's start time
    of the pid where ``/proc`` has it, which tells a reused pid apart)."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "proc_start": _proc_start(os.getpid())}


def _proc_start(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # field 22: start time, after the parenthesised name


def owner_alive(owner: dict[str, Any]) -> bool | None:
    """Whether the process ``owner`` names runs: None when it is on another host (cannot be told)."""
    if owner.get("host") != socket.gethostname():
        return None
    pid = int(owner.get("pid", -1))
    if not _alive(pid):
        return False
    recorded, now = owner.get("proc_start"), _proc_start(pid)
    return recorded is None or now is None or recorded == now  # another start time: the pid was reused


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


# ----------------------------------------------------------------------------- one run per folder


class FolderInUseError(ConfigurationError):
    """Another run holds the folder (its :class:`RunLock`): two runs there would delete each other's files."""


@dataclass(frozen=True)
class RunLock:
    """``<folder>/cephalo-run.lock``, naming the run that writes the folder (see the note above)."""

    path: Path
    owner: dict[str, Any]

    @classmethod
    def acquire(cls, folder: str | Path, on_takeover: Callable[[str], None]) -> RunLock:
        """Create the lock (atomically: it appears complete or not at all), taking over a stale one
        (``on_takeover`` gets a line); raises :class:`FolderInUseError` when a live run holds it."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path, me = folder / LOCK_NAME, process_identity()
        for _ in range(5):  # each round ends with a lock created, refused, or one taken over
            if _create_exclusive(path, json.dumps(me).encode()):
                return cls(path, me)
            held = _read_owner(path)
            if held is None:
                continue  # released meanwhile
            alive = owner_alive(held) if held else True  # unreadable: being written, trusted
            if alive is False:
                if _take_away(path, held):
                    on_takeover(f"Cephalo: took over the stale lock {path} of a run that is gone "
                                f"({_describe(held)})")
                continue
            raise FolderInUseError(_in_use_message(folder, path, held, alive))
        raise FolderInUseError(f"Cephalo: could not lock {folder}: other runs keep creating and removing {path}; "
                               "give this run a folder of its own (Trainer(default_root_dir=...) or "
                               "ModelCheckpoint(dirpath=...))")

    def release(self) -> None:
        """Remove the lock if it is still this run's."""
        if _read_owner(self.path) == self.owner:
            self.path.unlink(missing_ok=True)


def _describe(owner: dict[str, Any]) -> str:
    return f"host {owner.get('host')}, pid {owner.get('pid')}, started {owner.get('started')}"


def _in_use_message(folder: Path, path: Path, held: dict[str, Any], alive: bool | None) -> str:
    if not held:
        who, stale = "a run whose lock file cannot be read", f"If no run uses {folder}, delete {path}."
    elif alive:
        who, stale = f"a live run ({_describe(held)})", f"If that process is not a run writing {folder}, delete {path}."
    else:
        who = f"a run on another host ({_describe(held)}; its process cannot be checked from here)"
        stale = f"If that run has ended (killed without cleaning up), delete {path}."
    return (f"Cephalo: {folder} is in use by {who}: two runs writing one folder would delete each other's "
            "checkpoints. Give this run a folder of its own (Trainer(default_root_dir=...) or "
            f"ModelCheckpoint(dirpath=...)), or wait for that run to end. {stale}")


def _read_owner(path: Path) -> dict[str, Any] | None:
    """The lock's owner; None when there is no lock, {} when it cannot be read."""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _create_exclusive(path: Path, content: bytes) -> bool:
    """Create ``path`` with ``content`` unless it exists: a hard link of a complete temporary file
    (atomic, also on NFS), else ``O_EXCL`` where the filesystem has no hard links."""
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, content)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as err:  # pragma: no cover - filesystems without hard links
        if err.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
            raise
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, content)
        finally:
            os.close(fd)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _take_away(path: Path, held: dict[str, Any]) -> bool:
    """Remove the stale lock ``held``, only it: renamed aside first and checked, a newer lock that
    a concurrent takeover created meanwhile is put back."""
    aside = path.with_name(f"{path.name}.stale-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    if _read_owner(aside) == held:
        aside.unlink(missing_ok=True)
        return True
    try:
        os.link(aside, path)
    except FileExistsError:  # pragma: no cover - three runs racing for one stale lock
        pass
    aside.unlink(missing_ok=True)
    return False


def probe_writable(folder: str | Path) -> str | None:
    """Why this process cannot create files in ``folder`` (created if missing), or None if it can."""
    folder = Path(folder)
    probe = folder / f".cephalo-probe-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        probe.unlink()
    except OSError as err:
        return os_error_line(err)
    return None


def os_error_line(err: OSError) -> str:
    return f"{type(err).__name__}: {err.strerror or err}" + (f" ({err.filename})" if err.filename else "")


def dead_heartbeats(root: str | Path) -> list[str]:
    """The rank files under ``root/heartbeat-*/`` whose process this host can tell is gone."""
    found = []
    for file in sorted(Path(root).glob("heartbeat-*/rank-*.json")):
        try:
            owner = json.loads(file.read_text())
        except (OSError, ValueError):
            continue  # being written, or unreadable: trusted
        if isinstance(owner, dict) and owner_alive(owner) is False:
            found.append(str(file))
    return found


def remove_stale_heartbeats(root: str | Path, dead: Iterable[str]) -> list[Path]:
    """Remove the ``root/heartbeat-*`` directories every one of whose rank files is in ``dead``
    (the union of what each rank's host could tell); the rest may be a live run's."""
    dead = set(dead)
    removed = []
    for directory in sorted(Path(root).glob("heartbeat-*")):
        files = [str(f) for f in directory.glob("rank-*.json")]
        if files and all(f in dead for f in files):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed
