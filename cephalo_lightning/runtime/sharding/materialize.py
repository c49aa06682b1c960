"""Each unit's master shard, built one unit at a time (:class:`UnitMaterializer`).

A model built on the meta device is materialised one unit at a time: the unit's tensors are
allocated, initialised (or read from a :class:`WeightSource`, this rank's slices only) and cut to
the local shard before the next unit is touched, so the peak is the rank's share plus about one
unit, never the whole model. A materialised model's units are cut to their shards as they are, unless
weights are given: then every unit is read from them, whether the model was built on the meta device
(``configure_model()``) or eagerly (in ``__init__``), so pretrained weights are never silently ignored.
The parameters named ``fresh`` (adapters added to a pretrained model, e.g. peft LoRA's) are the
exception: no pretrained file holds them, so they keep the values the model was built with, or on
the meta device are initialised like any meta parameter.

A meta buffer gets the value a model built normally would hold (:func:`_settle_buffers`): the files',
else the initialisation's where it writes one, else what the module's constructor computed, replayed
on the host (:mod:`.construction`); a non-persistent buffer that both the initialisation and the
constructor give must get the same value from both, and a buffer nothing gives refuses the fit. No
buffer is ever left holding the memory it was allocated with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning.runtime.sharding.construction import ConstructionRecord
from cephalo_lightning.runtime.sharding.flat_unit import ParamSlot, full_shape
from cephalo_lightning.runtime.sharding.grouping import Buffer
from cephalo_lightning.runtime.sharding.layout import UnitLayout


class WeightSource(Protocol):
    """Where a meta-built model's weights come from (see :mod:`.weights`)."""

    def read(self, name: str, shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor: ...
    def holds(self, name: str) -> bool: ...
    def buffer(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None: ...


InitFn = Callable[[nn.Module], None]  # initialise a module's own (non-recursive) parameters and buffers


def _post_order(modules: Sequence[nn.Module], wanted: set[int]) -> list[nn.Module]:
    """The modules in ``wanted`` reachable from ``modules``, children before parents, once each."""
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(mod: nn.Module) -> None:
        if id(mod) in seen:
            return
        seen.add(id(mod))
        for child in mod.children():
            visit(child)
        if id(mod) in wanted:
            out.append(mod)

    for mod in modules:
        visit(mod)
    return out


class UnitMaterializer:
    """Builds each unit's master shard: from materialised parameters, or for meta parameters from
    ``source`` (this rank's slices only) or by allocating and running ``init`` on the unit alone.

    ``seed``: every unit is initialised under its own seed (``seed`` and the unit's index), so a
    model initialised here is the same on every rank and under every layout. ``construction``: what
    the model's constructor computed while it was built on meta (its buffers' values come from it
    where neither the files nor ``init`` give one).
    """

    def __init__(self, device: torch.device, init: InitFn | None = None, source: WeightSource | None = None,
                 seed: int = 0, fresh: frozenset[str] = frozenset(),
                 construction: ConstructionRecord | None = None) -> None:
        self.device = device
        self.init = init
        self.source = source
        self.seed = seed
        self.fresh = fresh
        self.construction = construction
        self.materialized_units = 0

    def master(self, index: int, unit: UnitLayout, slots: list[ParamSlot], rank: int, dtype: torch.dtype,
               buffers: list[Buffer]) -> torch.Tensor:
        lo, hi = unit.shard_range(rank)
        params = [slot.current for slot in slots]
        meta = any(p.is_meta for p in params) or any(mod._buffers[attr].is_meta for _, mod, attr in buffers)
        if meta:
            self.materialized_units += 1
        if self.source is not None:  # the files win over whatever the model was built with, meta or not
            return self._read(index, unit, slots, rank, dtype, buffers)
        if not meta:
            self._buffers_to_device(buffers)
            if not params:
                return torch.zeros(0, dtype=dtype, device=self.device)
            return _flat_range(params, lo, hi, dtype, self.device)
        return self._initialise(index, unit, slots, dtype, buffers, lo, hi)

    def _buffers_to_device(self, buffers: list[Buffer]) -> None:
        for _, mod, attr in buffers:
            buf = mod._buffers[attr]
            if buf.device != self.device:
                mod._buffers[attr] = buf.to(self.device)

    def _read(self, index: int, unit: UnitLayout, slots: list[ParamSlot], rank: int, dtype: torch.dtype,
              buffers: list[Buffer]) -> torch.Tensor:
        assert self.source is not None
        pieces = []
        built = self._fresh_values(index, unit, slots)
        for span in unit.params:
            a, b = unit.param_piece(span, rank)
            if b > a and span.name in built:
                pieces.append(built[span.name].detach().reshape(-1)[a:b].to(device=self.device, dtype=dtype))
            elif b > a:
                pieces.append(self.source.read(span.name, span.shape, a, b).reshape(-1).to(device=self.device, dtype=dtype))
        unread: list[Buffer] = []
        for name, mod, attr in buffers:
            value = self.source.buffer(name, tuple(mod._buffers[attr].shape))
            if value is None and not mod._buffers[attr].is_meta:  # not in the files, but built: keep it
                mod._buffers[attr] = mod._buffers[attr].to(self.device)
            elif value is None:  # not in the files (non-persistent, e.g. rotary frequencies)
                unread.append((name, mod, attr))
            else:
                mod._buffers[attr] = value.to(device=self.device, dtype=mod._buffers[attr].dtype)
        if unread:
            pending = _allocate(unread, self.device)
            if self.init is not None:
                with torch.no_grad(), _initialising_only([], _owners(unread)):  # their parameters came from the files
                    for mod in _owners(unread):
                        self.init(mod)
            _settle_buffers(pending, self.construction)
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=dtype, device=self.device)

    def _fresh_values(self, index: int, unit: UnitLayout, slots: list[ParamSlot]) -> dict[str, torch.Tensor]:
        """The unit's ``fresh`` parameters the files lack, whole: as built, or (meta) initialised
        under the unit's seed by their own modules."""
        assert self.source is not None
        wanted = [(span, slot) for span, slot in zip(unit.params, slots)
                  if span.name in self.fresh and not self.source.holds(span.name)]
        meta = [slot for _, slot in wanted if slot.current.is_meta]
        if meta:
            if self.init is None:
                raise ValueError(f"unit {unit.name}: adapter parameters on the meta device and no initialisation known")
            self._initialise_seeded(index, meta, [])
        return {span.name: slot.current for span, slot in wanted}

    def _initialise(self, index: int, unit: UnitLayout, slots: list[ParamSlot], dtype: torch.dtype,
                    buffers: list[Buffer], lo: int, hi: int) -> torch.Tensor:
        if self.init is None:
            raise ValueError(
                f"unit {unit.name} is on the meta device but no initialisation is known: define "
                "reset_parameters() on its modules or cephalo_init_weights(module) on the LightningModule, "
                "or load weights (CephaloStrategy(pretrained=...))"
            )
        pending = _allocate(buffers, self.device)
        self._initialise_seeded(index, slots, _owners(buffers))
        _settle_buffers(pending, self.construction)
        return _flat_range([slot.current for slot in slots], lo, hi, dtype, self.device)

    def _initialise_seeded(self, index: int, slots: Sequence[ParamSlot], buffer_owners: Sequence[nn.Module]) -> None:
        """Allocate ``slots``' meta parameters and run ``init`` under unit ``index``'s seed on the
        modules that own them (a tied parameter's canonical holder) and on ``buffer_owners``,
        children before parents."""
        assert self.init is not None
        for slot in slots:
            old = slot.current
            slot.set(nn.Parameter(torch.empty_like(old, device=self.device), requires_grad=old.requires_grad))
        tops = [slot.holders[0][0] for slot in slots] + list(buffer_owners)
        modules = _post_order(tops, {id(mod) for mod in tops})
        with torch.random.fork_rng(devices=[]), torch.no_grad(), _initialising_only(slots, modules):
            torch.manual_seed((self.seed * 1_000_003 + index) % (2**63))
            for mod in modules:
                self.init(mod)


class MetaBufferError(ConfigurationError):
    """A buffer of a model built on the meta device cannot be given the value a model built normally holds."""


@dataclass(frozen=True)
class _Allocated:
    """A meta buffer given memory: what it was on meta, what memory it got, that memory's version then."""

    name: str
    module: nn.Module
    attr: str
    meta: torch.Tensor
    memory: torch.Tensor
    version: int

    def written(self) -> bool:
        current = self.module._buffers[self.attr]
        return current is not self.memory or current._version != self.version


def _owners(buffers: Sequence[Buffer]) -> list[nn.Module]:
    """The modules holding ``buffers``, once each, in order."""
    return list({id(mod): mod for _, mod, _ in buffers}.values())


def _allocate(buffers: Sequence[Buffer], device: torch.device) -> list[_Allocated]:
    """Memory for every meta buffer in ``buffers``, floating-point ones filled with NaN (so a value
    written only in part cannot pass for a number)."""
    out = []
    for name, mod, attr in buffers:
        meta = mod._buffers[attr]
        if not meta.is_meta:
            continue
        memory = torch.empty_like(meta, device=device)
        if memory.is_floating_point() or memory.is_complex():
            memory.fill_(float("nan"))
        mod._buffers[attr] = memory
        out.append(_Allocated(name, mod, attr, meta, memory, memory._version))
    return out


def _settle_buffers(pending: Sequence[_Allocated], construction: ConstructionRecord | None) -> None:
    """[Note: the two values of a non-persistent buffer] (see :mod:`.construction`), applied to
    ``pending``, whose initialisation has run: each keeps what the initialisation wrote, else takes
    the constructor's replayed value; a non-persistent one given both must get the same from both."""
    constructed = construction.replay([p.meta for p in pending]) if construction is not None and pending else {}
    for p in pending:
        current = p.module._buffers[p.attr]
        replayed = constructed.get(id(p.meta))
        if replayed is not None:
            replayed = replayed.to(device=current.device, dtype=current.dtype)
        kind = type(p.module).__name__
        if p.written():
            persistent = p.attr not in p.module._non_persistent_buffers_set
            if replayed is not None and not persistent and not _same_values(current, replayed):
                raise MetaBufferError(
                    f"buffer {p.name!r} ({kind}, non-persistent) was built on the meta device: its initialisation "
                    f"wrote values that differ from what {kind}'s constructor computes (largest difference "
                    f"{_largest_difference(current, replayed):.3g}), so one of the two is not what the model means. "
                    f"Make the initialisation ({kind}'s reset_parameters() or the LightningModule's "
                    "cephalo_init_weights) compute it as the constructor does, or build the model outside the meta "
                    "device (in __init__)"
                )
        elif replayed is not None:
            p.module._buffers[p.attr] = replayed
        else:
            raise MetaBufferError(
                f"buffer {p.name!r} ({kind}) was built on the meta device and nothing gives it a value: the weights do "
                f"not hold it, the initialisation did not write it, and its constructor's computation was not "
                "recorded (the model was built on meta outside the strategy's configure_model()/init_module). Build "
                f"the model in configure_model(), compute the buffer in {kind}.reset_parameters() or in the "
                "LightningModule's cephalo_init_weights(module), or build the model outside the meta device"
            )


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, or for floating point within 4 units in the last place: the same formula evaluated
    twice may round differently in each of its few operations, and a wrong value is far off."""
    if a.shape != b.shape:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    eps = torch.finfo(a.dtype).eps
    return bool(torch.allclose(a, b, rtol=4 * eps, atol=0.0, equal_nan=False))


def _largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


@contextlib.contextmanager
def _initialising_only(slots: Sequence[ParamSlot], modules: Sequence[nn.Module]) -> Iterator[None]:
    """[Note: a unit initialises its own parameters only]

    An init function writes every parameter of the module it is given, but a module may also hold a
    parameter that is not this unit's to initialise: a head tied to the root's embedding that has a
    bias of its own holds the embedding's already materialised shard, and a tied parameter's other
    holders are not its canonical holder. While ``modules`` initialise, each such parameter is
    replaced by a meta stand-in of its full shape (an init writes nothing into it, and fan-in
    computations still see the true shape), then put back."""
    own = {(id(slot.holders[0][0]), slot.holders[0][1]) for slot in slots}
    guarded = [(mod, attr, p) for mod in modules for attr, p in mod._parameters.items()
               if p is not None and not p.is_meta and (id(mod), attr) not in own]
    for mod, attr, p in guarded:
        mod._parameters[attr] = nn.Parameter(torch.empty(full_shape(p), dtype=p.dtype, device="meta"),
                                             requires_grad=p.requires_grad)
    try:
        yield
    finally:
        for mod, attr, p in guarded:
            mod._parameters[attr] = p


def _flat_range(params: Sequence[torch.Tensor], lo: int, hi: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Elements [lo, hi) of the parameters flattened one after another, copied piece by piece: the
    unit is never concatenated, so building a shard holds the unit once, not twice."""
    out = torch.empty(hi - lo, dtype=dtype, device=device)
    offset = 0
    with torch.no_grad():
        for p in params:
            a, b = max(lo, offset), min(hi, offset + p.numel())
            if b > a:
                out[a - lo : b - lo].copy_(p.detach().reshape(-1)[a - offset : b - offset])
            offset += p.numel()
    return out
