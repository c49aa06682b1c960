"""Where every element of the training state lives: uneven, contiguous, deterministic.

Each unit (a transformer block, the embedding, ...) is one flat buffer; rank r owns the contiguous
range ``[bounds[r], bounds[r+1])`` of it. Rank r's total over all units equals its state share of
the whole model (to the element). Units are filled in order and split EVENLY among the ranks that
still have quota, so the early units take the fast even collectives and the imbalance collects in
the last units (the reference implementation does the same). Pure Python: the layout is a function
of the shares and the unit sizes only, so every rank computes the same one without talking.

With shard groups each group lays the whole model out over its own ranks (:func:`group_layouts`);
the common refinement of the groups' cut points (:func:`refinement`, :func:`replica_pieces`) says
which rank of every group owns each range, for the sum over the replicas (:mod:`.replicas`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamSpan:
    """A parameter's place inside its unit's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class UnitLayout:
    name: str
    bounds: tuple[int, ...]  # world_size + 1 cut points; rank r owns [bounds[r], bounds[r+1])
    params: tuple[ParamSpan, ...] = ()

    @property
    def numel(self) -> int:
        return self.bounds[-1]

    @property
    def world_size(self) -> int:
        return len(self.bounds) - 1

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:]))

    @property
    def max_shard(self) -> int:
        return max(self.shard_sizes)

    @property
    def is_even(self) -> bool:
        return len(set(self.shard_sizes)) == 1

    def shard_range(self, rank: int) -> tuple[int, int]:
        return self.bounds[rank], self.bounds[rank + 1]

    def part(self, keep: Sequence[bool]) -> UnitLayout:
        """The sub-layout of the parameters where ``keep`` is true, packed one after another in
        their order: a rank owns the kept elements of its own range, which are consecutive in the
        packed order (packing keeps the order), so the part is sharded like the unit
        ([Note: a unit's two parts])."""
        if len(keep) != len(self.params):
            raise ValueError(f"unit {self.name}: {len(keep)} flags for {len(self.params)} parameters")
        if all(keep):
            return self
        kept = [span for span, k in zip(self.params, keep) if k]

        def before(position: int) -> int:  # kept elements before ``position`` of the unit's flat buffer
            return sum(min(max(position - s.offset, 0), s.numel) for s in kept)

        spans, offset = [], 0
        for span in kept:
            spans.append(ParamSpan(span.name, span.shape, offset, span.numel))
            offset += span.numel
        return UnitLayout(self.name, tuple(before(b) for b in self.bounds), tuple(spans))

    def param_piece(self, span: ParamSpan, rank: int) -> tuple[int, int]:
        """The part of ``span`` rank owns, as [start, stop) within the flattened parameter."""
        lo, hi = self.shard_range(rank)
        start = min(max(lo, span.offset), span.offset + span.numel)
        stop = max(min(hi, span.offset + span.numel), start)
        return start - span.offset, stop - span.offset


@dataclass(frozen=True)
class ShardLayout:
    shares: tuple[float, ...]
    units: tuple[UnitLayout, ...]

    @property
    def world_size(self) -> int:
        return len(self.shares)

    @property
    def total_numel(self) -> int:
        return sum(u.numel for u in self.units)

    def owned_numel(self, rank: int) -> int:
        return sum(u.shard_sizes[rank] for u in self.units)

    def owners(self) -> list[tuple[str, int, int, int]]:
        """Every (parameter, rank, start, stop) piece: who stores which elements of what."""
        rows = []
        for unit in self.units:
            for span in unit.params:
                for rank in range(self.world_size):
                    start, stop = unit.param_piece(span, rank)
                    if stop > start:
                        rows.append((span.name, rank, start, stop))
        return rows

    def describe(self) -> str:
        """A readable table: each unit's size and every rank's slice of it."""
        header = f"{'unit':<28}{'numel':>12}  " + "  ".join(f"{'rank ' + str(r):>10}" for r in range(self.world_size))
        lines = [header]
        for unit in self.units:
            cells = "  ".join(f"{s:>10}" for s in unit.shard_sizes)
            lines.append(f"{unit.name:<28}{unit.numel:>12}  {cells}{'' if unit.is_even else '  (uneven)'}")
        totals = "  ".join(f"{self.owned_numel(r):>10}" for r in range(self.world_size))
        lines.append(f"{'total':<28}{self.total_numel:>12}  {totals}")
        return "\n".join(lines)


def quotas(shares: Sequence[float], total: int) -> list[int]:
    """Integer element counts proportional to ``shares`` that sum to ``total`` (largest remainder)."""
    if not shares or any(s < 0 for s in shares) or sum(shares) <= 0:
        raise ValueError(f"state shares must be >= 0 with a positive sum, got {list(shares)}")
    norm = sum(shares)
    exact = [s / norm * total for s in shares]
    counts = [int(x) for x in exact]
    order = sorted(range(len(shares)), key=lambda r: (-(exact[r] - counts[r]), r))
    for r in order[: total - sum(counts)]:
        counts[r] += 1
    return counts


