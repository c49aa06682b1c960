"""Summing a unit's reduced gradient over the shard groups, exactly, so every replica holds the same.

Each shard group holds one whole replica of the training state, split by its own shares. After the
in-group reduce-scatter, rank i of group g holds its group's gradient sum over its range; the
model's gradient is the sum of those over the groups. Groups cut the unit at different points, so
the pieces do not line up: the sum runs over the common refinement of every group's cut points
(:func:`~.layout.replica_pieces`). Each refinement segment is split into one piece per group; the
owner of piece k in group k is its *leader*. Two ``all_to_all_single`` on the world group do it:
every owner sends its partial sum of a piece to the piece's leader, the leader adds the groups' sums
in group order (0, 1, ...) and sends the total back. Every replica of an element then holds the
very bits its leader computed.

When every group cuts a unit at the same points (groups of one rank, or equal groups with equal
shares: HSDP), the replicas of a range are rank i of every group and one ``all_reduce`` over that
*replica group* does the same (its result is the same on every rank of it). That all-reduce is
started as soon as the in-group reduction is done and waited for in :meth:`ReplicaReducer.wait`,
before the optimizer.

[Note: gradient buckets] With groups of one rank (data parallelism) there is no in-group reduction:
a unit's whole gradient is what every replica sums. Units then share all-reduces as DDP's buckets
do: consecutive units in the reduction order (the last unit first) fill one flat buffer, the first
bucket closing at :data:`FIRST_BUCKET_BYTES` (so the reduction starts early in the backward) and
the others at :data:`BUCKET_BYTES`; a bucket's all-reduce starts as soon as its last unit's
gradient is written into it, and each unit's reduced gradient is a view of the buffer (no copy
back). The buckets are a pure function of the units' sizes, dtypes and trainability
(:func:`gradient_buckets`), so every rank cuts them alike; a unit reduced out of that order (a
caller waiting after every unit) closes the open bucket early, on every rank alike. An all-reduce
hands every rank the same bits, so the replicas stay identical whatever the cut.

Every rank issues the same collectives for the same units in the same order (the choice between the
two ways is a pure function of the layouts), including ranks whose range of a unit is empty.

[Note: a sum across jobs] The replicas may also live outside this world: each job one shard group
(fault tolerance's replica groups, each its own process group), cut alike, so rank i of every job
holds the same ranges. The caller then hands in ``across``, a :class:`ReplicaSum` over rank i of
every job (it may change between steps; the runtime only starts and waits its all-reduces), and the
world is one shard group: the sum runs exactly as the replica group's above, during the backward,
a bucket's all-reduce (groups of one rank) or a unit's (groups of several ranks, after its in-group
reduce-scatter) started as soon as it is ready and waited in :meth:`ReplicaReducer.wait`. Every job
cuts the same buckets (a pure function of the units), so every job issues the same all-reduces in
the same order. An empty range issues nothing, on every job alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

# DDP's first bucket and bucket_cap_mb, where the cost model prices the last bucket by the same cut
from cephalo_lightning.planner.cost.collective_prices import BUCKET_BYTES, FIRST_BUCKET_BYTES
from cephalo_lightning.runtime.collectives import Collectives, CudaStreams, Links, PendingWork
from cephalo_lightning.runtime.sharding.layout import ShardLayout, UnitLayout, replica_pieces, same_bounds

Consume = Callable[[torch.Tensor], None]
Fill = Callable[[torch.Tensor], None]


class Waitable(Protocol):
    def wait(self) -> object: ...


class ReplicaSum(Protocol):
    """A sum over the replicas of this rank's ranges beyond the world ([Note: a sum across jobs])."""

    def start_all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                         name: str = "") -> Waitable:
        """Begin summing ``tensor`` in place; it holds the sum after ``wait()``."""
        ...


Runs = tuple[tuple[int, int], ...]  # (offset, length) runs of a buffer, in the order they are used


def _take(tensor: torch.Tensor, runs: Runs) -> torch.Tensor:
    """The runs of ``tensor`` one after another (a new tensor)."""
    if not runs:
        return tensor.new_empty(0)
    return torch.cat([tensor.narrow(0, a, n) for a, n in runs])


def _put(out: torch.Tensor, runs: Runs, values: torch.Tensor) -> None:
    """Write ``values`` (the runs' elements one after another) into ``out``'s runs."""
    at = 0
    for a, n in runs:
        out.narrow(0, a, n).copy_(values.narrow(0, at, n))
        at += n


