"""The package's closed vocabularies, one string enum each (torch-free).

A member's value is the string plans, cluster files, options and logs carry, and a member compares
equal to it (``Schedule.LAYERED == "layered"``), so code may compare against the enum while the
values it receives are still plain strings.
"""

from __future__ import annotations

import enum
import sys

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


def values_of(vocabulary: type[StrEnum]) -> tuple[str, ...]:
    """The members' strings in their order, as plain ``str`` (for messages, choices and files)."""
    return tuple(member.value for member in vocabulary)


__all__ = ["Collective", "Grouping", "Planner", "ProfileSource", "Schedule", "StrEnum", "Verdict", "values_of"]
