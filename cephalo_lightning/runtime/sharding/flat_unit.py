"""One unit of the model: its parameters as one flat buffer, sharded unevenly across ranks.

Outside compute, the unit's modules hold this rank's *local pieces*: one ``nn.Parameter`` per
original parameter, a view into the rank's master shard (fp32, fp64 for an fp64 model; possibly
empty). That is what an optimizer built from ``model.parameters()`` sees, so optimizer state
follows the plan's share. A piece keeps its parameter's number of dimensions (a ``[1, ..., 1, k]``
view of its ``k`` elements), so optimizer groups chosen by ``p.dim()`` / ``p.ndim`` are the groups
of the unsharded model; :func:`full_shape` gives the original shape.

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

from cephalo_lightning.runtime.collectives import Collectives, PendingGather
from cephalo_lightning.runtime.observers import Observers
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

    ``master`` is this rank's shard of the unit's flat parameters in the master dtype (fp32, or
    fp64 for fp64 models): the truth the optimizer steps. The modules are switched to the local
    pieces at construction.
    """

    def __init__(
        self,
        layout: UnitLayout,
        slots: list[ParamSlot],
        rank: int,
        master: torch.Tensor,
        requires_grad: Sequence[bool],
        compute_dtype: torch.dtype,
        observers: Observers | None = None,
    ) -> None:
        if [s.name for s in slots] != [p.name for p in layout.params]:
            raise ValueError(f"unit {layout.name}: slots and layout disagree")
        lo, hi = layout.shard_range(rank)
        if master.numel() != hi - lo:
            raise ValueError(f"unit {layout.name}: a master shard of {master.numel()} elements for a range of {hi - lo}")
        self.slots = slots
        self.rank = rank
        self.device = master.device
        self.compute_dtype = compute_dtype
        self.master_dtype = master.dtype
        self.requires_grad = [bool(r) for r in requires_grad]
        self.trainable = any(self.requires_grad)
        self.num_trainable = sum(self.requires_grad)
        self.observers = observers if observers is not None else Observers()
        self.full_params = [
            nn.Parameter(torch.empty(s.shape, dtype=compute_dtype, device=self.device), requires_grad=rg)
            for s, rg in zip(layout.params, self.requires_grad)
        ]
        self.resident: bool | None = None  # set by _bind_full
        self.state = UnitState.SHARDED
        self._pending: PendingGather | None = None  # the all-gather in flight while GATHERING
        self.grad_state = GradState.IDLE
        self.grads_accumulated = 0  # trainable full parameters whose gradient autograd accumulated (COMPUTING)
        self._install(layout, master)

    def _install(self, layout: UnitLayout, master: torch.Tensor) -> None:
        self.layout = layout
        self.master = master
        lo, _ = layout.shard_range(self.rank)
        self.local_params: list[nn.Parameter] = []
        self._piece_runs: list[tuple[int, int]] = []  # each local piece's (start, numel) in the master shard
        for span, requires_grad in zip(layout.params, self.requires_grad):
            a, b = layout.param_piece(span, self.rank)
            start = span.offset + a - lo
            self._piece_runs.append((start, b - a))
            piece = nn.Parameter(master[start : start + b - a].view(piece_shape(span.shape, b - a)),
                                 requires_grad=requires_grad)
            piece._cephalo_full_shape = span.shape
            self.local_params.append(piece)
        self._bind_full()
        self.use_local()

    def _bind_full(self) -> None:
        """Point the full parameters at their buffer. A rank alone in its shard group that computes
        in the master dtype holds the unit whole: the full parameters are views of the master
        itself (*resident*), and gathering is only the modules switching to them (no copy, no
        collective: data parallelism's forward). Otherwise the buffer is allocated while gathered."""
        resident = self.layout.world_size == 1 and self.compute_dtype == self.master.dtype
        if resident is self.resident and not resident:
            return  # keeps its (empty) buffer
        self.resident = resident
        if resident:
            self.full = self.master
        else:
            self.full = torch.empty(self.layout.numel, dtype=self.compute_dtype, device=self.device)
        for span, param in zip(self.layout.params, self.full_params):
            param.data = self.full[span.offset : span.offset + span.numel].view(span.shape)
        # Collectives write through this alias: it shares the storage but not the version counter,
        # so refilling the buffer for the backward pass does not trip autograd's in-place checks
        # on tensors it saved in the forward (they are views of the same storage).
        self._full_raw = self.full.data
        if not resident:
            self._resize(0)

    def relayout(self, layout: UnitLayout, master: torch.Tensor, rank: int | None = None) -> list[nn.Parameter]:
        """Adopt a new layout of the same unit with this rank's new master shard (and its new place
        ``rank`` in the unit's group, if it moved); returns the old local pieces (new ones replace
        them; the full parameters and their hooks stay)."""
        if [s.name for s in layout.params] != [s.name for s in self.layout.params] or layout.numel != self.layout.numel:
            raise ValueError(f"unit {layout.name}: a new layout must describe the same parameters")
        if self.state is not UnitState.SHARDED:
            raise RuntimeError(f"unit {layout.name}: cannot change the layout while it is gathered")
        if rank is not None:
            self.rank = rank
        old = self.local_params
        self._install(layout, master)
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
        """SHARDED -> GATHERING: begin filling the full buffer; overlaps with compute where the
        backend allows. A unit already gathering or gathered stays as it is."""
        if self.state is not UnitState.SHARDED or self.resident:
            return
        self._resize(self.full.numel() * self.full.element_size())
        self._pending = comm.all_gather(self.master, self._full_raw, self.layout, async_op=True, dtype=self.compute_dtype)
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
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

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
        """The unit's full flat gradient (zeros where a parameter got none); clears the grads.

        ``dtype`` defaults to the master's: gradients are reduced in fp32 (fp64 for fp64 models).
        ``out`` (the unit's number of elements): written there instead of a new tensor (a bucket).
        ``padded``: laid out as the padded reduce-scatter takes it, each rank's range at the start of
        its own row of ``max_shard`` elements, so that the flat gradient is never held beside it.
        """
        if padded:
            return self._take_padded_grad(dtype or self.master_dtype)
        if out is None:
            out = torch.empty(self.layout.numel, dtype=dtype or self.master_dtype, device=self.device)
        grads = [param.grad for param in self.full_params]
        if grads and all(g is not None for g in grads):  # the usual case: one copy (and cast) of them all
            torch.cat([g.reshape(-1) for g in grads], out=out)
        else:
            for span, grad in zip(self.spans, grads):
                view = out.narrow(0, span.offset, span.numel)
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad.reshape(-1))
        for param in self.full_params:
            param.grad = None
        return out

    def _take_padded_grad(self, dtype: torch.dtype) -> torch.Tensor:
        layout, chunk = self.layout, self.layout.max_shard
        out = torch.zeros(layout.world_size * chunk, dtype=dtype, device=self.device)
        for span, param in zip(self.spans, self.full_params):
            if param.grad is None:
                continue
            grad = param.grad.reshape(-1)
            for rank in range(layout.world_size):
                start, stop = layout.param_piece(span, rank)
                if stop > start:
                    at = rank * chunk + span.offset + start - layout.bounds[rank]
                    out[at : at + stop - start].copy_(grad[start:stop])
            param.grad = None
        return out

    def add_local_grad(self, shard_grad: torch.Tensor) -> None:
        """Accumulate a reduced shard gradient into the local pieces' ``.grad``. ``shard_grad`` is
        the caller's to give (a fresh reduction result): a piece without a gradient takes a view of
        it, not a copy, unless the unit has frozen parameters: a view would keep the whole shard's
        gradient alive (frozen parameters' zeros included) until ``zero_grad``, so a frozen parameter
        would cost gradient memory after all; their trainable pieces are copied out instead."""
        copy = self.num_trainable < len(self.requires_grad)
        for (start, numel), param in zip(self._piece_runs, self.local_params):
            if not param.requires_grad:
                continue
            piece = shard_grad[start : start + numel].view(param.shape)
            if piece.dtype != param.dtype:
                piece = piece.to(param.dtype)
            elif copy and param.grad is None:
                piece = piece.clone()
            if param.grad is None:
                param.grad = piece
            else:
                param.grad.add_(piece)
