"""The uniform mode's hooks: a sharded model's units gathered, freed and reduced as the module's
forward and autograd's backward reach them.

:class:`UniformHooks` drives a :class:`~.sharded_model.ShardedModel` (through :class:`HookedModel`,
what the hooks need of it) while its :class:`Driver` is ``HOOKS``: see [Note: unit state] in
:mod:`.sharded_model` for the states each hook moves a unit through.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn

from cephalo_lightning.runtime.batching import tensors_in
from cephalo_lightning.runtime.observers import Observers
from cephalo_lightning.runtime.sharding.flat_unit import FlatUnit, GradState, UnitState


class Driver(enum.Enum):
    """Who drives the units; the hooks consult it and do nothing outside ``HOOKS``."""

    HOOKS = enum.auto()  # modules hold local pieces; the uniform-mode hooks gather on demand
    SCHEDULED = enum.auto()  # a schedule (the layered mode) drives gathers and reductions itself
    SUMMONED = enum.auto()  # units gathered by hand (summon_full_params, unit_gathered); no hook acts
    HANDED_BACK = enum.auto()  # after a fit: the modules hold whole copies of the trained parameters; no hook acts
    PARKED = enum.auto()  # after a fit, left sharded: a forward or state_dict of the module is refused


class HookedModel(Protocol):
    """What the hooks read and call on the sharded model they drive."""

    module: nn.Module
    unit_groups: Sequence[Sequence[nn.Module]]
    units: list[FlatUnit]
    root: FlatUnit
    observers: Observers
    driver: Driver

    def gather_root(self) -> None: ...

    def gather(self, index: int, prefetch: int | None = None) -> FlatUnit: ...

    def reduce_in_order(self, every: bool) -> None: ...


class UniformHooks:
    """The uniform mode's module and autograd hooks (see [Note: unit state] in :mod:`.sharded_model`);
    each acts only while the model's driver is ``HOOKS`` and returns at once when its unit is already
    where it leads.

    Besides the units' regions they report the root unit's own compute (embedding, head, a loss the
    model's forward computes, and their backward) as the region ``root_compute``, so an emulator
    slows it and a busy-time observer counts it as the layered schedule's regions do: open inside
    the root's forward whenever no unit computes, and in
    :meth:`~.sharded_model.ShardedModel.backward` before the first unit's backward (the loss's and
    the head's) and after the first layer unit's (the embedding's). Between the units' backward it
    stays closed: that is autograd's and the hooks' host work, once per unit and micro-batch, which
    no profiled layer holds and a slower device would not slow. It is closed around every gather
    and reduction, so no collective is ever inside
    it. The user's code around the model (a loss computed in ``training_step``, a ``sync_dist``
    log) stays outside.
    """

    def __init__(self, model: HookedModel) -> None:
        self.model = model
        self._root_wanted = False  # inside the root's forward or the backward
        self._root_open = False
        model.module.register_forward_pre_hook(self._pre_forward_root)
        model.module.register_forward_hook(self._post_forward_root)
        for index, group in enumerate(model.unit_groups, start=1):
            # every module of a group gathers its unit for a plain forward (evaluation); a group's
            # backward is driven by its schedule, so only single-module units follow autograd
            for module in group:
                module.register_forward_pre_hook(partial(self._pre_forward, index))
                module.register_forward_hook(partial(self._post_forward, index, len(group) == 1))
        for index, unit in enumerate(model.units):
            for param, rg in zip(unit.full_params, unit.requires_grad):
                if rg:
                    param.register_post_accumulate_grad_hook(partial(self._post_accumulate, index))

    def _root_region(self, open_: bool) -> None:
        """Open (where the root computes) or close the root's compute region; idempotent."""
        if open_ == self._root_open or (open_ and not self._root_wanted):
            return
        self._root_open = open_
        observers = self.model.observers
        (observers.compute_begin if open_ else observers.compute_end)("root_compute")

    def root_backward(self, inside: bool) -> None:
        """The backward pass begins (``inside``) or has ended: the root's backward computes between the units'."""
        if self.model.driver is Driver.HOOKS:
            self._root_region(False)
            self._root_wanted = inside
            self._root_region(inside)

    def _pre_forward_root(self, module: nn.Module, args: Any) -> None:
        if self.model.driver is Driver.HOOKS:
            self.model.gather_root()
            self._root_wanted = True
            self._root_region(True)

    def _post_forward_root(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.model.driver is not Driver.HOOKS:
            return
        self._root_region(False)
        self._root_wanted = False
        if not torch.is_grad_enabled():  # evaluation: no backward will free it
            self.model.root.free()

    def _pre_forward(self, index: int, module: nn.Module, args: Any) -> None:
        model = self.model
        if model.driver is not Driver.HOOKS or model.units[index].state is UnitState.GATHERED:
            return
        self._root_region(False)
        model.gather_root()
        model.gather(index, prefetch=index + 1)
        model.observers.compute_begin("unit_forward")

    def _post_forward(self, index: int, follows_autograd: bool, module: nn.Module, args: Any, output: Any) -> Any:
        model = self.model
        if model.driver is not Driver.HOOKS or model.units[index].state is UnitState.SHARDED:
            return output
        model.observers.compute_end("unit_forward")
        model.units[index].free()
        if follows_autograd and torch.is_grad_enabled():
            for tensor in tensors_in(output):
                if tensor.requires_grad:
                    tensor.register_hook(partial(self._pre_backward, index))
        self._root_region(True)
        return output

    def _pre_backward(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        model, unit = self.model, self.model.units[index]
        if model.driver is Driver.HOOKS and unit.grad_state is GradState.IDLE:
            unit.grad_state = GradState.COMPUTING
            self._root_region(False)
            self._free_finished(index)
            model.gather(index, prefetch=index - 1)
            model.observers.compute_begin("unit_backward")
        return grad

    def _free_finished(self, index: int) -> None:
        """[Note: frozen parameters outlive the last gradient] A unit with frozen parameters (LoRA's
        base weights) has not finished its backward when its last trainable gradient arrives: the
        input's gradient still flows through the frozen weights (``dx = dy W``), so it stays gathered
        until a unit before it starts its backward (its output's gradient, this unit's input's, is
        then complete) or the backward ends (:meth:`~.sharded_model.ShardedModel.finish_backward`)."""
        for later in self.model.units[index + 1:]:
            if later.grad_state in (GradState.READY, GradState.REDUCED) and later.state is not UnitState.SHARDED:
                later.free()

    def _post_accumulate(self, index: int, param: torch.Tensor) -> None:
        unit = self.model.units[index]
        if self.model.driver is not Driver.HOOKS or unit.grad_state in (GradState.READY, GradState.REDUCED):
            return
        unit.grads_accumulated += 1
        if unit.grads_accumulated == unit.num_trainable:
            self._post_backward(index)

    def _post_backward(self, index: int) -> None:
        """Autograd accumulated the unit's last gradient: -> READY, and reduce what is due."""
        model, unit = self.model, self.model.units[index]
        self._root_region(False)
        if index != 0:  # the root stays gathered for the whole step
            if unit.grad_state is GradState.COMPUTING:
                model.observers.compute_end("unit_backward")
            if unit.num_trainable == len(unit.requires_grad):
                unit.free()
        unit.grad_state = GradState.READY
        model.reduce_in_order(every=False)
        self._root_region(index <= 1)  # what follows the first layer unit's backward is the root's
