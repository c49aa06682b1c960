"""One unit of the model: its parameters as one flat buffer, sharded unevenly across ranks.

Outside compute, the unit's modules hold this rank's *local pieces*: one 1-D ``nn.Parameter`` per
original parameter, a view into the rank's fp32 master shard (possibly empty). That is what an
optimizer built from ``model.parameters()`` sees, so optimizer state follows the plan's share.

For compute, :meth:`FlatUnit.gather` fills a full flat buffer (in the compute dtype) and the
modules are switched to *full parameters*: ordinary ``nn.Parameter`` views of that buffer, so user
code sees normal tensors. :meth:`FlatUnit.free` releases the buffer's storage; the views (and any
tensors autograd saved) come back to life when the storage is filled again, which is how the
backward pass recomputes nothing it did not have to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cephalo_lightning.runtime.collectives import Collectives, PendingGather
from cephalo_lightning.runtime.layout import ParamSpan, UnitLayout
from cephalo_lightning.runtime.memory import note_resize


@dataclass(frozen=True)
class ParamSlot:
    """Where a parameter is registered: ``module.<attr>`` under the fully qualified ``name``."""

    name: str
    module: nn.Module
    attr: str


def set_module_param(module: nn.Module, attr: str, param: nn.Parameter) -> None:
    # Swapping the registered Parameter object in place (as FSDP does) keeps hooks, names and
    # the module structure intact; nn.Module.__setattr__ would refuse a tensor of another shape.
    module._parameters[attr] = param


def _free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() > 0:
        note_resize(storage.size(), 0)
        storage.resize_(0)


def _alloc_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() != nbytes:
        note_resize(storage.size(), nbytes)
        storage.resize_(nbytes)


class FlatUnit:
    """The parameters of one unit, sharded by ``layout`` onto ``rank``."""

    def __init__(
        self,
        layout: UnitLayout,
        slots: list[ParamSlot],
        rank: int,
        compute_dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        if [s.name for s in slots] != [p.name for p in layout.params]:
            raise ValueError(f"unit {layout.name}: slots and layout disagree")
        self.layout = layout
        self.slots = slots
        self.rank = rank
        originals = [s.module._parameters[s.attr] for s in slots]
        self.device = device or (originals[0].device if originals else torch.device("cpu"))
        self.compute_dtype = compute_dtype or (originals[0].dtype if originals else torch.float32)
        # the master copy is fp32 (fp64 stays fp64): optimizers never step 16-bit weights
        self.master_dtype = torch.promote_types(originals[0].dtype, torch.float32) if originals else torch.float32
        self.requires_grad = [bool(p.requires_grad) for p in originals]
        self.trainable = any(self.requires_grad)

        lo, hi = layout.shard_range(rank)
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).to(self.master_dtype) for p in originals]) if originals else torch.zeros(0)
            self.master = flat[lo:hi].to(self.device).clone()  # this rank's fp32 shard: the truth
        self.local_params: list[nn.Parameter] = []
        for span, requires_grad in zip(layout.params, self.requires_grad):
            a, b = layout.param_piece(span, rank)
            start = span.offset + a - lo
            self.local_params.append(nn.Parameter(self.master[start : start + b - a], requires_grad=requires_grad))

        self.full = torch.empty(layout.numel, dtype=self.compute_dtype, device=self.device)
        self.full_params = [
            nn.Parameter(self.full[s.offset : s.offset + s.numel].view(s.shape), requires_grad=rg)
            for s, rg in zip(layout.params, self.requires_grad)
        ]
        # Collectives write through this alias: it shares the storage but not the version counter,
        # so refilling the buffer for the backward pass does not trip autograd's in-place checks
        # on tensors it saved in the forward (they are views of the same storage).
        self._full_raw = self.full.data
        _free_storage(self.full)
        self.gathered = False
        self.pending: PendingGather | None = None
        self.use_local()

    # ------------------------------------------------------------------ parameters

    @property
    def spans(self) -> tuple[ParamSpan, ...]:
        return self.layout.params

    def use_local(self) -> None:
        """Modules hold the local pieces (what optimizers and state dicts see)."""
        for slot, param in zip(self.slots, self.local_params):
            set_module_param(slot.module, slot.attr, param)

    def use_full(self) -> None:
        """Modules hold full parameters (views of the gathered buffer) for compute."""
        for slot, param in zip(self.slots, self.full_params):
            set_module_param(slot.module, slot.attr, param)

    # ------------------------------------------------------------------ gather / free

    def start_gather(self, comm: Collectives) -> None:
        """Begin filling the full buffer; overlaps with compute where the backend allows."""
        if self.gathered or self.pending is not None:
            return
        _alloc_storage(self.full)
        shard = self.master.to(self.compute_dtype)
        self.pending = comm.all_gather(shard, self._full_raw, self.layout, async_op=True)

    def gather(self, comm: Collectives) -> None:
        """Make the full parameters usable (waits for a prefetch already in flight)."""
        self.start_gather(comm)
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        self.gathered = True
        self.use_full()

    def free(self) -> None:
        """Release the full buffer; modules go back to the local pieces."""
        if self.pending is not None:  # a prefetch nobody used: finish it so collectives stay paired
            self.pending.wait()
            self.pending = None
        _free_storage(self.full)
        self.gathered = False
        self.use_local()

    # ------------------------------------------------------------------ gradients

    def take_full_grad(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The unit's full flat gradient (zeros where a parameter got none); clears the grads.

        ``dtype`` defaults to the master's: gradients are reduced in fp32 (fp64 for fp64 models).
        """
        dtype = dtype or self.master_dtype
        pieces = []
        for span, param in zip(self.spans, self.full_params):
            grad = param.grad
            pieces.append(grad.reshape(-1).to(dtype) if grad is not None else torch.zeros(span.numel, dtype=dtype, device=self.device))
            param.grad = None
        if not pieces:
            return torch.zeros(0, dtype=dtype, device=self.device)
        return torch.cat(pieces)

    def add_local_grad(self, shard_grad: torch.Tensor) -> None:
        """Accumulate a reduced shard gradient into the local pieces' ``.grad``."""
        lo, _ = self.layout.shard_range(self.rank)
        for span, param in zip(self.spans, self.local_params):
            if not param.requires_grad:
                continue
            a, b = self.layout.param_piece(span, self.rank)
            start = span.offset + a - lo
            piece = shard_grad[start : start + b - a].to(param.dtype)
            if param.grad is None:
                param.grad = piece.clone()
            else:
                param.grad.add_(piece)
