"""All-gather and reduce-scatter of uneven contiguous shards, in two interchangeable ways.

``padded``: pad every shard to the largest and use the equal-size all-gather / reduce-scatter
(``all_gather_into_tensor`` / ``reduce_scatter_tensor``, renamed ``*_single`` in torch 2.13) (one fast collective on gloo and NCCL; wastes ``W*max/total - 1`` of the
bandwidth on uneven units, nothing on even ones). ``exact``: no padding, on gloo and NCCL: the
all-gather sends this rank's shard to every peer and receives each peer's straight into its place
in the unit's buffer (point-to-point), the reduce-scatter sends each peer its range and sums the
peers' pieces of its own one at a time ([Note: a pairwise reduce-scatter holds two shards]). Even
units take the equal-size collectives, except the reduce-scatter on gloo, which is pairwise too; a
padded reduce-scatter on gloo is an ``all_to_all_single`` plus a local sum (faster there than gloo's
own).

[Note: an exact all-gather holds no send buffer] A prefetched all-gather is in flight while the
layer before it computes, and whatever buffer it holds then adds to that layer's peak, which the
profile (one layer's own memory plus the gathered neighbour) does not count. An
``all_to_all_single`` would need this rank's shard repeated once per peer (W times the shard: up to
W whole units for a rank that holds the last units alone), so the exact all-gather is made of
point-to-point sends of the shard itself and receives into ``out``. The padded all-gather of an
uneven unit still holds its padded shard and a staging buffer of W padded shards.

Every call is recorded in :attr:`Collectives.log` when ``record=True``, which is how the tests prove
that every rank issues the same collectives in the same order, and reported to the runtime's
observers (:mod:`.observers`), which also opens a ``cephalo::<op>`` profiler range; an
asynchronous collective is reported again for its ``wait()`` (:class:`WaitReport`).

On CUDA (:class:`CudaStreams`) the copies around a collective run on side streams, so they overlap
the compute stream: an all-gather's cast and padding on the all-gather stream, a reduce-scatter
(and the accumulation of its result into the local gradients) on the reduce-scatter stream. The
compute stream waits on an all-gather only where the gathered unit is used
(:meth:`PendingGather.wait`) and on the reduce-scatters only before the optimizer needs the
gradients (:meth:`Collectives.wait_reductions`). On gloo (CPU) everything runs in order.

[Note: emulated links] ``links`` (any object with ``seconds(rank, peer_bytes)``, :class:`Links`)
slows the collectives that cross a slow link: a collective this rank issues at ``t0`` completes no
earlier than ``t0 + links.seconds(global rank, bytes sent to each global peer)``. A synchronous call
sleeps the remainder before returning, an asynchronous one in its ``wait()``, so compute that
overlaps an asynchronous collective hides the link's time, as on hardware. The bytes per peer are
what the call sends: its split sizes for an ``all_to_all_single``, the (padded) shard to every peer
for an equal-size all-gather or reduce-scatter, ``2M/k`` to each peer for an all-reduce of ``M``
bytes over ``k`` ranks.

[Note: memory lifetime across streams] A tensor allocated on one stream and used on another is
marked with ``record_stream`` for the using stream (the caching allocator then waits for that
stream before reusing the block). Buffers held by a :class:`PendingGather` stay referenced until
its ``wait()``, so nothing a collective reads or writes is freed while it is in flight.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from cephalo_lightning._common.vocabulary import AUTO, Auto, Collective, values_of
from cephalo_lightning.runtime.distributed import rank_and_size
from cephalo_lightning.runtime.observers import Observers
from cephalo_lightning.runtime.sharding.layout import UnitLayout


def resolve_mode(mode: Collective | Auto, group: dist.ProcessGroup | None = None) -> Collective:
    """A mode as its member (its string is taken too); ``"auto"``: ``exact`` on gloo (faster at every
    imbalance measured there, see benchmarks/bench_runtime.py), ``padded`` elsewhere (NCCL's
    equal-size collectives are fast)."""
    if mode in values_of(Collective):
        return Collective(mode)
    if mode != AUTO:
        raise ValueError(f"collective mode must be 'auto' or one of {values_of(Collective)}, got {mode!r}")
    distributed = dist.is_available() and dist.is_initialized()
    return Collective.EXACT if distributed and dist.get_backend(group) == "gloo" else Collective.PADDED

# torch 2.13 renamed the equal-size collectives (the old names warn); keep older torch working.
_all_gather_equal = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_equal = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CudaStreams:
    """The side streams of one CUDA device: all-gather, reduce-scatter and host copies."""

    def __init__(self, device: torch.device) -> None:  # pragma: no cover - CUDA only
        self.device = device
        self.all_gather = torch.cuda.Stream(device)
        self.reduce_scatter = torch.cuda.Stream(device)
        self.copy = torch.cuda.Stream(device)

    @staticmethod
    def for_device(device: torch.device, enabled: bool = True) -> CudaStreams | None:
        """Streams on CUDA (when ``enabled``), ``None`` elsewhere: every caller then runs in order."""
        if not enabled or device.type != "cuda":
            return None
        return CudaStreams(device)  # pragma: no cover - CUDA only

    @contextlib.contextmanager
    def side(self, stream: torch.cuda.Stream) -> Iterator[torch.cuda.Stream]:  # pragma: no cover - CUDA only
        """Run the block on ``stream`` after everything the current stream has queued."""
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            yield current


class Links(Protocol):
    """How long this rank's sends of one collective take over the links (e.g. emulated ones)."""

    def seconds(self, rank: int, peer_bytes: Mapping[int, int]) -> float: ...


