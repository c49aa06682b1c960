"""A progress bar for profiling, shown on rank 0 only (other ranks and ``quiet`` get a no-op)."""

from __future__ import annotations

from types import TracebackType

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class ProfileProgress:
    """Two lines: the phase (which rank's device is being measured) and this rank's own rounds."""

    def __init__(self, enabled: bool, phases: int) -> None:
        self.enabled = enabled
        self._progress: Progress | None = None
        self._phase_total = phases
        if enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                transient=True,
            )
            self._phase = self._progress.add_task("profiling", total=phases)
            self._rounds = self._progress.add_task("  this rank", total=None, visible=False)

    def __enter__(self) -> ProfileProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()

    def phase(self, description: str) -> None:
        """A new phase starts (e.g. "measuring rank 1: cpu (emulated x3.0)")."""
        if self._progress is not None:
            self._progress.update(self._phase, description=description)

    def phase_done(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._phase)

    def rounds(self, done: int, total: int) -> None:
        """This rank's measurement rounds (``profile_model``'s ``on_progress``)."""
        if self._progress is not None:
            self._progress.update(self._rounds, completed=done, total=total, visible=done < total)