@dataclass(frozen=True)
class _Exchange:
    """One unit's leader exchange, seen from one rank: a few runs per piece, never per element."""

    send_runs: Runs  # of this rank's range: what goes to the leaders, by destination (world order)
    send_sizes: tuple[int, ...]  # per world rank
    receive_sizes: tuple[int, ...]  # per world rank: the other groups' partial sums of the pieces it leads
    led_runs: Runs  # of this rank's range: the pieces it leads, in led order
    from_group: tuple[Runs | None, ...]  # per group: where in the receive buffer each led piece's partial
    #                                      sum is, in led order (None: this rank's own group)
    back_runs: Runs  # of the led total: what goes back to each owner, in receive order


def _exchange(units: Sequence[UnitLayout], shard_groups: Sequence[Sequence[int]], group_of: Sequence[int],
              rank: int) -> _Exchange:
    world = len(group_of)
    mine = group_of[rank]
    place = shard_groups[mine].index(rank)
    lo = units[mine].bounds[place]
    sends: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    receives: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]  # (start, length, led offset)
    led: list[tuple[int, int]] = []
    led_numel = 0
    for piece in replica_pieces(units):
        if piece.owners[mine] != place:
            continue
        n = piece.stop - piece.start
        if piece.leader == mine:
            led.append((piece.start - lo, n))
            for g, ranks in enumerate(shard_groups):
                if g != mine:
                    receives[ranks[piece.owners[g]]].append((piece.start, n, led_numel))
            led_numel += n
        else:
            sends[shard_groups[piece.leader][piece.owners[piece.leader]]].append((piece.start - lo, n))
    from_group: list[list[tuple[int, int, int]] | None] = [[] if g != mine else None for g in range(len(shard_groups))]
    back: list[tuple[int, int]] = []
    offset = 0  # in the receive buffer: sources in world order, each source's pieces in led order
    for source in range(world):
        for _, n, at in receives[source]:
            from_group[group_of[source]].append((at, offset, n))  # type: ignore[union-attr]
            back.append((at, n))
            offset += n
    return _Exchange(
        tuple(run for per_rank in sends for run in per_rank), tuple(sum(n for _, n in per) for per in sends),
        tuple(sum(n for _, n, _ in per) for per in receives), tuple(led),
        tuple(None if runs is None else tuple((o, n) for _, o, n in sorted(runs)) for runs in from_group),
        tuple(back))


@dataclass(frozen=True)
class Bucket:
    """Units reduced by one all-reduce: ``units`` in reduction order, each at ``offsets`` in the flat buffer."""

    units: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    names: tuple[str, ...]  # the units'