def _sleep_until(deadline: float | None) -> None:
    if deadline is not None:
        left = deadline - time.perf_counter()
        if left > 0:
            time.sleep(left)


@dataclass(frozen=True)
class WaitReport:
    """Whom an asynchronous collective's ``wait()`` reports to, and as which collective.

    The observers hear an asynchronous collective twice, as two regions of the same ``op``: its
    issue and its wait. Together they are the time the host is blocked in it, the part that
    compute did not hide (the emulated link's remainder included)."""

    observers: Observers
    op: str
    unit: str
    numel: int

    @staticmethod
    def of(observers: Observers, op: str, unit: str, numel: int) -> WaitReport | None:
        return WaitReport(observers, op, unit, numel) if observers else None


def _complete(pending: PendingWork | PendingGather) -> None:
    """Wait for ``pending``'s collective and its emulated link time; the observers hear it as a
    region of its collective when it reports to them."""
    if pending.work is None and pending.deadline is None:
        return
    report = pending.report
    with (contextlib.nullcontext() if report is None else report.observers.collective(report.op, report.unit,
                                                                                      report.numel)):
        if pending.work is not None:
            pending.work.wait()
            pending.work = None
        _sleep_until(pending.deadline)
        pending.deadline = None


@dataclass
class AllOf:
    """Several works in flight as one: ``wait()`` waits for every one (the point-to-point sends and
    receives of an exact all-gather)."""

    works: list[dist.Work]

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


@dataclass
class PendingWork:
    """A collective in flight (or done): ``wait()`` returns once it is complete and its emulated
    link time, if any, has passed."""

    work: dist.Work | None = None
    deadline: float | None = None  # perf_counter() time before which the links have not delivered
    report: WaitReport | None = None

    def wait(self) -> None:
        _complete(self)


@dataclass
class PendingGather:
    """An all-gather in flight; ``wait()`` makes ``out`` hold the whole unit."""

    out: torch.Tensor
    work: dist.Work | None = None
    staging: torch.Tensor | None = None
    unit: UnitLayout | None = None
    source: torch.Tensor | None = None  # the sent shard, kept alive until the collective is done
    stream: torch.cuda.Stream | None = None  # the side stream the copy-in ran on (CUDA)
    deadline: float | None = None  # see [Note: emulated links]
    report: WaitReport | None = None

    def wait(self) -> torch.Tensor:
        _complete(self)
        if self.stream is not None:  # pragma: no cover - CUDA only
            torch.cuda.current_stream(self.out.device).wait_stream(self.stream)
            self.stream = None
        self.source = None
        if self.staging is not None and self.unit is not None:
            chunk = self.unit.max_shard
            for r, (lo, hi) in enumerate(zip(self.unit.bounds, self.unit.bounds[1:])):
                self.out[lo:hi].copy_(self.staging[r * chunk : r * chunk + hi - lo])
            self.staging = None
        return self.out


