"""One unit of the model: its parameters as one flat buffer, sharded unevenly across ranks.

Outside compute, the unit's modules hold this rank's *local pieces*: one ``nn.Parameter`` per
original parameter, a view into the rank's master shard (fp32, fp64 for an fp64 model; possibly
empty) for a trainable parameter, a piece of the unit's frozen storage for a frozen one. That is
what an optimizer built from ``model.parameters()`` sees, so optimizer state follows the plan's
share. A piece keeps its parameter's number of dimensions (a ``[1, ..., 1, k]``
view of its ``k`` elements), so optimizer groups chosen by ``p.dim()`` / ``p.ndim`` are the groups
of the unsharded model; :func:`full_shape` gives the original shape.

[Note: a unit's two parts] A unit's parameters are two parts, each packed in the unit's order
(:meth:`~.layout.UnitLayout.part`): the trainable ones, whose shard is the master (fp32) that the
optimizer steps and the only elements a gradient is reduced for, and the frozen ones, held by a
:class:`~.frozen_storage.FrozenStorage` in the compute dtype (or another storage kind). The part
layouts cut each rank's range of the unit where the unit's layout does, so the state share stays
the plan's. Where the unit computes in a dtype other than the master's, a frozen part held in the
compute dtype is gathered with the trainable one, in the unit's order, by one all-gather of the unit
(each rank sends its range's values in the compute dtype: the copy the cast makes anyway); otherwise
(fp32 training, or another storage kind) each part is gathered by its own all-gather, straight from
its storage, and the gathered buffer is ``[trainable part | frozen part]``.

For compute, :meth:`FlatUnit.gather` fills a full flat buffer (in the compute dtype) and the
modules are switched to *full parameters*: ordinary ``nn.Parameter`` views of that buffer, so user
code sees normal tensors. :meth:`FlatUnit.free` releases the buffer's storage; the views (and any
tensors autograd saved of them in the forward) are valid again once the storage is filled again,
so a backward pass re-gathers the unit and uses what autograd saved, without re-running the forward.
Where the parameters are is the unit's :class:`UnitState`; where its gradient is in a backward pass
(hooks mode) is its :class:`GradState` (see [Note: unit state] in :mod:`.sharded_model`).

A parameter may be held by several modules (tied weights: an embedding and the head): every
holder gets the same local piece and the same full parameter, so both uses see one tensor and its
gradient sums both uses once.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from cephalo_lightning._common.vocabulary import BaseStorage
from cephalo_lightning.runtime.collectives import Collectives, PendingGather
from cephalo_lightning.runtime.observers import Observers
from cephalo_lightning.runtime.quantized import nf4_storage  # noqa: F401 - registers BaseStorage.NF4
from cephalo_lightning.runtime.sharding.frozen_storage import ComputeDtypeStorage, FrozenStorage, make_storage
from cephalo_lightning.runtime.sharding.layout import ParamSpan, UnitLayout


class UnitState(enum.Enum):
    """Where a unit's parameters are."""

    SHARDED = enum.auto()  # the modules hold the local pieces; the full buffer has no storage
    GATHERING = enum.auto()  # an all-gather into the full buffer is in flight (a prefetch)
    GATHERED = enum.auto()  # the modules hold the full parameters


class GradState(enum.Enum):
    """Where a unit's gradient is in one backward pass (driven by the hooks; see [Note: unit state])."""

    IDLE = enum.auto()  # the backward pass has not reached the unit
    COMPUTING = enum.auto()  # gathered again for its backward; the ``unit_backward`` region is open
    READY = enum.auto()  # every trainable gradient accumulated: it waits for its turn in the reduce order
    REDUCED = enum.auto()  # its turn came: reduce-scattered (or, while accumulating, kept unsharded)


@dataclass(frozen=True)
class ParamSlot:
    """A parameter under its canonical ``name``, registered as ``module.<attr>`` by every holder."""

    name: str
    holders: tuple[tuple[nn.Module, str], ...]

    @property
    def current(self) -> nn.Parameter:
        module, attr = self.holders[0]
        return module._parameters[attr]

    def set(self, param: nn.Parameter) -> None:
        for module, attr in self.holders:
            set_module_param(module, attr, param)