def _split_evenly(numel: int, remaining: list[int]) -> list[int]:
    """Split one unit among ranks with quota left: equal parts, capped by each rank's quota."""
    take = [0] * len(remaining)
    left = numel
    active = [r for r, q in enumerate(remaining) if q > 0]
    while left > 0 and active:
        part, extra = divmod(left, len(active))
        still = []
        for i, r in enumerate(active):
            want = part + (1 if i < extra else 0)
            got = min(want, remaining[r] - take[r])
            take[r] += got
            left -= got
            if take[r] < remaining[r]:
                still.append(r)
        active = still  # a round that drops no rank hands out everything that was left
    if left:
        raise AssertionError("quotas do not cover the units")  # pragma: no cover
    return take


def build_layout(
    unit_sizes: Sequence[int],
    shares: Sequence[float],
    unit_names: Sequence[str] | None = None,
    unit_params: Sequence[Sequence[ParamSpan]] | None = None,
) -> ShardLayout:
    """The layout for these units and shares. Same inputs, same layout, on every rank."""
    total = sum(unit_sizes)
    remaining = quotas(shares, total)
    names = list(unit_names) if unit_names is not None else [f"unit{i}" for i in range(len(unit_sizes))]
    params = list(unit_params) if unit_params is not None else [()] * len(unit_sizes)
    units = []
    for name, numel, spans in zip(names, unit_sizes, params):
        take = _split_evenly(numel, remaining)
        remaining = [q - t for q, t in zip(remaining, take)]
        bounds = [0]
        for t in take:
            bounds.append(bounds[-1] + t)
        units.append(UnitLayout(name, tuple(bounds), tuple(spans)))
    return ShardLayout(tuple(float(s) for s in shares), tuple(units))


# ---------------------------------------------------------------------------- shard groups


def group_layouts(
    unit_sizes: Sequence[int],
    shares: Sequence[float],
    shard_groups: Sequence[Sequence[int]],
    unit_names: Sequence[str] | None = None,
    unit_params: Sequence[Sequence[ParamSpan]] | None = None,
) -> tuple[ShardLayout, ...]:
    """Every shard group's layout of the same units: group g's ranks split the whole model by their
    shares (``shares`` has one entry per rank of the world; a group's entries are its ranks')."""
    return tuple(build_layout(unit_sizes, [shares[r] for r in ranks], unit_names, unit_params)
                 for ranks in shard_groups)


def check_shard_groups(shard_groups: Sequence[Sequence[int]], world_size: int) -> tuple[tuple[int, ...], ...]:
    """The groups as tuples; every rank of the world in exactly one, each group's ranks ascending
    (a rank's place in its group is its place among the group's ranks, as process groups number them)."""
    groups = tuple(tuple(int(r) for r in ranks) for ranks in shard_groups)
    seen = sorted(r for ranks in groups for r in ranks)
    if seen != list(range(world_size)) or any(not ranks for ranks in groups):
        raise ValueError(f"shard groups {[list(g) for g in groups]} must hold every rank 0..{world_size - 1} exactly "
                         "once, in non-empty groups")
    for ranks in groups:
        if list(ranks) != sorted(ranks):
            raise ValueError(f"shard group {list(ranks)}: list its ranks in ascending order")
    return groups


@dataclass(frozen=True)
class Segment:
    """A range of a unit that one rank of every shard group owns whole (a piece of the common
    refinement of the groups' cut points)."""

    start: int
    stop: int
    owners: tuple[int, ...]  # per group, the owning rank's place in that group

    @property
    def numel(self) -> int:
        return self.stop - self.start


def _owner(bounds: Sequence[int], position: int) -> int:
    """The rank whose range [bounds[r], bounds[r+1]) holds ``position`` (empty ranges hold nothing)."""
    return bisect_right(bounds, position) - 1


def refinement(units: Sequence[UnitLayout]) -> tuple[Segment, ...]:
    """The common refinement of one unit's layouts (one per group): every range between two
    consecutive cut points of any group, with its owner in each group. Pure: every rank computes
    the same segments alone."""
    if len({u.numel for u in units}) > 1:
        raise ValueError(f"unit {units[0].name}: the groups' layouts disagree on its size "
                         f"({[u.numel for u in units]})")
    cuts = sorted({c for u in units for c in u.bounds})
    return tuple(Segment(a, b, tuple(_owner(u.bounds, a) for u in units)) for a, b in zip(cuts, cuts[1:]) if b > a)


@dataclass(frozen=True)
class ReplicaPiece:
    """A range of a unit whose sum over the groups one leader computes: the owner in group
    ``leader`` receives the other groups' owners' partial sums, adds them in group order and sends
    the total back."""

    start: int
    stop: int
    leader: int  # the group whose owner sums this piece
    owners: tuple[int, ...]  # per group, the owning rank's place in that group


def replica_pieces(units: Sequence[UnitLayout]) -> tuple[ReplicaPiece, ...]:
    """Each segment of the refinement split into one near-equal piece per group, piece k led by
    group k's owner: every rank sums about 1/G of its range and sends and receives about
    (G-1)/G of it twice (the bandwidth of a reduce-scatter plus an all-gather among the replicas)."""
    groups = len(units)
    pieces = []
    for seg in refinement(units):
        for k in range(groups):
            a = seg.start + seg.numel * k // groups
            b = seg.start + seg.numel * (k + 1) // groups
            if b > a:
                pieces.append(ReplicaPiece(a, b, k, seg.owners))
    return tuple(pieces)


def same_bounds(units: Sequence[UnitLayout]) -> bool:
    """True when every group cuts the unit at the same points (equal groups with equal shares, or
    groups of one rank): the replicas of each range are then rank i of every group."""
    return len({u.bounds for u in units}) == 1
