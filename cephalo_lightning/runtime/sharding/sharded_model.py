"""The uneven ZeRO-3 engine: a model whose state is sharded by per-rank shares.

:class:`ShardedModel` takes an ``nn.Module`` and the ranks' state shares, splits it into units
(:mod:`.units`, :mod:`.grouping`), lays the units out unevenly (:mod:`.layout`), builds each unit's
master shard (:mod:`.materialize`) and keeps only this rank's pieces. Two ways to compute:

* hooks (the ``uniform`` mode, any model, :mod:`.uniform_hooks`): each unit gathers before its forward, frees after,
  re-gathers before its backward and reduce-scatters its gradient once the step's last
  micro-batch is through (:meth:`set_requires_gradient_sync`);
* explicit calls from a schedule (the ``layered`` mode, :mod:`~cephalo_lightning.runtime.layered`),
  which drives :meth:`gather` / :meth:`reduce_unit` itself inside :meth:`scheduled`.

[Note: collective order] Collectives are issued in an order that depends only on the model's
structure, never on the batch: gathers follow the graph, reduce-scatters go strictly from the last
unit to the first, and a rank with no samples (or an empty share) issues the same ones. Every rank
must therefore build the same units from the same model: the layout is a pure function of the
shares and the unit sizes (:func:`~.layout.build_layout`), so no rank has to ask another.

[Note: tied parameters] A parameter held by modules of two different units (an embedding tied to
the head) belongs to the root unit, which is gathered for the whole step; both holders see the
same full parameter and autograd sums the two uses into one gradient, reduced once.

[Note: unit state] Each unit owns two explicit states. Its :class:`~.flat_unit.UnitState` says
where its parameters are::

    SHARDED --start_gather (a prefetch)--> GATHERING --gather--> GATHERED --free--> SHARDED
    SHARDED --gather-----------------------------------------> GATHERED

(``free`` of a GATHERING unit waits for its all-gather first). Its
:class:`~.flat_unit.GradState` says where its gradient is in one backward pass of the hooks::

    IDLE --_pre_backward--> COMPUTING --_post_accumulate (its last gradient)--> READY
    READY --reduce_in_order (every later unit REDUCED)--> REDUCED --finish_backward--> IDLE

The two are independent: the root stays GATHERED through READY and REDUCED (it is gathered for
the whole step, across the micro-batches that accumulate), and a prefetch may reach a unit whose
backward is already over. A schedule (the layered mode) drives ``UnitState`` only; ``GradState``
is the hooks' (:class:`~.uniform_hooks.UniformHooks`). Every hook returns at once when its unit is
already where the hook leads, so a hook that fires again (a second output of the unit reaching the
backward) does nothing. ``_pre_forward`` gathers the unit (prefetching the next) and ``_post_forward`` frees
it; ``_pre_backward`` gathers it again (prefetching the previous) and opens its ``unit_backward``
region; once autograd has accumulated the gradient of every trainable full parameter,
``_post_backward`` closes the region, frees a layer unit (not the root) and marks it READY.
``reduce_in_order`` then walks from the last unit to the first, passing REDUCED and frozen units,
reducing each READY one and stopping at the first that is neither. ``finish_backward`` walks once
more reducing every trainable unit not yet REDUCED (zeros where no gradient reached it): every
rank, whatever autograd reached and whether or not it had samples, reduce-scatters the same units
in the same order. It then closes the regions of units autograd never finished, frees the layer
units (and the root, when the gradients were synchronised) and sets every unit back to IDLE.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from cephalo_lightning._common.vocabulary import AUTO, Auto, BaseStorage, Collective, Handback
from cephalo_lightning.runtime.collectives import Collectives, CudaStreams, Links
from cephalo_lightning.runtime.observers import Observer, Observers
from cephalo_lightning.runtime.sharding import handback
from cephalo_lightning.runtime.sharding.clip import clip_grad_norm_, local_grad_norm
from cephalo_lightning.runtime.sharding.flat_unit import FlatUnit, GradState, UnitState, master_dtype_for
from cephalo_lightning.runtime.sharding.grouping import (
    Units,
    buffers_by_unit,
    group_slots,
    unit_groups,
    unit_names,
    unit_spans,
)
from cephalo_lightning.runtime.sharding.layout import ShardLayout, check_shard_groups, group_layouts
from cephalo_lightning.runtime.sharding.materialize import UnitMaterializer
from cephalo_lightning.runtime.sharding.replicas import (
    BUCKET_BYTES,
    FIRST_BUCKET_BYTES,
    GroupSpec,
    ReplicaReducer,
    ReplicaSum,
    group_collectives,
)
from cephalo_lightning.runtime.sharding.reshard import reshard
from cephalo_lightning.runtime.sharding.uniform_hooks import Driver, UniformHooks
from cephalo_lightning.runtime.sharding.wrap_policy import WrapPolicy, check_units_disjoint

__all__ = ["ShardedModel", "UnitMaterializer", "clip_grad_norm_", "local_grad_norm"]


@dataclass(frozen=True)
class ShardSummary:
    """What one rank's sharded model holds, handed up in one value (the fit's setup checks and report)."""

    units: int
    materialized_units: int  # built from the meta device, unit by unit
    local_state_numel: int  # this rank's pieces of every unit
    in_flight_gather_bytes: int  # see ShardedModel.in_flight_gather_bytes
    padded_reduction_bytes: int  # see ShardedModel.padded_reduction_bytes


class ShardedModel:
    """``module`` with its parameters sharded across ``group`` by ``shares``.

    ``shard_groups`` (the ranks of each group, ascending; None: one group of all ranks) splits the
    ranks into shard groups that each hold one whole replica between them, by their ranks' shares
    (``shares`` has one entry per rank of ``group``; a group's entries sum to 1). :attr:`comm` is this
    rank's shard group's collectives (gathers and reduce-scatters), :attr:`world` those of ``group``,
    the group spanning every replica: what every agreement between ranks must use (loss and sample
    sums, flags, checkpoints). Gradients are summed over the groups exactly (:mod:`.replicas`), so
    the replicas stay bitwise identical. Every rank of the default process group must build the
    model alike (the shard groups' process groups are created collectively). ``links`` slows the
    collectives crossing emulated links (see :class:`~cephalo_lightning.runtime.collectives.Links`).

    After construction ``module.parameters()`` yields this rank's local pieces (possibly empty),
    keyed by the original names: build the optimizer from them. ``units`` is a wrap policy
    (:func:`~.units.find_units`) or, for a schedule, the units themselves (a module or a group of
    modules each). Attach observers (timing, emulation, memory accounting) to :attr:`observers`.
    ``bucket_bytes``: (the first, every other) gradient bucket's size with groups of one rank
    (default DDP's 1 MiB and 25 MiB; see :mod:`.replicas`).
    """

    def __init__(
        self,
        module: nn.Module,
        shares: Sequence[float],
        *,
        units: WrapPolicy | Units = None,
        group: dist.ProcessGroup | None = None,
        shard_groups: Sequence[Sequence[int]] | None = None,
        links: Links | None = None,
        collective: Collective | Auto = AUTO,
        compute_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        hooks: bool = True,
        prefetch: bool = True,
        record_collectives: bool = False,
        device: torch.device | None = None,
        materializer: UnitMaterializer | None = None,
        overlap: bool = True,
        observers: Sequence[Observer] = (),
        bucket_bytes: tuple[int, int] | None = None,
        base: BaseStorage = BaseStorage.COMPUTE,
        frozen_in_master: bool = False,
        frozen_dtype: torch.dtype | None = None,
    ) -> None:
        handback.check_not_pieces(module)
        self.module = module
        self.refusals: list[RemovableHandle] = []  # hooks refusing use of the pieces after a fit (handback, PARKED)
        self.handed_back: Handback | None = None  # what the last hand_back did
        self.observers = Observers()
        for observer in observers:  # attached first, they also see the buffers sharding creates
            self.observers.attach(observer)
        first = next(iter(module.parameters()), None)
        self.device = torch.device(device) if device is not None else (
            first.device if first is not None and not first.is_meta else torch.device("cpu"))
        spec = GroupSpec(group, collective, record_collectives, CudaStreams.for_device(self.device, overlap), links)
        self.world = Collectives(spec.group, spec.collective, record=spec.record, observers=self.observers,
                                 streams=spec.streams, links=spec.links)
        if len(shares) != self.world.world_size:
            raise ValueError(
                f"{len(shares)} state shares for a world of {self.world.world_size} ranks: give one share per rank"
            )
        self.shard_groups = check_shard_groups(
            shard_groups if shard_groups is not None else [range(self.world.world_size)], self.world.world_size)
        self.group_index = next(g for g, ranks in enumerate(self.shard_groups) if self.world.rank in ranks)
        self.group_spec = spec  # how the shard groups' collectives are made (again, when a plan switch regroups)
        self.comm, replica = group_collectives(self.world, self.shard_groups, spec)
        self.unit_groups = unit_groups(module, units)
        check_units_disjoint(self.unit_groups)
        slot_groups = group_slots(module, self.unit_groups)
        spans = [unit_spans(slots) for slots in slot_groups]
        self.layouts: tuple[ShardLayout, ...] = group_layouts(
            [sum(s.numel for s in unit) for unit in spans], list(shares), self.shard_groups,
            unit_names(module, self.unit_groups), spans)
        self.layout: ShardLayout = self.layouts[self.group_index]  # this rank's group's
        # each unit's trainable part; frozen_in_master: every parameter (how frozen ones were held
        # before the split; only benchmarks/bench_frozen_base.py's comparison asks for it)
        self._trainable = [[frozen_in_master or slot.current.requires_grad for slot in slots] for slots in slot_groups]
        self.across: ReplicaSum | None = None  # see sum_across
        self.replicas = ReplicaReducer(self.trainable_layouts(), self.shard_groups, self.world, replica)
        self.reduce_dtype = reduce_dtype
        self.bucket_bytes = bucket_bytes or (FIRST_BUCKET_BYTES, BUCKET_BYTES)
        materializer = materializer or UnitMaterializer(self.device)
        buffers = buffers_by_unit(module, self.unit_groups)
        self.units: list[FlatUnit] = []
        for index, (unit, slots) in enumerate(zip(self.layout.units, slot_groups)):
            originals = [slot.current for slot in slots]
            dtype = originals[0].dtype if originals else torch.float32
            master_dtype = master_dtype_for(dtype)
            shard = materializer.master(index, unit, slots, self.comm.rank, master_dtype, buffers[index])
            self.units.append(FlatUnit(unit, slots, self.comm.rank, shard, [p.requires_grad for p in originals],
                                       compute_dtype or dtype, self.observers, base, self._trainable[index],
                                       frozen_dtype or compute_dtype or dtype))
        self.materialized_units = materializer.materialized_units
        self._plan_buckets()
        self.root = self.units[0]
        self.prefetch = prefetch
        self.driver = Driver.HOOKS
        self._sync = True
        self._unit_index = {id(unit): index for index, unit in enumerate(self.units)}
        self._hooks = UniformHooks(self) if hooks else None

    # ------------------------------------------------------------------ introspection

    @property
    def rank(self) -> int:
        """This rank's place in the world (``group``); its place in its shard group is ``comm.rank``."""
        return self.world.rank

    @property
    def world_size(self) -> int:
        """Every rank of every replica; the shard group's size is ``comm.world_size``."""
        return self.world.world_size

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """The process group spanning every replica: what agreements between all ranks use."""
        return self.world.group

    @property
    def replicated_grads(self) -> bool:
        """Groups of one rank (data parallelism): after a synchronised backward every rank holds the
        whole reduced gradient, the same bits (one all-reduce per bucket, :mod:`.replicas`), so a
        check of it gives every rank the same answer without any exchange."""
        return self.replicas.replicated_in_world

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's local pieces (what the optimizer should own)."""
        for unit in self.units:
            yield from unit.local_params

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for unit in self.units:
            for span, param in zip(unit.spans, unit.local_params):
                yield span.name, param

    def trainable_layouts(self) -> tuple[ShardLayout, ...]:
        """Every group's layout of the units' trainable parts: what gradients are reduced over
        ([Note: a frozen part holds no gradient])."""
        return tuple(ShardLayout(layout.shares, tuple(u.part(mask) for u, mask in zip(layout.units, self._trainable)))
                     for layout in self.layouts)

    def local_state_numel(self) -> int:
        return sum(u.layout.shard_sizes[u.rank] for u in self.units)

    def local_state_bytes(self) -> tuple[int, int]:
        """(trainable master bytes, frozen storage bytes) this rank stores, over every unit."""
        parts = [u.local_bytes() for u in self.units]
        return sum(t for t, _ in parts), sum(f for _, f in parts)

    def summary(self) -> ShardSummary:
        """What this rank holds under the current layout (:class:`ShardSummary`)."""
        return ShardSummary(len(self.units), self.materialized_units, self.local_state_numel(),
                            self.in_flight_gather_bytes(), self.padded_reduction_bytes())

    # ------------------------------------------------------------------ gathering

    def gather(self, index: int, prefetch: int | None = None) -> FlatUnit:
        """Unit ``index`` gathered (waiting for its prefetch, if one is in flight); with prefetching
        on, unit ``prefetch`` (the next to compute: ``index + 1`` forward, ``index - 1`` backward)
        starts gathering meanwhile, when it is a layer unit (the root is never prefetched)."""
        unit = self.units[index]
        unit.gather(self.comm)
        if self.prefetch and prefetch is not None and 1 <= prefetch < len(self.units):
            self.units[prefetch].start_gather(self.comm)
        return unit

    def in_flight_gather_bytes(self) -> int:
        """The most a prefetched all-gather holds beside its unit's own buffer while the layer before
        it computes, which no profile counts: for a padded gather of an uneven unit its padded shard
        and W of them for staging; an exact or an even gather holds nothing
        ([Note: an exact all-gather holds no send buffer])."""
        if not self.prefetch or self.comm.mode != Collective.PADDED or self.comm.world_size < 2:
            return 0
        return max(((self.comm.world_size + 1) * u.layout.max_shard * u.compute_dtype.itemsize
                    for u in self.units[1:] if u.layout.numel and not u.layout.is_even), default=0)

    def padded_reduction_bytes(self) -> int:
        """The most a padded reduce-scatter of an uneven trainable unit holds that the memory model does
        not price (it prices the unit's flat gradient and the exact reduce-scatter's two shards): the
        padding of the gradient laid out in W padded rows, on gloo the W rows received, and the padded
        sum. An exact or an even reduce-scatter holds nothing more:
        [Note: a pairwise reduce-scatter holds two shards]."""
        if self.comm.mode != Collective.PADDED or self.comm.world_size < 2:
            return 0
        world = self.comm.world_size
        received = world if self.comm.on_gloo else 0
        return max((((world + received + 1) * u.trainable_layout.max_shard - u.trainable_layout.numel)
                    * (self.reduce_dtype or u.master_dtype).itemsize
                    for u in self.units if u.trainable and u.trainable_layout.numel and not u.trainable_layout.is_even),
                   default=0)

    def gather_root(self) -> None:
        self.root.gather(self.comm)

    def free_all(self) -> None:
        """Release every gathered buffer (after an evaluation forward, say)."""
        for unit in self.units:
            unit.free()

    # ------------------------------------------------------------------ modes

    @contextlib.contextmanager
    def _driven_by(self, driver: Driver) -> Iterator[None]:
        previous, self.driver = self.driver, driver
        try:
            yield
        finally:
            self.driver = previous

    def scheduled(self) -> contextlib.AbstractContextManager[None]:
        """For schedules that gather, free and reduce the units themselves: the hooks stand aside."""
        return self._driven_by(Driver.SCHEDULED)

    # ------------------------------------------------------------------ gradients

    def set_requires_gradient_sync(self, sync: bool) -> None:
        """False while accumulating micro-batches: full gradients stay local, nothing is reduced."""
        self._sync = sync

    def reduce_in_order(self, every: bool) -> None:
        """Reduce READY units strictly from the last to the first (same order on every rank).

        With ``every`` each trainable unit not yet REDUCED is reduced whether or not autograd reached
        it (a unit no gradient flowed into contributes zeros).
        """
        for unit in reversed(self.units):
            if unit.grad_state is GradState.REDUCED or not unit.trainable:
                continue
            if not every and unit.grad_state is not GradState.READY:
                return
            if self._sync:
                self.reduce_unit(unit)
            unit.grad_state = GradState.REDUCED

    def reduce_unit(self, unit: FlatUnit) -> None:
        """Reduce-scatter one unit's full gradient onto the owners and accumulate it there.

        Units without trainable parameters are skipped (on every rank alike). On CUDA the
        reduction overlaps the compute stream; :meth:`wait_reductions` joins it. With groups of one
        rank there is nothing to scatter: the gradient joins its bucket's all-reduce
        (:mod:`.replicas`, [Note: gradient buckets]).
        """
        if not unit.trainable:
            return
        index = self._unit_index[id(unit)]
        if self.replicas.bucketed(index):  # a group of one rank: the whole gradient goes into its bucket
            self.replicas.reduce_bucketed(index, unit.trainable_layout.numel, unit.device,
                                          fill=partial(unit.take_full_grad, self.reduce_dtype),
                                          consume=unit.add_local_grad)
            return
        layout = unit.trainable_layout  # [Note: a frozen part holds no gradient]
        full_grad = unit.take_full_grad(self.reduce_dtype, padded=self.comm.pads_reduction(layout))
        summed = partial(self.replicas.reduce, index, layout, consume=unit.add_local_grad)
        self.comm.reduce_scatter_into(full_grad, layout, summed)

    def _plan_buckets(self) -> None:
        """Data parallelism's gradient buckets over the trainable units (see :mod:`.replicas`)."""
        self.replicas.plan_buckets([u.trainable_layout.numel if u.trainable else None for u in self.units],
                                   [self.reduce_dtype or u.master_dtype for u in self.units],
                                   [u.name for u in self.units], *self.bucket_bytes)

    def sum_across(self, across: ReplicaSum | None) -> None:
        """Sum every reduced gradient also over ``across``: rank i of other jobs that each hold one
        replica cut alike (fault tolerance's replica groups; see [Note: a sum across jobs] in
        :mod:`.replicas`), during the backward as the replica group's sum runs; None: stop. The world
        must be one shard group."""
        self.replicas = ReplicaReducer(self.trainable_layouts(), self.shard_groups, self.world,
                                       self.replicas.world_replica, across)
        self.across = across
        self._plan_buckets()

    def wait_reductions(self) -> None:
        """The gradients of every reduced unit are ready for the optimizer: the cross-group
        all-reduces in flight are done (on CUDA, the reduce-scatter stream is joined)."""
        self.replicas.wait()
        self.comm.wait_reductions([p.grad for p in self.parameters() if p.grad is not None])

    def finish_backward(self) -> None:
        """End of one micro-batch's backward: reduce what is left, in order; free the layer units
        (and the root, when the gradients were synchronised)."""
        unfinished = [u for u in self.units if u.grad_state is GradState.COMPUTING and u.gathered]
        self.reduce_in_order(every=True)
        for _ in unfinished:  # a unit autograd never finished (a gradient did not reach every parameter)
            self.observers.compute_end("unit_backward")
        for unit in self.units:
            unit.grad_state, unit.grads_accumulated = GradState.IDLE, 0
        for unit in self.units[1:]:
            if unit.state is not UnitState.SHARDED:
                unit.free()
        if self._sync:
            self.root.free()
            self.wait_reductions()

    def backward(self, loss: torch.Tensor) -> None:
        hooks = self._hooks
        if hooks is not None:
            hooks.root_backward(True)
        try:
            loss.backward()
        finally:
            if hooks is not None:
                hooks.root_backward(False)
        self.finish_backward()

    @torch.no_grad()
    def grads_finite(self) -> bool:
        """Whether every element of this rank's gradient pieces is finite.

        One sum per run of pieces lying end to end in memory (:func:`adjacent_runs`: under groups of
        one rank, a bucket's reduced gradient), in fp32 or wider, and one host sync: a finite sum
        means every element is finite (an inf or nan makes the sum inf or nan). A sum of finite
        values may overflow to inf, so only the pieces of runs whose sum is not finite are checked
        element by element, and those decide.
        """
        grads = [p.grad for p in self.parameters() if p.grad is not None and p.grad.numel()]
        if not grads:
            return True
        runs = adjacent_runs(grads)
        sums = torch.stack([flat.sum(dtype=torch.promote_types(flat.dtype, torch.float32)).double() for flat, _ in runs])
        finite = torch.isfinite(sums)
        if bool(finite.all()):
            return True
        return all(bool(torch.isfinite(g).all()) for (_, pieces), ok in zip(runs, finite.tolist()) if not ok
                   for g in pieces)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of the WHOLE model's gradient, summed across the uneven shards (group 0's
        shards, summed over the world, so every replica scales by the same bits)."""
        return clip_grad_norm_(self.parameters(), max_norm, norm_type, self.world, contributes=self.group_index == 0)

    # ------------------------------------------------------------------ full parameters

    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Every unit gathered, the modules holding full parameters, the hooks off (e.g. for a
        plain forward of the whole model); gradients computed inside are dropped."""
        for unit in self.units:
            unit.gather(self.comm)
        try:
            with self._driven_by(Driver.SUMMONED):
                yield
        finally:
            for unit in self.units:
                for param in unit.full_params:
                    param.grad = None
            self.free_all()

    @contextlib.contextmanager
    def unit_gathered(self, index: int) -> Iterator[FlatUnit]:
        """One unit (and the root) gathered, hooks off: e.g. to profile that layer alone."""
        was_root = self.root.gathered
        with self._driven_by(Driver.SUMMONED):
            self.gather_root()
            unit = self.gather(index)
            try:
                yield unit
            finally:
                for param in unit.full_params:
                    param.grad = None
                if index != 0:
                    unit.free()
                if not was_root:
                    self.root.free()

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters in the master dtype, original names and shapes, on every rank."""
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            full = torch.empty(unit.layout.numel, dtype=unit.master.dtype, device=unit.device)
            self.comm.all_gather(unit.shard_values(), full, unit.layout).wait()
            for span in unit.spans:
                out[span.name] = full[span.offset : span.offset + span.numel].view(span.shape).clone()
        return out

    # ------------------------------------------------------------------ after a fit

    @torch.no_grad()
    def hand_back(self, gather: Handback = Handback.ALL) -> None:
        """The end of a fit (collective unless ``NONE``): the modules hold whole copies of the trained
        parameters on every rank or on global rank 0, or keep the pieces and refuse to be used
        (see :mod:`.handback`)."""
        if self.driver in (Driver.HANDED_BACK, Driver.PARKED):
            return
        self.free_all()
        whole = gather is Handback.ALL
        if whole:
            handback.put_whole(self.units, self.comm, self.device)
        elif gather is Handback.RANK0 and self.group_index == 0:  # its first rank is rank 0 (groups list ranks ascending)
            whole = handback.put_whole_on_first(self.units, self.comm, self.device)  # the other groups: replicas
        self.handed_back = gather
        if whole:
            self.driver = Driver.HANDED_BACK
        else:
            why = handback.WHY_RANK0 if gather is Handback.RANK0 else handback.WHY_NONE
            self.refusals = handback.refuse_use(self.units, self.module, why)
            self.driver = Driver.PARKED

    @torch.no_grad()
    def take_back(self) -> None:
        """Before the next fit or evaluation of the same module: the whole parameters into the shards
        (edits included) where every rank got them; rank 0's copy alone is dropped, its edits could
        reach only its own shards."""
        if self.driver is Driver.HANDED_BACK and self.handed_back is Handback.ALL:
            handback.copy_into_shards(self.units)
        elif self.driver is Driver.HANDED_BACK:
            for unit in self.units:
                unit.use_local()
        for handle in self.refusals:
            handle.remove()
        self.refusals = []
        if self.driver in (Driver.HANDED_BACK, Driver.PARKED):
            self.driver = Driver.HOOKS

    def reshard(self, shares: Sequence[float], optimizers: Sequence[torch.optim.Optimizer] = (),
                shard_groups: Sequence[Sequence[int]] | None = None) -> ShardLayout:
        """Collective: move every rank's state (master shards, optimizer state) onto the layout of
        new ``shares`` (and ``shard_groups``; None keeps the groups), in place, by the overlap of
        old and new ranges (:mod:`.reshard`)."""
        return reshard(self, shares, optimizers, shard_groups)

    def adopt_layouts(self, shard_groups: tuple[tuple[int, ...], ...], layouts: tuple[ShardLayout, ...]) -> None:
        """After the state moved (:mod:`.reshard`): the new groups' layouts, collectives and reducer
        (collective when the grouping changes: the new process groups are created by every rank)."""
        regrouped = shard_groups != self.shard_groups
        self.shard_groups, self.layouts = shard_groups, layouts
        self.group_index = next(g for g, ranks in enumerate(shard_groups) if self.world.rank in ranks)
        self.layout = layouts[self.group_index]
        replica = self.replicas.world_replica
        if regrouped:
            self.comm, replica = group_collectives(self.world, shard_groups, self.group_spec)
        self.replicas = ReplicaReducer(self.trainable_layouts(), shard_groups, self.world, replica, self.across)
        self._plan_buckets()


def adjacent_runs(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """``tensors`` grouped into runs that lie end to end in one storage, each with one flat view
    over the run (a tensor on its own where it is alone or not contiguous), so a pass over the
    runs reads every element once with one operation per run, not per tensor."""
    def place(t: torch.Tensor) -> tuple[int, int]:
        return t.untyped_storage().data_ptr(), t.storage_offset()

    groups: list[list[torch.Tensor]] = []
    key: tuple[int, torch.dtype] | None = None
    end = -1
    for t in sorted(tensors, key=place):
        here = (t.untyped_storage().data_ptr(), t.dtype) if t.is_contiguous() else None
        if here is not None and here == key and t.storage_offset() == end:
            groups[-1].append(t)
        else:
            groups.append([t])
        key, end = here, t.storage_offset() + t.numel()
    return [(g[0] if len(g) == 1 else g[0].as_strided((sum(t.numel() for t in g),), (1,), g[0].storage_offset()), g)
            for g in groups]
