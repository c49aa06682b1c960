"""The uneven ZeRO-3 engine: a model whose state is sharded by per-rank shares.

:class:`ShardedModel` takes an ``nn.Module`` and the ranks' state shares, splits it into units
(:mod:`.wrap`), lays the units out unevenly (:mod:`.layout`) and keeps only this rank's pieces.
Two ways to compute:

* hooks (the ``uniform`` mode, any model): each unit gathers before its forward, frees after,
  re-gathers before its backward and reduce-scatters its gradient once the step's last
  micro-batch is through (:meth:`set_requires_gradient_sync`);
* explicit calls from a schedule (the ``layered`` mode, :mod:`.layered`), which drives
  :meth:`FlatUnit.gather` / :meth:`reduce_unit` itself.

Collectives are issued in an order that depends only on the model's structure, never on the
batch: gathers follow the graph, reduce-scatters go strictly from the last unit to the first.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cephalo_lightning.runtime.batching import tensors_in
from cephalo_lightning.runtime.collectives import Collectives
from cephalo_lightning.runtime.emulation import DeviceEmulator
from cephalo_lightning.runtime.flat_unit import FlatUnit, ParamSlot, set_module_param
from cephalo_lightning.runtime.layout import ParamSpan, ShardLayout, build_layout
from cephalo_lightning.runtime.wrap import WrapPolicy, check_no_shared_parameters, find_units

ROOT = "<root>"


def _slots_of(module: nn.Module, names: dict[int, str], exclude: set[int]) -> list[ParamSlot]:
    """Where the parameters under ``module`` (not in ``exclude``) are registered, once each.

    A module reachable by two paths (an adapter that wraps a submodule, say) is one module: its
    parameters get one slot, under the model's canonical name (``named_parameters()``'s, which is
    also what ``state_dict()`` uses).
    """
    slots = []
    for mod in module.modules():  # each module object once
        if id(mod) in exclude:
            continue
        for attr, param in mod._parameters.items():
            if param is not None:
                slots.append(ParamSlot(names[id(param)], mod, attr))
    return slots


class ShardedModel:
    """``module`` with its parameters sharded across ``group`` by ``shares``.

    After construction ``module.parameters()`` yields this rank's local pieces (1-D, possibly
    empty), keyed by the original names: build the optimizer from them.
    """

    def __init__(
        self,
        module: nn.Module,
        shares: Sequence[float],
        *,
        units: WrapPolicy = None,
        group: dist.ProcessGroup | None = None,
        collective: str = "auto",
        compute_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        hooks: bool = True,
        prefetch: bool = True,
        record_collectives: bool = False,
        emulator: DeviceEmulator | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.module = module
        self.comm = Collectives(group, collective, record=record_collectives)
        if len(shares) != self.comm.world_size:
            raise ValueError(
                f"{len(shares)} state shares for a world of {self.comm.world_size} ranks: give one share per rank"
            )
        unit_modules = find_units(module, units)
        check_no_shared_parameters(module, unit_modules)
        self.unit_modules: list[nn.Module] = list(unit_modules)
        names = {id(m): n for n, m in module.named_modules()}
        param_names = {id(p): n for n, p in module.named_parameters()}
        inside = {id(m) for u in unit_modules for m in u.modules()}
        groups = [(ROOT, _slots_of(module, param_names, inside))]
        groups += [(names[id(u)] or type(u).__name__, _slots_of(u, param_names, set())) for u in unit_modules]

        spans_per_unit = []
        for _, slots in groups:
            spans, offset = [], 0
            for slot in slots:
                p = slot.module._parameters[slot.attr]
                spans.append(ParamSpan(slot.name, tuple(p.shape), offset, p.numel()))
                offset += p.numel()
            spans_per_unit.append(spans)
        self.layout: ShardLayout = build_layout(
            [sum(s.numel for s in spans) for spans in spans_per_unit], list(shares),
            [name for name, _ in groups], spans_per_unit,
        )
        self.reduce_dtype = reduce_dtype
        self.units = [
            FlatUnit(ul, slots, self.comm.rank, compute_dtype, device)
            for ul, (_, slots) in zip(self.layout.units, groups)
        ]
        self.root = self.units[0]
        self.emulator = emulator or DeviceEmulator()
        self.prefetch = prefetch
        self._sync = True
        self._next_reduce = len(self.units) - 1
        self._ready: set[int] = set()
        self._grad_counts = [0] * len(self.units)
        self._expected = [sum(u.requires_grad) for u in self.units]
        self._backward_gathered: set[int] = set()
        self._handles: list[Any] = []
        self.hooks_active = True  # a schedule that drives the units itself switches them off
        if hooks:
            self._install_hooks()

    # ------------------------------------------------------------------ introspection

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's local pieces (what the optimizer should own)."""
        for unit in self.units:
            yield from unit.local_params

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for unit in self.units:
            for span, param in zip(unit.spans, unit.local_params):
                yield span.name, param

    def local_state_numel(self) -> int:
        return sum(u.master.numel() for u in self.units)

    # ------------------------------------------------------------------ hooks (uniform mode)

    def _install_hooks(self) -> None:
        self._handles.append(self.module.register_forward_pre_hook(self._root_pre_forward))
        self._handles.append(self.module.register_forward_hook(self._root_post_forward))
        for index, module in enumerate(self.unit_modules, start=1):
            self._handles.append(module.register_forward_pre_hook(self._make_pre_forward(index)))
            self._handles.append(module.register_forward_hook(self._make_post_forward(index)))
        for index, unit in enumerate(self.units):
            for param, rg in zip(unit.full_params, unit.requires_grad):
                if rg:
                    self._handles.append(param.register_post_accumulate_grad_hook(self._make_post_accumulate(index)))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def hooks_disabled(self) -> Iterator[None]:
        """For schedules that gather, free and reduce the units themselves."""
        previous, self.hooks_active = self.hooks_active, False
        try:
            yield
        finally:
            self.hooks_active = previous

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if self.hooks_active:
            self.gather_root()

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.hooks_active and not torch.is_grad_enabled():  # evaluation: no backward will free it
            self.root.free()

    def _make_pre_forward(self, index: int):
        def hook(module: nn.Module, args: Any) -> None:
            if not self.hooks_active:
                return
            self.gather_root()
            self.units[index].gather(self.comm)
            if self.prefetch and index + 1 < len(self.units):
                self.units[index + 1].start_gather(self.comm)
            self.emulator.begin_compute()

        return hook

    def _make_post_forward(self, index: int):
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if not self.hooks_active:
                return output
            self.emulator.end_compute()
            unit = self.units[index]
            unit.free()
            if torch.is_grad_enabled():
                for tensor in tensors_in(output):
                    if tensor.requires_grad:
                        tensor.register_hook(self._make_pre_backward(index))
            return output

        return hook

    def _make_pre_backward(self, index: int):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if self.hooks_active and index not in self._backward_gathered:
                self._backward_gathered.add(index)
                self.units[index].gather(self.comm)
                if self.prefetch and index - 1 >= 1:
                    self.units[index - 1].start_gather(self.comm)
                self.emulator.begin_compute()
            return grad

        return hook

    def _make_post_accumulate(self, index: int):
        def hook(param: torch.Tensor) -> None:
            if not self.hooks_active:
                return
            self._grad_counts[index] += 1
            if self._grad_counts[index] == self._expected[index]:
                self._unit_backward_done(index)

        return hook

    def _unit_backward_done(self, index: int) -> None:
        self._grad_counts[index] = 0
        if index != 0:
            self.emulator.end_compute()
            self.units[index].free()
        self._ready.add(index)
        self._flush_reductions(all_units=False)

    # ------------------------------------------------------------------ gradients

    def set_requires_gradient_sync(self, sync: bool) -> None:
        """False while accumulating micro-batches: full gradients stay local, nothing is reduced."""
        self._sync = sync

    def _flush_reductions(self, all_units: bool) -> None:
        """Reduce ready units strictly from the last to the first (same order on every rank).

        With ``upto`` set, every unit down to that index is reduced whether or not autograd
        reached it (a unit no gradient flowed into contributes zeros).
        """
        while self._next_reduce >= 0:
            index = self._next_reduce
            if not all_units and index not in self._ready and self.units[index].trainable:
                return
            self._ready.discard(index)
            if self._sync:
                self.reduce_unit(self.units[index])
            self._next_reduce -= 1

    def reduce_unit(self, unit: FlatUnit) -> None:
        """Reduce-scatter one unit's full gradient onto the owners and accumulate it there.

        Units without trainable parameters are skipped (on every rank alike).
        """
        if not unit.trainable:
            return
        full_grad = unit.take_full_grad(self.reduce_dtype)
        unit.add_local_grad(self.comm.reduce_scatter(full_grad, unit.layout))

    def gather_root(self) -> None:
        if not self.root.gathered:
            self.root.gather(self.comm)

    def finish_backward(self) -> None:
        """End of one micro-batch's backward: reduce what is left, in order; free the root."""
        self._flush_reductions(all_units=True)
        self._next_reduce = len(self.units) - 1
        self._ready.clear()
        self._grad_counts = [0] * len(self.units)
        self._backward_gathered.clear()
        for unit in self.units[1:]:
            if unit.gathered or unit.pending is not None:
                unit.free()
        if self._sync:
            self.root.free()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.finish_backward()

    def free_all(self) -> None:
        """Release every gathered buffer (after an evaluation forward, say)."""
        for unit in self.units:
            unit.free()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of the WHOLE model's gradient, summed across the uneven shards."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        device = self.root.device
        if norm_type == math.inf:
            local = torch.stack([g.abs().max() for g in grads if g.numel()]).max() if any(g.numel() for g in grads) else torch.zeros((), device=device)
            total = local.clone().double()
            if self.world_size > 1:
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.comm.group)
        else:
            local = sum((g.double().abs().pow(norm_type).sum() for g in grads), torch.zeros((), dtype=torch.float64, device=device))
            total = self.comm.all_reduce_sum(local.clone()).pow(1.0 / norm_type)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    # ------------------------------------------------------------------ full parameters

    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Every unit gathered, the modules holding full parameters, the hooks off (e.g. for a
        plain forward of the whole model, or profiling it); gradients computed inside are dropped."""
        for unit in self.units:
            unit.gather(self.comm)
        try:
            with self.hooks_disabled():
                yield
        finally:
            for unit in self.units:
                for param in unit.full_params:
                    param.grad = None
            self.free_all()

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters in fp32, original names and shapes, on every rank."""
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            full = torch.empty(unit.layout.numel, dtype=unit.master.dtype, device=unit.device)
            self.comm.all_gather(unit.master, full, unit.layout).wait()
            for span in unit.spans:
                out[span.name] = full[span.offset : span.offset + span.numel].view(span.shape).clone()
        return out

    @torch.no_grad()
    def release(self) -> None:
        """Collective: give the module back unsharded (full fp32 parameters, no hooks).

        Used to re-shard with new shares; afterwards this object must not be used again.
        """
        full = self.full_state_dict()
        self.remove_hooks()
        for unit in self.units:
            unit.free()
            for slot, span, requires_grad in zip(unit.slots, unit.spans, unit.requires_grad):
                set_module_param(slot.module, slot.attr, nn.Parameter(full[span.name], requires_grad=requires_grad))
