"""The package's closed vocabularies, one string enum each (torch-free).

A member's value is the string plans, cluster files, options and logs carry, and a member compares
equal to it (``Schedule.LAYERED == "layered"``) and serialises as it (``json.dumps``, f-strings).

[Note: strings stop at the door] The readers of files and options parse the string into its member
(``Schedule(raw)``, once the value is known to be one of :func:`values_of`), the package's records
hold members, and only the writers of files that need the plain ``str`` (YAML, whose safe dumper
refuses a ``str`` subclass) write ``member.value``. The user-facing choices that add ``auto``
(:data:`ScheduleChoice`, :data:`CollectiveChoice`, :data:`HandbackChoice`) are spelled out as
``Literal`` types, which type checkers and LightningCLI read (it matches an ``Enum`` by member
*name*, ``LAYERED``, not by the value a YAML file writes); ``tests/test_vocabulary.py`` holds each to ``(AUTO, *values_of(...))``.
"""

from __future__ import annotations

import enum
import sys
from typing import Any, Literal, TypeVar

if sys.version_info >= (3, 11):
    StrEnum = enum.StrEnum
else:  # pragma: no cover - Python 3.10
    class StrEnum(str, enum.Enum):
        """``enum.StrEnum`` of Python 3.11: a member is its value, also under ``str()``."""

        def __str__(self) -> str:
            return str(self.value)


class Schedule(StrEnum):
    """How a rank runs its micro-batches: layer by layer over all of them (``layered``), or each
    micro-batch through the whole model with one micro-batch count on every rank (``uniform``)."""

    LAYERED = "layered"
    UNIFORM = "uniform"


class PipelineSchedule(StrEnum):
    """The order a pipelined plan runs its micro-batches through the stages: every forward then every
    backward (``gpipe``: a stage holds all M micro-batches' inputs), or one forward one backward once
    the pipeline is full (``1f1b``: stage s of S holds about S - s of them)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"


class Collective(StrEnum):
    """How an uneven shard is gathered and reduced: padded to the largest shard, or exact sizes."""

    PADDED = "padded"
    EXACT = "exact"


class Planner(StrEnum):
    """Who made a plan: ``plan(planner=...)``'s choices (Cephalo's search and the baselines), and
    the two plans made without the planner (an elastic restart's, the provisional layout's)."""

    CEPHALO = "cephalo"
    EVEN = "even"
    PROPORTIONAL = "proportional"
    POPLAR = "poplar"
    REFERENCE = "reference"
    DDP_EVEN = "ddp-even"
    HSDP_EVEN = "hsdp-even"
    ELASTIC = "elastic"
    PROVISIONAL = "provisional"


class Grouping(StrEnum):
    """How the ranks split into shard groups: one group of every rank (full shard), one per node
    (HSDP), the halves or the pairs of every node of four or more ranks, one per rank (data parallel)."""

    FULL = "full"
    PER_NODE = "per-node"
    NODE_HALVES = "node-halves"
    NODE_PAIRS = "node-pairs"
    PER_RANK = "per-rank"


class Handback(StrEnum):
    """What the user's module holds once a fit, validation or test returns: the whole trained
    parameters on every rank (``all``), on global rank 0 only (``rank0``; the others keep their
    shard pieces and refuse use), or nowhere (``none``: every rank keeps its pieces)."""

    ALL = "all"
    RANK0 = "rank0"
    NONE = "none"


class Verdict(StrEnum):
    """What the planner's feasibility check concludes: a plan exists, none can (a proof), or the
    check could not tell."""

    FEASIBLE = "feasible"
    INFEASIBLE = "infeasible"
    UNKNOWN = "unknown"


class ProfileSource(StrEnum):
    """Where a device's figures came from: measured by the profiler, estimated from the GPU catalog,
    or measured on a CPU process emulating the device."""

    MEASURED = "measured"
    CATALOG = "catalog"
    EMULATED = "emulated"


AUTO = "auto"  # an option decided at setup: the schedule from the model, the collective from the backend
Auto = Literal["auto"]
# the user's words for an option that is a member or decided at setup (a YAML file writes the value)
ScheduleChoice = Literal["auto", "layered", "uniform"]  # AUTO or a Schedule
CollectiveChoice = Literal["auto", "padded", "exact"]  # AUTO or a Collective
HandbackChoice = Literal["auto", "all", "rank0", "none"]  # AUTO (decided by the model's size) or a Handback


def values_of(vocabulary: type[StrEnum]) -> tuple[str, ...]:
    """The members' strings in their order, as plain ``str`` (for messages, choices and files)."""
    return tuple(member.value for member in vocabulary)


Member = TypeVar("Member", bound=StrEnum)


def member_of(vocabulary: type[Member], value: Any) -> Member | Any:
    """The member whose string ``value`` is, or ``value`` itself when it is none of them, for the
    caller's check to refuse with its own message (a record parses what it was given this way)."""
    return vocabulary(value) if isinstance(value, str) and value in values_of(vocabulary) else value


def hold_member(record: Any, name: str, vocabulary: type[StrEnum], error: type[Exception], fix: str) -> None:
    """Field ``name`` of the frozen dataclass ``record`` held as its member when it was given as the
    string (``RankPlan(..., source="catalog")``); any other value is refused naming the choices."""
    value = getattr(record, name)
    if isinstance(value, vocabulary):
        return
    if value not in values_of(vocabulary):
        raise error(f"{type(record).__name__}.{name} must be one of {values_of(vocabulary)}, got {value!r}; {fix}")
    object.__setattr__(record, name, vocabulary(value))


__all__ = ["AUTO", "Auto", "Collective", "CollectiveChoice", "Grouping", "Handback", "HandbackChoice",
           "PipelineSchedule", "Planner", "ProfileSource", "Schedule", "ScheduleChoice", "StrEnum", "Verdict", "hold_member", "member_of", "values_of"]
