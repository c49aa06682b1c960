"""Profiling progress on rank 0 (other ranks and ``quiet`` get a no-op).

On a terminal: a transient rich bar. Anywhere else (torchrun or SLURM logs, a pipe): one plain line
per phase, through :meth:`ProfileProgress.info`, which also carries the profiler's own messages.
"""

from __future__ import annotations

import logging
import sys
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

log = logging.getLogger(__name__)

# Lightning's rank-zero helpers; present in sys.modules whenever Lightning runs this profiler
LIGHTNING_RANK_ZERO = "lightning.pytorch.utilities.rank_zero"


class ProfileProgress:
    """Two lines: the phase (which rank's device is being measured) and this rank's own rounds."""

    def __init__(self, enabled: bool, phases: int, console: Console | None = None) -> None:
        self.enabled = enabled
        self._progress: Progress | None = None
        self._phase_total = phases
        console = console or Console()
        self._plain = enabled and not console.is_terminal
        if enabled and not self._plain:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                transient=True, console=console,
            )
            self._phase = self._progress.add_task("profiling", total=phases)
            self._rounds = self._progress.add_task("  this rank", total=None, visible=False)

    @staticmethod
    def info(message: str, *args: Any) -> None:
        """One plain log line (``%``-style ``args``), shown in non-terminal logs too.

        Under Lightning it goes through ``rank_zero_info``, so Lightning's own handler prints it
        like Lightning's messages; without Lightning (plain torch) to this module's logger. The
        profiling package never imports Lightning itself.
        """
        text = message % args if args else message
        rank_zero = sys.modules.get(LIGHTNING_RANK_ZERO)
        if rank_zero is not None:
            rank_zero.rank_zero_info(text)
        else:
            log.info(text)

    def __enter__(self) -> ProfileProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()

    def phase(self, description: str) -> None:
        """A new phase starts (e.g. "measuring rank 1: cpu (emulated x3.0)")."""
        if self._progress is not None:
            self._progress.update(self._phase, description=description)
        elif self._plain:
            self.info("Cephalo: %s", description)

    def phase_done(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._phase)

    def rounds(self, done: int, total: int) -> None:
        """This rank's measurement rounds (``profile_model``'s ``on_progress``); the bar only."""
        if self._progress is not None:
            self._progress.update(self._rounds, completed=done, total=total, visible=done < total)