def _label(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def gradient_buckets(numels: Sequence[int | None], dtypes: Sequence[torch.dtype], names: Sequence[str],
                     first_bytes: int = FIRST_BUCKET_BYTES, bucket_bytes: int = BUCKET_BYTES) -> list[Bucket]:
    """The buckets of [Note: gradient buckets]: unit ``i`` holds ``numels[i]`` gradient elements of
    ``dtypes[i]`` (None: it is never reduced, a frozen unit). Units go in reduction order (the
    highest index first); a bucket closes once it holds ``first_bytes`` (the first) or
    ``bucket_bytes`` (the others), and before a unit of another dtype."""
    buckets: list[Bucket] = []
    units: list[int] = []
    offsets: list[int] = []
    numel = 0

    def close() -> None:
        nonlocal numel
        if units:
            buckets.append(Bucket(tuple(units), tuple(offsets), numel, dtypes[units[0]], tuple(names[u] for u in units)))
        units.clear()
        offsets.clear()
        numel = 0

    for index in range(len(numels) - 1, -1, -1):
        if numels[index] is None:
            continue
        if units and dtypes[index] != dtypes[units[0]]:
            close()
        units.append(index)
        offsets.append(numel)
        numel += numels[index]
        cap = bucket_bytes if buckets else first_bytes
        if numel * dtypes[index].itemsize >= cap:
            close()
    close()
    return buckets


@dataclass
class _OpenBucket:
    """The bucket being filled: its buffer from ``start`` (the offset of the first unit written) on."""

    bucket: int
    start: int
    buffer: torch.Tensor
    filled: int  # the offset in the bucket up to which units are written
    consumers: list[tuple[torch.Tensor, Consume]]
    names: list[str]  # of the units written


class ReplicaReducer:
    """The cross-group sum of every unit's reduced gradient for one rank (see the module notes).

    ``layouts``: every shard group's layout (group order); ``world``: the collectives of the group
    spanning all replicas; ``replica``: those of this rank's replica group (rank i of every group),
    or None when the groups differ in size (no unit can then be cut alike); ``across``: the sum over
    the replicas outside the world, where the world is one shard group ([Note: a sum across jobs]).
    """

    def __init__(self, layouts: Sequence[ShardLayout], shard_groups: Sequence[Sequence[int]], world: Collectives,
                 replica: Collectives | None, across: ReplicaSum | None = None) -> None:
        if across is not None and len(shard_groups) != 1:
            raise ValueError(f"a sum across jobs needs the world to be one shard group (here {len(shard_groups)}: "
                             f"{[list(g) for g in shard_groups]}); each job holds one replica")
        self.world = world
        self.world_replica = replica  # the replica group inside the world (kept when ``across`` changes)
        self.replica: Collectives | ReplicaSum | None = across if across is not None else replica
        self.across = across is not None
        self.num_groups = len(shard_groups)
        self._one_rank_groups = all(len(ranks) == 1 for ranks in shard_groups)
        group_of = [0] * world.world_size
        for g, ranks in enumerate(shard_groups):
            for r in ranks:
                group_of[r] = g
        self._plans: list[_Exchange | None] = []  # per unit; None: all-reduce over the replica group
        for units in zip(*(layout.units for layout in layouts)):
            if self.num_groups == 1 or same_bounds(units):
                self._plans.append(None)
            else:
                self._plans.append(_exchange(units, shard_groups, group_of, world.rank))
        self._pending: list[tuple[Waitable, torch.Tensor, Consume]] = []
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, tuple[int, int, str]] = {}  # unit index -> (bucket, offset in it, name)
        self._open: _OpenBucket | None = None

    @property
    def active(self) -> bool:
        return self.num_groups > 1 or self.across

    @property
    def data_parallel(self) -> bool:
        """Every group is one rank: units' gradients are all-reduced whole, in buckets."""
        return self.active and self.replica is not None and self._one_rank_groups

    @property
    def replicated_in_world(self) -> bool:
        """Every rank of the world ends the backward holding the same whole gradient (data
        parallelism inside the world; a sum across jobs leaves the world one group)."""
        return self.data_parallel and not self.across

    def plan_buckets(self, numels: Sequence[int | None], dtypes: Sequence[torch.dtype], names: Sequence[str],
                     first_bytes: int = FIRST_BUCKET_BYTES, bucket_bytes: int = BUCKET_BYTES) -> None:
        """Cut the units into [Note: gradient buckets] (data parallelism only; see :func:`gradient_buckets`)."""
        self.buckets = gradient_buckets(numels, dtypes, names, first_bytes, bucket_bytes) if self.data_parallel else []
        self._bucket_of = {u: (b, o, name) for b, bucket in enumerate(self.buckets)
                           for u, o, name in zip(bucket.units, bucket.offsets, bucket.names)}

    def bucketed(self, index: int) -> bool:
        return index in self._bucket_of

    def reduce_bucketed(self, index: int, numel: int, device: torch.device, fill: Fill, consume: Consume) -> None:
        """Unit ``index``'s gradient joins its bucket: ``fill(out)`` writes it into ``out`` (a view of
        the bucket's buffer, ``numel`` elements); ``consume`` gets the summed view in :meth:`wait`."""
        b, offset, name = self._bucket_of[index]
        bucket = self.buckets[b]
        run = self._open
        if run is not None and (run.bucket != b or run.filled != offset):  # out of order: close the open one
            self._start(run)
            run = None
        if run is None:
            run = self._open = _OpenBucket(b, offset, torch.empty(bucket.numel - offset, dtype=bucket.dtype,
                                                                  device=device), offset, [], [])
        out = run.buffer.narrow(0, offset - run.start, numel)
        fill(out)
        run.consumers.append((out, consume))
        run.names.append(name)
        run.filled = offset + numel
        if run.filled == bucket.numel:
            self._start(run)

    def _start(self, run: _OpenBucket) -> None:
        self._open = None
        flat = run.buffer.narrow(0, 0, run.filled - run.start)
        assert self.replica is not None
        work = self.replica.start_all_reduce(flat, name=f"replicas:{_label(run.names)}") if flat.numel() else PendingWork()
        consumers = run.consumers

        def consume_all(_: torch.Tensor) -> None:
            for view, consume in consumers:
                consume(view)

        self._pending.append((work, flat, consume_all))

    def reduce(self, index: int, unit: UnitLayout, shard: torch.Tensor, consume: Consume) -> None:
        """Sum unit ``index``'s group-reduced ``shard`` over the groups and hand it to ``consume``:
        at once after the leader exchange, or in :meth:`wait` after an all-reduce started now."""
        if not self.active:
            consume(shard)
            return
        plan = self._plans[index]
        if plan is None:
            assert self.replica is not None
            empty = self.across and not shard.numel()  # [Note: a sum across jobs]: nothing to send, on every job
            work = PendingWork() if empty else self.replica.start_all_reduce(shard, name=f"replicas:{unit.name}")
            self._pending.append((work, shard, consume))
            return
        consume(self._exchange(plan, unit, shard))

    @torch.no_grad()
    def _exchange(self, plan: _Exchange, unit: UnitLayout, shard: torch.Tensor) -> torch.Tensor:
        partial = torch.empty(sum(plan.receive_sizes), dtype=shard.dtype, device=shard.device)
        self.world.move(_take(shard, plan.send_runs), partial, list(plan.send_sizes), list(plan.receive_sizes),
                        name=f"replicas:{unit.name}", recorded_numel=unit.numel)
        total: torch.Tensor | None = None
        for runs in plan.from_group:  # in group order, so every leader adds alike
            part = _take(shard, plan.led_runs) if runs is None else _take(partial, runs)
            total = part if total is None else total + part
        assert total is not None
        back = torch.empty(sum(plan.send_sizes), dtype=shard.dtype, device=shard.device)
        self.world.move(_take(total, plan.back_runs), back, list(plan.receive_sizes), list(plan.send_sizes),
                        name=f"replicas:{unit.name}:back", recorded_numel=unit.numel)
        out = shard.clone()
        _put(out, plan.send_runs, back)
        _put(out, plan.led_runs, total)
        return out

    def wait(self) -> None:
        """Every started all-reduce is done and consumed (in the order they were started); a bucket
        still open is started first."""
        if self._open is not None:
            self._start(self._open)
        pending, self._pending = self._pending, []
        for work, shard, consume in pending:
            work.wait()
            consume(shard)


