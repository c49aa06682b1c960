"""A fit's run folders and failures: ``claim_folders`` locks every checkpoint folder (rank 0) and
checks that every rank can write to each and to the heartbeats' folder, before the fit writes
anything; :class:`FailureReport` holds the heartbeat and the locks while the fit runs and, when a
collective fails, names the rank that stopped and where to resume.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning.runtime.distributed import broadcast_object, gather_objects
from cephalo_lightning.runtime.liveness import (
    FolderInUseError,
    Heartbeat,
    RunLock,
    dead_heartbeats,
    looks_like_lost_peer,
    os_error_line,
    probe_writable,
)


def checkpoint_folders(trainer: pl.Trainer) -> list[Path]:
    """The distinct folders the fit's checkpoint callbacks write (resolved by their setup)."""
    folders = [Path(c.dirpath) for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None)]
    return list(dict.fromkeys(folders))


def claim_folders(trainer: pl.Trainer, root: Path) -> tuple[list[RunLock], list[str]]:
    """Collective, before the fit writes or deletes anything: rank 0 locks every checkpoint folder
    (refused while another live run holds one); then every rank checks it can write there and in
    ``root``, where the heartbeats go, and names the heartbeat files of dead processes its host can
    tell. Every rank raises the same error when any rank found a problem. Returns rank 0's locks
    and the union of the dead heartbeat files."""
    folders = checkpoint_folders(trainer)
    roles = {**{f: "a checkpoint folder" for f in folders}, root: "under Trainer(default_root_dir)"}
    locks: list[RunLock] = []
    refusal, unwritable = None, {}
    if trainer.is_global_zero:
        for folder in folders:
            try:
                locks.append(RunLock.acquire(folder, rank_zero_info))
            except FolderInUseError as err:
                refusal = str(err)
                break
            except OSError as err:
                unwritable[folder] = os_error_line(err)
    refusal = broadcast_object(refusal)
    if refusal is None:
        for folder in roles:
            why = unwritable.get(folder) or probe_writable(folder)
            if why is not None:
                unwritable[folder] = why
    problems = [f"rank {trainer.global_rank} cannot write to {folder} ({roles[folder]}): {why}"
                for folder, why in unwritable.items()]
    gathered = gather_objects((problems, dead_heartbeats(root) if refusal is None else []))
    problems = [line for rank_problems, _ in gathered for line in rank_problems]
    if refusal is not None or problems:
        for lock in locks:
            lock.release()
        raise FolderInUseError(refusal) if refusal is not None else ConfigurationError(
            "Cephalo: " + "; ".join(problems) + ". Every rank writes its part of each checkpoint and its heartbeat: "
            "give folders every rank can write (shared across nodes), with Trainer(default_root_dir=...) or "
            "ModelCheckpoint(dirpath=...), or make these writable.")
    return locks, [file for _, dead in gathered for file in dead]


class FailureReport:
    """While a fit runs: heartbeats, the folder locks, and, when a collective fails, which rank
    stopped and where to resume."""

    def __init__(self, heartbeat: Heartbeat, locks: Sequence[RunLock] = ()) -> None:
        self.heartbeat = heartbeat
        self.locks = list(locks)
        self.last_checkpoint: Path | None = None

    def close(self) -> None:
        """The fit ended (also by an exception): stop the heartbeat, release the folders."""
        self.heartbeat.stop()
        for lock in self.locks:
            lock.release()
        self.locks = []

    def resume_hint(self) -> str:
        return (f" Resume with trainer.fit(..., ckpt_path={str(self.last_checkpoint)!r})." if self.last_checkpoint
                else " No checkpoint was written yet.")

    def describe(self, exception: BaseException) -> str | None:
        if not looks_like_lost_peer(exception):
            return None
        suspects = self.heartbeat.suspects()
        first_line = str(exception).splitlines()[0] if str(exception) else ""
        return (f"Cephalo (rank {self.heartbeat.rank}): a collective failed ({type(exception).__name__}: {first_line}). "
                + ("Stopped: " + "; ".join(suspects) + "." if suspects else "No peer is known to have stopped.")
                + self.resume_hint())