def set_module_param(module: nn.Module, attr: str, param: nn.Parameter) -> None:
    # The registered Parameter object is swapped in the module's ``_parameters`` (as FSDP does)
    # rather than assigned through nn.Module.__setattr__: the swap happens for every parameter at
    # every gather and free, and ``register_parameter`` would run the global parameter-registration
    # hooks each time, which may replace the object (the full parameters and local pieces must
    # stay the very tensors the hooks and optimizers hold).
    module._parameters[attr] = param


def piece_shape(shape: Sequence[int], numel: int) -> tuple[int, ...]:
    """The shape of a ``numel``-element piece of a parameter of ``shape``: same number of dims."""
    return (1,) * (len(shape) - 1) + (numel,) if len(shape) > 1 else (numel,)


def master_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a unit's master weights and reduced gradients for parameters of ``dtype``: fp32,
    fp64 for an fp64 model."""
    return torch.promote_types(dtype, torch.float32)


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The original shape of a local piece (or of any ordinary tensor: its own shape)."""
    return tuple(getattr(param, "_cephalo_full_shape", param.shape))


class FlatUnit:
    """The parameters of one unit, sharded by ``layout`` onto ``rank``.

    ``shard`` is this rank's range of the unit's flat parameters in the master dtype (fp32, or fp64
    for fp64 models), as built; the unit keeps its trainable elements as :attr:`master` (the truth
    the optimizer steps) and hands its frozen ones to :attr:`frozen`, a storage of kind ``base``
    ([Note: a unit's two parts]). The modules are switched to the local pieces at construction.
    ``trained_part`` (default ``requires_grad``): the parameters kept in the trainable part; every
    parameter there reproduces how frozen parameters were held before the split (in the master,
    their zero gradients reduced), which only a benchmark's before-and-after comparison asks for.
    ``frozen_dtype`` (default ``compute_dtype``): the dtype the frozen part is stored, gathered and
    computed in where it differs from the compute dtype (autocast's ``bf16-mixed`` / ``16-mixed``:
    trainable parameters gathered in fp32, frozen ones in bf16 / fp16; [Note: a mixed-dtype buffer]).
    """

    def __init__(
        self,
        layout: UnitLayout,
        slots: list[ParamSlot],
        rank: int,
        shard: torch.Tensor,
        requires_grad: Sequence[bool],
        compute_dtype: torch.dtype,
        observers: Observers | None = None,
        base: BaseStorage = BaseStorage.COMPUTE,
        trained_part: Sequence[bool] | None = None,
        frozen_dtype: torch.dtype | None = None,
    ) -> None:
        if [s.name for s in slots] != [p.name for p in layout.params]:
            raise ValueError(f"unit {layout.name}: slots and layout disagree")
        lo, hi = layout.shard_range(rank)
        if shard.numel() != hi - lo:
            raise ValueError(f"unit {layout.name}: a master shard of {shard.numel()} elements for a range of {hi - lo}")
        self.slots = slots
        self.rank = rank
        self.device = shard.device
        self.compute_dtype = compute_dtype
        self.frozen_dtype = frozen_dtype or compute_dtype
        self.master_dtype = shard.dtype
        self.base = BaseStorage(base)
        self.requires_grad = [bool(r) for r in requires_grad]
        self.trained_part = list(self.requires_grad if trained_part is None else [bool(t) for t in trained_part])
        if any(r and not t for r, t in zip(self.requires_grad, self.trained_part)):
            raise ValueError(f"unit {layout.name}: a trainable parameter must be in the trainable part")
        self.trainable = any(self.requires_grad)
        self.num_trainable = sum(self.requires_grad)
        self.observers = observers if observers is not None else Observers()
        self.full_params = [
            nn.Parameter(torch.empty(s.shape, dtype=compute_dtype if t else self.frozen_dtype, device=self.device),
                         requires_grad=rg)
            for s, rg, t in zip(layout.params, self.requires_grad, self.trained_part)
        ]
        self.resident: bool | None = None  # set by _bind_full
        self.state = UnitState.SHARDED
        self._pending: list[PendingGather] = []  # the all-gathers in flight while GATHERING
        self.grad_state = GradState.IDLE
        self.grads_accumulated = 0  # trainable full parameters whose gradient autograd accumulated (COMPUTING)
        self._install(layout, shard)

    def _install(self, layout: UnitLayout, shard: torch.Tensor) -> None:
        self.layout = layout
        self.trainable_layout = layout.part(self.trained_part)
        frozen_layout = layout.part([not t for t in self.trained_part])
        lo, _ = layout.shard_range(self.rank)
        trainable_runs, frozen_runs = [], []
        for span, in_master in zip(layout.params, self.trained_part):
            a, b = layout.param_piece(span, self.rank)
            (trainable_runs if in_master else frozen_runs).append((span.offset + a - lo, b - a))
        # A rank alone in its group computing in the master dtype holds the unit whole: the full
        # parameters are views of its storage itself (*resident*, see _bind_full).
        resident = (layout.world_size == 1 and self.compute_dtype == shard.dtype == self.frozen_dtype
                    and self.base is BaseStorage.COMPUTE)
        if not frozen_runs:
            storage = shard
        else:
            storage = torch.cat([shard[a : a + n] for a, n in trainable_runs + frozen_runs]) if resident else None
        trained = sum(n for _, n in trainable_runs)
        if storage is not None:
            self.master = storage[:trained]
        else:
            self.master = torch.cat([shard[a : a + n] for a, n in trainable_runs]) if trainable_runs else shard[:0]
        self.frozen: FrozenStorage | None = None
        if frozen_runs:
            if storage is not None:  # resident: the frozen values follow the master in one storage
                self.frozen = ComputeDtypeStorage(frozen_layout, self.rank, self.compute_dtype, storage[trained:])
            else:
                values = torch.cat([shard[a : a + n] for a, n in frozen_runs])
                self.frozen = make_storage(self.base, frozen_layout, self.rank, values, self.frozen_dtype)
        self._storage = storage  # the resident unit's one storage, [master | frozen values]
        frozen_pieces = iter(self.frozen.pieces() if self.frozen is not None else ())
        self.local_params: list[nn.Parameter] = []
        self._piece_runs: list[tuple[int, int] | None] = []  # a trainable piece's (start, numel) in the master
        t_lo, _ = self.trainable_layout.shard_range(self.rank)
        t_spans = iter(self.trainable_layout.params)
        for span, requires_grad, in_master in zip(layout.params, self.requires_grad, self.trained_part):
            a, b = layout.param_piece(span, self.rank)
            if in_master:
                packed = next(t_spans)
                start = packed.offset + a - t_lo
                self._piece_runs.append((start, b - a))
                data = self.master[start : start + b - a]
            else:
                self._piece_runs.append(None)
                data = next(frozen_pieces)
            piece = nn.Parameter(data.view(piece_shape(span.shape, b - a)), requires_grad=requires_grad)
            piece._cephalo_full_shape = span.shape
            self.local_params.append(piece)
        self._bind_full()
        self.use_local()

    def local_bytes(self) -> tuple[int, int]:
        """(trainable master bytes, frozen storage bytes) this rank holds for the unit."""
        return (self.master.numel() * self.master.element_size(),
                self.frozen.local_bytes() if self.frozen is not None else 0)

    def local_values(self) -> list[torch.Tensor]:
        """Every local piece as values: the piece itself, or for a piece that holds no data (a
        quantised frozen matrix: on the meta device) its values from the frozen storage."""
        if self.frozen is None or not any(p.is_meta for p in self.local_params):
            return list(self.local_params)
        frozen = iter(self.frozen.piece_values())
        out = []
        for param, requires_grad in zip(self.local_params, self.requires_grad):
            value = param if requires_grad else next(frozen)
            out.append(value.view(param.shape) if param.is_meta else param)
        return out

    def restore_frozen(self, values: Sequence[torch.Tensor]) -> None:
        """Store the frozen part again from this rank's piece of every frozen parameter (``values``,
        in the part's order: what :meth:`local_values` gave, refilled by a checkpoint load or a hand-back)."""
        if self.frozen is None:
            return
        packed = torch.cat([v.detach().reshape(-1) for v in values]) if values else torch.empty(0)
        self.frozen = make_storage(self.base, self.frozen.layout, self.rank, packed, self.frozen_dtype)
        pieces = iter(self.frozen.pieces())
        for param, requires_grad in zip(self.local_params, self.requires_grad):
            if not requires_grad:
                param.data = next(pieces).view(param.shape)

    def shard_values(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """This rank's range of the unit in the unit's order, as values in ``dtype`` (default the
        master's): the master's elements and the frozen storage's values, put back in place. A
        unit with one part returns its master (or its frozen values) without copying when the dtype matches."""
        dtype = dtype or self.master_dtype
        if self.frozen is None:
            return self.master.to(dtype)
        frozen = self.frozen.values(dtype)
        if not any(self.trained_part):
            return frozen
        out = torch.empty(self.master.numel() + frozen.numel(), dtype=dtype, device=self.device)
        t = f = 0
        lo, _ = self.layout.shard_range(self.rank)
        for span, in_master in zip(self.spans, self.trained_part):
            a, b = self.layout.param_piece(span, self.rank)
            at = span.offset + a - lo
            if in_master:
                out[at : at + b - a].copy_(self.master[t : t + b - a])
                t += b - a
            else:
                out[at : at + b - a].copy_(frozen[f : f + b - a])
                f += b - a
        return out

    def _bind_full(self) -> None:
        """Point the full parameters at their buffer. A rank alone in its shard group that computes in
        the master dtype holds the unit whole: the full parameters are views of its storage itself
        (*resident*, ``[trainable part | frozen part]``), and gathering is only the modules switching
        to them (no copy, no collective: data parallelism's forward). Otherwise the buffer is
        allocated while gathered: in the unit's order where the frozen part holds its values in the
        compute dtype and that differs from the master's (one all-gather of the unit, see
        :meth:`start_gather`), else ``[trainable part | frozen part]`` (one all-gather per part)."""
        resident = self.layout.world_size == 1 and self.compute_dtype == self.master.dtype and (
            self.frozen is None or self._storage is not None)
        if resident is self.resident and not resident:
            return  # keeps its (empty) buffer
        self.resident = resident
        trained = self.trainable_layout.numel
        mixed = self.frozen is not None and self.frozen_dtype != self.compute_dtype
        if resident:
            self.full = self._storage if self._storage is not None else self.master
        elif mixed:  # [Note: a mixed-dtype buffer]
            nbytes = trained * self.compute_dtype.itemsize + self.frozen.layout.numel * self.frozen_dtype.itemsize
            self.full = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        else:
            self.full = torch.empty(self.layout.numel, dtype=self.compute_dtype, device=self.device)
        # one all-gather of the unit where its send buffer is a copy anyway (a cast to the compute dtype):
        # the frozen values join the trainable ones in it; computing in the master dtype, the parts are
        # sent as they are stored, apart, and no send buffer is made
        # ([Note: an exact all-gather holds no send buffer])
        self.unit_order = not resident and not mixed and (self.frozen is None or (
            isinstance(self.frozen, ComputeDtypeStorage) and self.compute_dtype != self.master_dtype))
        parts = self._parts(self.full, trained, mixed)
        t_spans = iter(self.trainable_layout.params)
        f_spans = iter(self.frozen.layout.params if self.frozen is not None else ())
        for unit_span, in_master, param in zip(self.layout.params, self.trained_part, self.full_params):
            span = next(t_spans) if in_master else next(f_spans)
            if self.unit_order:
                param.data = self.full[unit_span.offset : unit_span.offset + span.numel].view(span.shape)
            else:
                param.data = parts[0 if in_master else 1][span.offset : span.offset + span.numel].view(span.shape)
        # Collectives write through these aliases: they share the storage but not the version counter,
        # so refilling the buffer for the backward pass does not trip autograd's in-place checks
        # on tensors it saved in the forward (they are views of the same storage).
        self._full_raw = self.full.data
        self._raw_parts = self._parts(self._full_raw, trained, mixed)
        if not resident:
            self._resize(0)

    def _parts(self, full: torch.Tensor, trained: int, mixed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The gathered buffer's trainable and frozen parts (packed order), each in its own dtype.

        [Note: a mixed-dtype buffer] Under autocast (``bf16-mixed`` / ``16-mixed``) the trainable part
        is gathered in the compute dtype (fp32) and the frozen part in the frozen dtype (bf16 / fp16):
        one byte buffer holds both, ``[trainable x compute size | frozen x frozen size]``, so one
        allocation and one free serve the unit as before; the frozen part starts at a multiple of its
        element size (the compute dtype's size is one of it)."""
        if not mixed:
            return full[:trained], full[trained:]
        at = trained * self.compute_dtype.itemsize
        if at % self.frozen_dtype.itemsize:
            raise ValueError(f"unit {self.name}: a {self.frozen_dtype} frozen part cannot follow {trained} "
                             f"{self.compute_dtype} elements")
        return full[:at].view(self.compute_dtype), full[at:].view(self.frozen_dtype)

    def relayout(self, layout: UnitLayout, shard: torch.Tensor, rank: int | None = None) -> list[nn.Parameter]:
        """Adopt a new layout of the same unit with this rank's new range ``shard`` (its values in the
        master dtype, :meth:`shard_values` of the new range) and its new place ``rank`` in the unit's
        group, if it moved; returns the old local pieces (new ones replace them; the full parameters
        and their hooks stay)."""
        if [s.name for s in layout.params] != [s.name for s in self.layout.params] or layout.numel != self.layout.numel:
            raise ValueError(f"unit {layout.name}: a new layout must describe the same parameters")
        if self.state is not UnitState.SHARDED:
            raise RuntimeError(f"unit {layout.name}: cannot change the layout while it is gathered")
        if rank is not None:
            self.rank = rank
        old = self.local_params
        self._install(layout, shard)
        return old

    # ------------------------------------------------------------------ parameters

    @property
    def spans(self) -> tuple[ParamSpan, ...]:
        return self.layout.params

    @property
    def name(self) -> str:
        return self.layout.name

    def use_local(self) -> None:
        """Modules hold the local pieces (what optimizers and state dicts see)."""
        for slot, param in zip(self.slots, self.local_params):
            slot.set(param)

    def use_full(self) -> None:
        """Modules hold full parameters (views of the gathered buffer) for compute."""
        for slot, param in zip(self.slots, self.full_params):
            slot.set(param)

    def local_range(self, index: int) -> tuple[int, int]:
        """The [start, stop) of parameter ``index`` this rank owns, within the flattened parameter."""
        return self.layout.param_piece(self.spans[index], self.rank)

    # ------------------------------------------------------------------ gather / free

    def _resize(self, nbytes: int) -> None:
        storage = self.full.untyped_storage()
        if storage.size() != nbytes:
            self.observers.storage_resized(storage.size(), nbytes)
            storage.resize_(nbytes)

    @property
    def gathered(self) -> bool:
        return self.state is UnitState.GATHERED

    def start_gather(self, comm: Collectives) -> None:
        """SHARDED -> GATHERING: begin filling the full buffer; overlaps with compute where the backend
        allows. A unit already gathering or gathered stays as it is. In the unit's order (see
        :meth:`_bind_full`) the rank's range is sent in one all-gather, its values in the compute
        dtype (a second collective per unit would cost a link's latency each time); otherwise the
        trainable part is gathered from the master and the frozen storage gathers its own part."""
        if self.state is not UnitState.SHARDED or self.resident:
            return
        self._resize(self.full.numel() * self.full.element_size())
        if self.unit_order:
            if self.frozen is None:
                source = self.master
            elif not any(self.trained_part):
                source = self.frozen.values(self.compute_dtype)  # the storage itself: no copy
            else:
                source = self.shard_values(self.compute_dtype)
            self._pending.append(comm.all_gather(source, self._full_raw, self.layout, async_op=True,
                                                 dtype=self.compute_dtype))
            self.state = UnitState.GATHERING
            return
        trainable, frozen = self._raw_parts
        if any(self.trained_part) or self.frozen is None:
            self._pending.append(comm.all_gather(self.master, trainable, self.trainable_layout,
                                                 async_op=True, dtype=self.compute_dtype))
        if self.frozen is not None:
            self._pending.append(self.frozen.start_gather(comm, frozen, async_op=True))
        self.state = UnitState.GATHERING

    def gather(self, comm: Collectives) -> None:
        """-> GATHERED: make the full parameters usable (waits for a prefetch already in flight)."""
        if self.state is UnitState.GATHERED:
            return
        self.start_gather(comm)
        self._finish_gather()
        self.state = UnitState.GATHERED
        self.use_full()

    def _finish_gather(self) -> None:
        pending, self._pending = self._pending, []
        for gather in pending:
            gather.wait()

    def free(self) -> None:
        """-> SHARDED: release the full buffer; modules go back to the local pieces."""
        # a prefetch nobody used is waited for first: the all-gather writes into this storage
        self._finish_gather()
        if not self.resident:
            self._resize(0)
        self.state = UnitState.SHARDED
        self.use_local()

    # ------------------------------------------------------------------ gradients

    def take_full_grad(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                       padded: bool = False) -> torch.Tensor:
        """The unit's full flat gradient of its trainable part (zeros where a parameter got none;
        frozen parameters have no place in it); clears the grads.

        ``dtype`` defaults to the master's: gradients are reduced in fp32 (fp64 for fp64 models).
        ``out`` (the trainable part's number of elements): written there instead of a new tensor (a bucket).
        ``padded``: laid out as the padded reduce-scatter takes it, each rank's range at the start of
        its own row of ``max_shard`` elements, so that the flat gradient is never held beside it.
        """
        if padded:
            return self._take_padded_grad(dtype or self.master_dtype)
        layout = self.trainable_layout
        if out is None:
            out = torch.empty(layout.numel, dtype=dtype or self.master_dtype, device=self.device)
        grads = [param.grad for param, t in zip(self.full_params, self.trained_part) if t]
        if grads and all(g is not None for g in grads):  # the usual case: one copy (and cast) of them all
            torch.cat([g.reshape(-1) for g in grads], out=out)
        else:
            for span, grad in zip(layout.params, grads):
                view = out.narrow(0, span.offset, span.numel)
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad.reshape(-1))
        for param in self.full_params:
            param.grad = None
        return out

    def _take_padded_grad(self, dtype: torch.dtype) -> torch.Tensor:
        layout = self.trainable_layout
        chunk = layout.max_shard
        out = torch.zeros(layout.world_size * chunk, dtype=dtype, device=self.device)
        for span, param in zip(layout.params, [p for p, t in zip(self.full_params, self.trained_part) if t]):
            if param.grad is None:
                continue
            grad = param.grad.reshape(-1)
            for rank in range(layout.world_size):
                start, stop = layout.param_piece(span, rank)
                if stop > start:
                    at = rank * chunk + span.offset + start - layout.bounds[rank]
                    out[at : at + stop - start].copy_(grad[start:stop])
        for param in self.full_params:
            param.grad = None
        return out

    def add_local_grad(self, shard_grad: torch.Tensor) -> None:
        """Accumulate a reduced shard gradient of the trainable part (this rank's range of it, the
        master's elements) into the local pieces' ``.grad``. ``shard_grad`` is the caller's to give
        (a fresh reduction result): a piece without a gradient takes a view of it, not a copy."""
        for run, param in zip(self._piece_runs, self.local_params):
            if run is None or not param.requires_grad:
                continue
            start, numel = run
            piece = shard_grad[start : start + numel].view(param.shape)
            if piece.dtype != param.dtype:
                piece = piece.to(param.dtype)
            if param.grad is None:
                param.grad = piece
            else:
                param.grad.add_(piece)