@dataclass
class Collectives:
    """Collectives of one process group (``None`` = single process)."""

    group: dist.ProcessGroup | None = None
    mode: Collective | Auto = AUTO  # resolved at construction: a Collective
    record: bool = False
    log: list[tuple[str, str, int]] = field(default_factory=list)
    observers: Observers = field(default_factory=Observers)
    streams: CudaStreams | None = None
    links: Links | None = None  # see [Note: emulated links]
    sent_bytes: dict[str, int] = field(default_factory=dict)  # bytes this rank sent to its peers, by operation

    def __post_init__(self) -> None:
        self.mode = resolve_mode(self.mode, self.group)
        self.rank, self.world_size = rank_and_size(self.group)
        # every rank of the group by its global rank (what the links are keyed by)
        self.global_ranks: tuple[int, ...] = (
            tuple(dist.get_process_group_ranks(self.group)) if self.group is not None and self.world_size > 1
            else tuple(range(self.world_size)))
        # Gloo's reduce_scatter_tensor is slower than its all_reduce; all_to_all_single plus a local
        # sum gives the same result 1.6-2x faster (benchmarks/bench_runtime.py), so on gloo padded
        # mode's equal-size reduce-scatters use it, and even units the pairwise one (which holds two
        # shards, not W). NCCL keeps reduce_scatter_tensor.
        self.on_gloo = self.world_size > 1 and dist.get_backend(self.group) == "gloo"

    def _note(self, op: str, unit: UnitLayout) -> None:
        if self.record:
            self.log.append((op, unit.name, unit.numel))

    def _deadline(self, op: str, sent: list[int], element_size: int) -> float | None:
        """When a collective issued now, sending ``sent[q]`` elements to group rank q, is complete
        over the links (None without links or when nothing leaves this rank); counts the bytes sent
        in :attr:`sent_bytes` under ``op``."""
        if self.world_size > 1:
            out = sum(n for q, n in enumerate(sent) if q != self.rank) * element_size
            self.sent_bytes[op] = self.sent_bytes.get(op, 0) + out
        if self.links is None or self.world_size == 1:
            return None
        start = time.perf_counter()
        peer_bytes = {self.global_ranks[q]: n * element_size for q, n in enumerate(sent) if q != self.rank and n}
        seconds = self.links.seconds(self.global_ranks[self.rank], peer_bytes) if peer_bytes else 0.0
        return start + seconds if seconds > 0 else None

    def _equal_sends(self, chunk: int) -> list[int]:
        return [chunk] * self.world_size

    def all_gather(
        self, shard: torch.Tensor, out: torch.Tensor, unit: UnitLayout, async_op: bool = False,
        dtype: torch.dtype | None = None,
    ) -> PendingGather:
        """Fill ``out`` (the unit's full flat buffer) from every rank's ``shard`` (cast to ``dtype``)."""
        if unit.numel == 0:  # nothing to move (e.g. a root unit without parameters): same on every rank
            return PendingGather(out)
        self._note("all_gather", unit)
        with self.observers.collective("all_gather", unit.name, unit.numel):
            if self.streams is None:
                pending = self._all_gather(shard.to(dtype or out.dtype), out, unit, async_op)
            else:  # pragma: no cover - CUDA only
                with self.streams.side(self.streams.all_gather) as _:
                    pending = self._all_gather(shard.to(dtype or out.dtype), out, unit, async_op=True)
                    pending.stream = self.streams.all_gather
                if not async_op:
                    pending.wait()
        if async_op:
            pending.report = WaitReport.of(self.observers, "all_gather", unit.name, unit.numel)
        return pending

    def _all_gather(self, shard: torch.Tensor, out: torch.Tensor, unit: UnitLayout, async_op: bool) -> PendingGather:
        if self.world_size == 1:
            out.copy_(shard)
            return PendingGather(out, source=shard)
        lo, hi = unit.shard_range(self.rank)
        per_peer = hi - lo if unit.is_even or self.mode == Collective.EXACT else unit.max_shard
        deadline = self._deadline("all_gather", self._equal_sends(per_peer), shard.element_size())
        pending = self._all_gather_issue(shard, out, unit, async_op)
        if async_op:
            pending.deadline = deadline
        else:
            _sleep_until(deadline)
        return pending

    def _all_gather_issue(self, shard: torch.Tensor, out: torch.Tensor, unit: UnitLayout,
                          async_op: bool) -> PendingGather:
        lo, hi = unit.shard_range(self.rank)
        if unit.is_even:
            work = _all_gather_equal(out, shard, group=self.group, async_op=async_op)
            return PendingGather(out, work, source=shard)
        if self.mode == Collective.EXACT:  # [Note: an exact all-gather holds no send buffer]
            out[lo:hi].copy_(shard)
            ops = []
            for r, peer in enumerate(self.global_ranks):
                a, b = unit.shard_range(r)
                if r == self.rank:
                    continue
                if hi > lo:
                    ops.append(dist.P2POp(dist.isend, shard, peer, self.group))
                if b > a:
                    ops.append(dist.P2POp(dist.irecv, out[a:b], peer, self.group))
            work = AllOf(dist.batch_isend_irecv(ops)) if ops else None
            if work is not None and not async_op:
                work.wait()
                work = None
            return PendingGather(out, work, source=shard)
        chunk = unit.max_shard
        padded = shard.new_zeros(chunk)
        padded[: hi - lo].copy_(shard)
        staging = shard.new_empty(chunk * self.world_size)
        work = _all_gather_equal(staging, padded, group=self.group, async_op=async_op)
        return PendingGather(out, work, staging, unit, source=padded)

    def reduce_scatter(self, full: torch.Tensor, unit: UnitLayout) -> torch.Tensor:
        """Sum ``full`` (this rank's whole-unit gradient, flat or, where :meth:`pads_reduction`,
        padded) over ranks; return this rank's range.

        With CUDA streams the result is produced on the reduce-scatter stream: use it there (see
        :meth:`reduce_scatter_into`) or after :meth:`wait_reductions`.
        """
        self._note("reduce_scatter", unit)
        with self.observers.collective("reduce_scatter", unit.name, unit.numel):
            deadline = self._deadline("reduce_scatter", self._reduce_scatter_sends(unit), full.element_size())
            shard = self._reduce_scatter(full, unit)
            _sleep_until(deadline)
            return shard

    def _reduce_scatter_sends(self, unit: UnitLayout) -> list[int]:
        """Elements this rank sends to each group rank in the reduce-scatter of ``unit``."""
        if unit.is_even:
            return self._equal_sends(unit.numel // max(self.world_size, 1))
        if self.mode == Collective.EXACT:
            return list(unit.shard_sizes)
        return self._equal_sends(unit.max_shard)

    def reduce_scatter_into(self, full: torch.Tensor, unit: UnitLayout, consume) -> None:  # noqa: ANN001
        """Reduce-scatter ``full`` and hand this rank's range to ``consume(shard)``; on CUDA both run
        on the reduce-scatter stream, overlapping the compute stream (which waits in
        :meth:`wait_reductions`)."""
        if self.streams is None:
            consume(self.reduce_scatter(full, unit))
            return
        with self.streams.side(self.streams.reduce_scatter):  # pragma: no cover - CUDA only
            full.record_stream(self.streams.reduce_scatter)  # allocated on the compute stream
            consume(self.reduce_scatter(full, unit))

    def wait_reductions(self, grads: list[torch.Tensor] = ()) -> None:
        """The compute stream waits for every reduce-scatter issued so far (no-op without streams).

        ``grads`` were written on the reduce-scatter stream and are used on the compute stream
        from now on: they are marked so the allocator waits for it before reusing them.
        """
        if self.streams is None:
            return
        current = torch.cuda.current_stream(self.streams.device)  # pragma: no cover - CUDA only
        current.wait_stream(self.streams.reduce_scatter)
        for grad in grads:
            grad.record_stream(current)

    def _reduce_scatter(self, full: torch.Tensor, unit: UnitLayout) -> torch.Tensor:
        lo, hi = unit.shard_range(self.rank)
        if self.world_size == 1:  # a rank alone: its gradient is the sum (the caller's own tensor)
            return full if (lo, hi) == (0, full.numel()) else full[lo:hi].clone()
        if (self.mode == Collective.EXACT and not unit.is_even) or (unit.is_even and self.on_gloo):
            return self._reduce_scatter_pairwise(full, unit)
        if unit.is_even:
            return self._reduce_scatter_equal(full)
        chunk = unit.max_shard
        if full.numel() == self.world_size * chunk:  # laid out padded already (FlatUnit.take_full_grad)
            padded = full
        else:
            padded = full.new_zeros(self.world_size * chunk)
            for r, (a, b) in enumerate(zip(unit.bounds, unit.bounds[1:])):
                padded[r * chunk : r * chunk + b - a].copy_(full[a:b])
        return self._reduce_scatter_equal(padded)[: hi - lo].clone()

    def pads_reduction(self, unit: UnitLayout) -> bool:
        """Whether ``unit``'s reduce-scatter pads its shards: the gradient can be laid out so at once."""
        return self.mode == Collective.PADDED and self.world_size > 1 and not unit.is_even

    def _reduce_scatter_pairwise(self, full: torch.Tensor, unit: UnitLayout) -> torch.Tensor:
        """[Note: a pairwise reduce-scatter holds two shards] Each peer's range of ``full`` is sent
        to it as a view, and the peers' pieces of this rank's range arrive one at a time into one
        buffer, summed in rank order into the result: beside ``full`` the reduction holds two shards
        of this rank's size, however uneven the unit (an ``all_to_all_single`` would receive W of
        them at once: up to W whole units for a rank that holds most of a unit)."""
        lo, hi = unit.shard_range(self.rank)
        sends = []
        for r, peer in enumerate(self.global_ranks):
            a, b = unit.shard_range(r)
            if r != self.rank and b > a:
                sends.append(dist.isend(full[a:b], peer, group=self.group))
        out = full.new_empty(hi - lo)
        if hi > lo:
            received = full.new_empty(hi - lo)
            for r, peer in enumerate(self.global_ranks):
                if r != self.rank:
                    dist.recv(received, peer, group=self.group)
                piece = full[lo:hi] if r == self.rank else received
                if r == 0:
                    out.copy_(piece)
                else:
                    out.add_(piece)
        for work in sends:
            work.wait()
        return out

    def _reduce_scatter_equal(self, full: torch.Tensor) -> torch.Tensor:
        """Sum ``full`` (W equal chunks) over ranks; return this rank's chunk."""
        chunk = full.numel() // self.world_size
        if self.on_gloo:
            received = torch.empty_like(full)
            dist.all_to_all_single(received, full, group=self.group)
            return received.view(self.world_size, chunk).sum(0)
        out = full.new_empty(chunk)
        _reduce_scatter_equal(out, full, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.start_all_reduce(tensor).wait()
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        self.start_all_reduce(tensor, dist.ReduceOp.MAX).wait()
        return tensor

    def start_all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                         name: str = "") -> PendingWork:
        """Begin reducing ``tensor`` in place over the group; it holds the result after ``wait()``."""
        if self.world_size == 1:
            return PendingWork()
        if self.record and name:
            self.log.append(("all_reduce", name, tensor.numel()))
        with self.observers.collective("all_reduce", name, tensor.numel()):
            per_peer = 2 * tensor.numel() // self.world_size
            deadline = self._deadline("all_reduce", self._equal_sends(per_peer), tensor.element_size())
            work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        return PendingWork(work, deadline, WaitReport.of(self.observers, "all_reduce", name, tensor.numel()))

    def move(self, source: torch.Tensor, out: torch.Tensor, send_sizes: list[int], receive_sizes: list[int],
             name: str = "", recorded_numel: int | None = None) -> None:
        """Send consecutive pieces of ``source`` to ranks 0..W-1 and receive ``out``'s from each
        (one ``all_to_all_single`` with split sizes; how state moves between two layouts).
        ``recorded_numel``: the size the log records (default: what this rank sends)."""
        if self.record:
            self.log.append(("all_to_all", name, source.numel() if recorded_numel is None else recorded_numel))
        if self.world_size == 1:
            out.copy_(source)
            return
        with self.observers.collective("all_to_all", name, source.numel()):
            deadline = self._deadline("all_to_all", list(send_sizes), source.element_size())
            dist.all_to_all_single(out, source, output_split_sizes=receive_sizes, input_split_sizes=send_sizes,
                                   group=self.group)
            _sleep_until(deadline)