def replica_ranks(shard_groups: Sequence[Sequence[int]]) -> list[tuple[int, ...]] | None:
    """Rank i of every group, for each i, when the groups are all the same size (else None)."""
    sizes = {len(ranks) for ranks in shard_groups}
    if len(sizes) != 1:
        return None
    return [tuple(ranks[i] for ranks in shard_groups) for i in range(sizes.pop())]


def new_groups(group: dist.ProcessGroup | None, members: Sequence[Sequence[int]], world_size: int) -> list[dist.ProcessGroup | None]:
    """One process group per entry of ``members`` (ranks of ``group``); every rank creates every one,
    in the same order, as ``new_group`` requires. A group of all ranks is ``group`` itself."""
    def global_rank(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    out = []
    for ranks in members:
        if len(ranks) == world_size:
            out.append(group)
        else:
            out.append(dist.new_group([global_rank(r) for r in ranks]))
    return out


@dataclass(frozen=True)
class GroupSpec:
    """How a sharded model makes its collectives, kept to make them again for new shard groups
    (a plan switch that regroups the ranks)."""

    group: dist.ProcessGroup | None  # the world's process group (None: the default one)
    collective: str  # the collective mode (:class:`~cephalo_lightning._common.vocabulary.Collective` or auto)
    record: bool  # record every collective issued (tests)
    streams: CudaStreams | None  # the side streams of the shard group's gathers and reductions (CUDA)
    links: Links | None  # emulated links that slow the collectives crossing them


def group_collectives(world: Collectives, shard_groups: Sequence[Sequence[int]],
                      spec: GroupSpec) -> tuple[Collectives, Collectives | None]:
    """This rank's shard group's collectives and its replica group's (rank i of every group; None
    with one group or groups of different sizes), made as ``spec`` says. One group of all ranks is
    the world itself."""
    if len(shard_groups) == 1:
        return world, None
    size = world.world_size
    if size != dist.get_world_size():
        raise ValueError(f"shard groups need the model on every rank of the default process group ({size} of "
                         f"{dist.get_world_size()} here): their process groups are created by every rank")
    mine = next(g for g, ranks in enumerate(shard_groups) if world.rank in ranks)
    comm = Collectives(new_groups(spec.group, shard_groups, size)[mine], spec.collective, record=spec.record,
                       observers=world.observers, streams=spec.streams, links=spec.links)
    replicas = replica_ranks(shard_groups)
    if replicas is None:
        return comm, None
    place = shard_groups[mine].index(world.rank)
    return comm, Collectives(new_groups(spec.group, replicas, size)[place], spec.collective, record=spec.record,
                             observers=world.observers, links=spec.links)
