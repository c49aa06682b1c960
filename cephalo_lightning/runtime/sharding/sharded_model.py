"""The uneven ZeRO-3 engine: a model whose state is sharded by per-rank shares.

:class:`ShardedModel` takes an ``nn.Module`` and the ranks' state shares, splits it into units
(:mod:`.wrap`), lays the units out unevenly (:mod:`.layout`) and keeps only this rank's pieces.
Two ways to compute:

* hooks (the ``uniform`` mode, any model): each unit gathers before its forward, frees after,
  re-gathers before its backward and reduce-scatters its gradient once the step's last
  micro-batch is through (:meth:`set_requires_gradient_sync`);
* explicit calls from a schedule (the ``layered`` mode, :mod:`.layered`), which drives
  :meth:`FlatUnit.gather` / :meth:`reduce_unit` itself inside :meth:`scheduled`.

[Note: collective order] Collectives are issued in an order that depends only on the model's
structure, never on the batch: gathers follow the graph, reduce-scatters go strictly from the last
unit to the first, and a rank with no samples (or an empty share) issues the same ones. Every rank
must therefore build the same units from the same model: the layout is a pure function of the
shares and the unit sizes (:func:`~.layout.build_layout`), so no rank has to ask another.

[Note: tied parameters] A parameter held by modules of two different units (an embedding tied to
the head) belongs to the root unit, which is gathered for the whole step; both holders see the
same full parameter and autograd sums the two uses into one gradient, reduced once.

A model built on the meta device is materialised one unit at a time (:class:`UnitMaterializer`):
the unit's tensors are allocated, initialised (or read from a :class:`~.weights.WeightSource`,
this rank's slices only) and cut to the local shard before the next unit is touched, so the peak
is the rank's share plus about one unit, never the whole model.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from cephalo_lightning.runtime.batching import tensors_in
from cephalo_lightning.runtime.collectives import Collectives, CudaStreams
from cephalo_lightning.runtime.distributed import gather_objects
from cephalo_lightning.runtime.observers import Observer, Observers
from cephalo_lightning.runtime.sharding.flat_unit import FlatUnit, ParamSlot, full_shape, piece_shape
from cephalo_lightning.runtime.sharding.layout import ParamSpan, ShardLayout, UnitLayout, build_layout
from cephalo_lightning.runtime.sharding.units import WrapPolicy, check_units_disjoint, find_units

ROOT = "<root>"

Units = Sequence[nn.Module | Sequence[nn.Module]]  # a unit is a module or a group of modules


class TrainingState(enum.Enum):
    """What the engine is doing; the hooks consult it and do nothing outside ``HOOKS``."""

    HOOKS = enum.auto()  # modules hold local pieces; the uniform-mode hooks gather on demand
    SCHEDULED = enum.auto()  # a schedule (the layered mode) drives gathers and reductions itself
    SUMMONED = enum.auto()  # every unit gathered (summon_full_params); no hook acts


class WeightSource(Protocol):
    """Where a meta-built model's weights come from (see :mod:`.weights`)."""

    def read(self, name: str, shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor: ...
    def buffer(self, name: str) -> torch.Tensor | None: ...


InitFn = Callable[[nn.Module], None]  # initialise a module's own (non-recursive) parameters and buffers


def _holders(module: nn.Module) -> tuple[dict[int, list[tuple[nn.Module, str]]], dict[int, nn.Parameter]]:
    """Every parameter (by identity) and every (module, attr) that registers it; each module once.

    A module reachable by two paths (an adapter that wraps a submodule) is one holder.
    """
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for mod in module.modules():  # each module object once
        for attr, param in mod._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((mod, attr))
                params[id(param)] = param
    return holders, params


def _group_slots(module: nn.Module, unit_groups: list[list[nn.Module]]) -> list[list[ParamSlot]]:
    """The parameter slots of the root unit and of every unit, in registration order.

    A parameter goes to the unit whose modules hold it; held from two units (tied), to the root.
    Names are the canonical ones (``named_parameters()``'s, also ``state_dict()``'s).
    """
    names = {id(p): n for n, p in module.named_parameters()}
    unit_of_module: dict[int, int] = {}
    for index, group in enumerate(unit_groups, start=1):
        for top in group:
            for mod in top.modules():
                unit_of_module.setdefault(id(mod), index)
    holders, params = _holders(module)
    groups: list[list[ParamSlot]] = [[] for _ in range(len(unit_groups) + 1)]
    for pid in names:  # registration order
        held = holders[pid]
        units = {unit_of_module.get(id(mod), 0) for mod, _ in held}
        target = units.pop() if len(units) == 1 else 0
        groups[target].append(ParamSlot(names[pid], tuple(held)))
    return groups


def _unit_name(module: nn.Module, group: Sequence[nn.Module]) -> str:
    names = {id(m): n for n, m in module.named_modules()}
    return "+".join(names.get(id(m)) or type(m).__name__ for m in group)


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
    model initialised here is the same on every rank and under every layout.
    """

    def __init__(self, device: torch.device, init: InitFn | None = None, source: WeightSource | None = None,
                 seed: int = 0) -> None:
        self.device = device
        self.init = init
        self.source = source
        self.seed = seed
        self.materialized_units = 0

    def master(self, index: int, unit: UnitLayout, slots: list[ParamSlot], rank: int, dtype: torch.dtype,
               buffers: list[tuple[str, nn.Module, str]]) -> torch.Tensor:
        lo, hi = unit.shard_range(rank)
        params = [slot.current for slot in slots]
        meta = any(p.is_meta for p in params) or any(mod._buffers[attr].is_meta for _, mod, attr in buffers)
        if not meta:
            self._buffers_to_device(buffers)
            if not params:
                return torch.zeros(0, dtype=dtype, device=self.device)
            return _flat_range(params, lo, hi, dtype, self.device)
        self.materialized_units += 1
        if self.source is not None:
            return self._read(unit, slots, rank, dtype, buffers)
        return self._initialise(index, unit, slots, dtype, buffers, lo, hi)

    def _buffers_to_device(self, buffers: list[tuple[str, nn.Module, str]]) -> None:
        for _, mod, attr in buffers:
            buf = mod._buffers[attr]
            if buf.device != self.device:
                mod._buffers[attr] = buf.to(self.device)

    def _read(self, unit: UnitLayout, slots: list[ParamSlot], rank: int, dtype: torch.dtype,
              buffers: list[tuple[str, nn.Module, str]]) -> torch.Tensor:
        assert self.source is not None
        pieces = []
        for span in unit.params:
            a, b = unit.param_piece(span, rank)
            if b > a:
                pieces.append(self.source.read(span.name, span.shape, a, b).reshape(-1).to(device=self.device, dtype=dtype))
        for name, mod, attr in buffers:
            value = self.source.buffer(name, tuple(mod._buffers[attr].shape))
            if value is None:  # not in the files (non-persistent, e.g. rotary frequencies): initialise it
                if self.init is None:
                    raise ValueError(f"buffer {name!r} is on the meta device and not in the weights; give an init")
                mod._buffers[attr] = torch.empty_like(mod._buffers[attr], device=self.device)
                with torch.no_grad(), _initialising_only([], [mod]):  # its parameters came from the files
                    self._init_module_buffers(mod)
            else:
                mod._buffers[attr] = value.to(device=self.device, dtype=mod._buffers[attr].dtype)
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=dtype, device=self.device)

    def _init_module_buffers(self, mod: nn.Module) -> None:
        assert self.init is not None
        self.init(mod)

    def _initialise(self, index: int, unit: UnitLayout, slots: list[ParamSlot], dtype: torch.dtype,
                    buffers: list[tuple[str, nn.Module, str]], lo: int, hi: int) -> torch.Tensor:
        if self.init is None:
            raise ValueError(
                f"unit {unit.name} is on the meta device but no initialisation is known: define "
                "reset_parameters() on its modules or cephalo_init_weights(module) on the LightningModule, "
                "or load weights (CephaloStrategy(pretrained=...))"
            )
        owners: set[int] = set()
        for slot in slots:
            old = slot.current
            slot.set(nn.Parameter(torch.empty_like(old, device=self.device), requires_grad=old.requires_grad))
            owners.add(id(slot.holders[0][0]))  # the canonical holder initialises a tied parameter
        tops: list[nn.Module] = [slot.holders[0][0] for slot in slots]
        for _, mod, attr in buffers:
            mod._buffers[attr] = torch.empty_like(mod._buffers[attr], device=self.device)
            owners.add(id(mod))
            tops.append(mod)
        modules = _post_order(tops, owners)
        with torch.random.fork_rng(devices=[]), torch.no_grad(), _initialising_only(slots, modules):
            torch.manual_seed((self.seed * 1_000_003 + index) % (2**63))
            for mod in modules:
                self.init(mod)
        return _flat_range([slot.current for slot in slots], lo, hi, dtype, self.device)


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


class ShardedModel:
    """``module`` with its parameters sharded across ``group`` by ``shares``.

    After construction ``module.parameters()`` yields this rank's local pieces (possibly empty),
    keyed by the original names: build the optimizer from them. ``units`` is a wrap policy
    (:func:`~.wrap.find_units`) or, for a schedule, the units themselves (a module or a group of
    modules each). Attach observers (timing, emulation, memory accounting) to :attr:`observers`.
    """

    def __init__(
        self,
        module: nn.Module,
        shares: Sequence[float],
        *,
        units: WrapPolicy | Units = None,
        group: dist.ProcessGroup | None = None,
        collective: str = "auto",
        compute_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        hooks: bool = True,
        prefetch: bool = True,
        record_collectives: bool = False,
        device: torch.device | None = None,
        materializer: UnitMaterializer | None = None,
        overlap: bool = True,
        observers: Sequence[Observer] = (),
    ) -> None:
        self.module = module
        self.observers = Observers()
        for observer in observers:  # attached first, they also see the buffers sharding creates
            self.observers.attach(observer)
        first = next(iter(module.parameters()), None)
        self.device = torch.device(device) if device is not None else (
            first.device if first is not None and not first.is_meta else torch.device("cpu"))
        self.comm = Collectives(group, collective, record=record_collectives, observers=self.observers,
                                streams=CudaStreams.for_device(self.device, overlap))
        if len(shares) != self.comm.world_size:
            raise ValueError(
                f"{len(shares)} state shares for a world of {self.comm.world_size} ranks: give one share per rank"
            )
        unit_groups = self._unit_groups(units)
        check_units_disjoint(unit_groups)
        self.unit_modules: list[nn.Module] = [g[0] if len(g) == 1 else nn.ModuleList(g) for g in unit_groups]
        self.unit_groups = unit_groups
        slot_groups = _group_slots(module, unit_groups)
        names = [ROOT] + [_unit_name(module, g) for g in unit_groups]
        spans_per_unit = []
        for slots in slot_groups:
            spans, offset = [], 0
            for slot in slots:
                p = slot.current
                spans.append(ParamSpan(slot.name, tuple(p.shape), offset, p.numel()))
                offset += p.numel()
            spans_per_unit.append(spans)
        self.layout: ShardLayout = build_layout(
            [sum(s.numel for s in spans) for spans in spans_per_unit], list(shares), names, spans_per_unit,
        )
        self.reduce_dtype = reduce_dtype
        materializer = materializer or UnitMaterializer(self.device)
        buffers = self._buffers_by_unit(unit_groups)
        self.units: list[FlatUnit] = []
        for index, (unit, slots) in enumerate(zip(self.layout.units, slot_groups)):
            originals = [slot.current for slot in slots]
            dtype = originals[0].dtype if originals else torch.float32
            master_dtype = torch.promote_types(dtype, torch.float32)  # fp64 stays fp64
            master = materializer.master(index, unit, slots, self.comm.rank, master_dtype, buffers[index])
            self.units.append(FlatUnit(unit, slots, self.comm.rank, master, [p.requires_grad for p in originals],
                                       compute_dtype or dtype, self.observers))
        self.materialized_units = materializer.materialized_units
        self.root = self.units[0]
        self.prefetch = prefetch
        self.state = TrainingState.HOOKS
        self._sync = True
        self._next_reduce = len(self.units) - 1
        self._ready: set[int] = set()
        self._grad_counts = [0] * len(self.units)
        self._expected = [sum(u.requires_grad) for u in self.units]
        self._backward_gathered: set[int] = set()
        self._handles: list[Any] = []
        if hooks:
            self._install_hooks()

    def _unit_groups(self, units: WrapPolicy | Units) -> list[list[nn.Module]]:
        if units is not None and all(isinstance(u, (list, tuple)) for u in units) and units:
            return [list(g) for g in units]
        return [[m] for m in find_units(self.module, units)]  # type: ignore[arg-type]

    def _buffers_by_unit(self, unit_groups: list[list[nn.Module]]) -> list[list[tuple[str, nn.Module, str]]]:
        """Every buffer as (name, module, attr), grouped by the unit whose modules hold it (root: 0)."""
        unit_of_module: dict[int, int] = {}
        for index, group in enumerate(unit_groups, start=1):
            for top in group:
                for mod in top.modules():
                    unit_of_module.setdefault(id(mod), index)
        out: list[list[tuple[str, nn.Module, str]]] = [[] for _ in range(len(unit_groups) + 1)]
        for mod_name, mod in self.module.named_modules():  # each module once
            for attr, buf in mod._buffers.items():
                if buf is not None:
                    out[unit_of_module.get(id(mod), 0)].append((f"{mod_name}.{attr}" if mod_name else attr, mod, attr))
        return out

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
        for index, group in enumerate(self.unit_groups, start=1):
            # every module of a group gathers its unit for a plain forward (evaluation); a group's
            # backward is driven by its schedule, so only single-module units follow autograd
            for module in group:
                self._handles.append(module.register_forward_pre_hook(self._make_pre_forward(index)))
                self._handles.append(module.register_forward_hook(self._make_post_forward(index, len(group) == 1)))
        for index, unit in enumerate(self.units):
            for param, rg in zip(unit.full_params, unit.requires_grad):
                if rg:
                    self._handles.append(param.register_post_accumulate_grad_hook(self._make_post_accumulate(index)))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def _in_state(self, state: TrainingState) -> Iterator[None]:
        previous, self.state = self.state, state
        try:
            yield
        finally:
            self.state = previous

    def scheduled(self) -> contextlib.AbstractContextManager[None]:
        """For schedules that gather, free and reduce the units themselves: the hooks stand aside."""
        return self._in_state(TrainingState.SCHEDULED)

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if self.state is TrainingState.HOOKS:
            self.gather_root()

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.state is TrainingState.HOOKS and not torch.is_grad_enabled():  # evaluation: no backward will free it
            self.root.free()

    def _make_pre_forward(self, index: int):
        def hook(module: nn.Module, args: Any) -> None:
            if self.state is not TrainingState.HOOKS:
                return
            self.gather_root()
            self.units[index].gather(self.comm)
            if self.prefetch and index + 1 < len(self.units):
                self.units[index + 1].start_gather(self.comm)
            if self.observers:
                for observer in self.observers:
                    observer.compute_begin("unit_forward")

        return hook

    def _make_post_forward(self, index: int, follows_autograd: bool):
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self.state is not TrainingState.HOOKS:
                return output
            if self.observers:
                for observer in reversed(list(self.observers)):
                    observer.compute_end("unit_forward")
            self.units[index].free()
            if follows_autograd and torch.is_grad_enabled():
                for tensor in tensors_in(output):
                    if tensor.requires_grad:
                        tensor.register_hook(self._make_pre_backward(index))
            return output

        return hook

    def _make_pre_backward(self, index: int):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if self.state is TrainingState.HOOKS and index not in self._backward_gathered:
                self._backward_gathered.add(index)
                self.units[index].gather(self.comm)
                if self.prefetch and index - 1 >= 1:
                    self.units[index - 1].start_gather(self.comm)
                if self.observers:
                    for observer in self.observers:
                        observer.compute_begin("unit_backward")
            return grad

        return hook

    def _make_post_accumulate(self, index: int):
        def hook(param: torch.Tensor) -> None:
            if self.state is not TrainingState.HOOKS:
                return
            self._grad_counts[index] += 1
            if self._grad_counts[index] == self._expected[index]:
                self._unit_backward_done(index)

        return hook

    def _unit_backward_done(self, index: int) -> None:
        self._grad_counts[index] = 0
        if index != 0:
            if self.observers and index in self._backward_gathered:
                for observer in reversed(list(self.observers)):
                    observer.compute_end("unit_backward")
            self.units[index].free()
        self._ready.add(index)
        self._flush_reductions(all_units=False)

    # ------------------------------------------------------------------ gradients

    def set_requires_gradient_sync(self, sync: bool) -> None:
        """False while accumulating micro-batches: full gradients stay local, nothing is reduced."""
        self._sync = sync

    def _flush_reductions(self, all_units: bool) -> None:
        """Reduce ready units strictly from the last to the first (same order on every rank).

        With ``all_units`` every remaining unit is reduced whether or not autograd reached it (a
        unit no gradient flowed into contributes zeros).
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

        Units without trainable parameters are skipped (on every rank alike). On CUDA the
        reduction overlaps the compute stream; :meth:`wait_reductions` joins it.
        """
        if not unit.trainable:
            return
        full_grad = unit.take_full_grad(self.reduce_dtype)
        self.comm.reduce_scatter_into(full_grad, unit.layout, unit.add_local_grad)

    def wait_reductions(self) -> None:
        """The gradients of every reduced unit are ready for the optimizer (a no-op on CPU)."""
        self.comm.wait_reductions([p.grad for p in self.parameters() if p.grad is not None])

    def gather_root(self) -> None:
        if not self.root.gathered:
            self.root.gather(self.comm)

    def finish_backward(self) -> None:
        """End of one micro-batch's backward: reduce what is left, in order; free the root."""
        self._flush_reductions(all_units=True)
        self._next_reduce = len(self.units) - 1
        self._ready.clear()
        self._grad_counts = [0] * len(self.units)
        if self.observers:
            for index in self._backward_gathered:
                if self.units[index].gathered:  # a unit autograd never finished (no gradient reached it)
                    for observer in reversed(list(self.observers)):
                        observer.compute_end("unit_backward")
        self._backward_gathered.clear()
        for unit in self.units[1:]:
            if unit.gathered or unit.pending is not None:
                unit.free()
        if self._sync:
            self.root.free()
            self.wait_reductions()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.finish_backward()

    def free_all(self) -> None:
        """Release every gathered buffer (after an evaluation forward, say)."""
        for unit in self.units:
            unit.free()

    def grad_norm_sq(self, norm_type: float = 2.0) -> torch.Tensor:
        """This rank's share of the gradient norm: sum |g|^p over its pieces (max |g| for inf), fp64."""
        return local_grad_norm(self.parameters(), norm_type, self.device)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of the WHOLE model's gradient, summed across the uneven shards."""
        return clip_grad_norm_(self.parameters(), max_norm, norm_type, self.comm)

    # ------------------------------------------------------------------ full parameters

    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Every unit gathered, the modules holding full parameters, the hooks off (e.g. for a
        plain forward of the whole model); gradients computed inside are dropped."""
        for unit in self.units:
            unit.gather(self.comm)
        try:
            with self._in_state(TrainingState.SUMMONED):
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
        with self._in_state(TrainingState.SUMMONED):
            self.gather_root()
            unit = self.units[index]
            unit.gather(self.comm)
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
            self.comm.all_gather(unit.master, full, unit.layout).wait()
            for span in unit.spans:
                out[span.name] = full[span.offset : span.offset + span.numel].view(span.shape).clone()
        return out

    # ------------------------------------------------------------------ re-sharding

    @torch.no_grad()
    def reshard(self, shares: Sequence[float], optimizers: Sequence[torch.optim.Optimizer] = ()) -> ShardLayout:
        """Collective: move every rank's state onto the layout of new ``shares``, in place.

        Each unit's master shard, and every optimizer-state tensor shaped like the pieces, moves
        by the overlap of the old and new ranges (one ``all_to_all_single`` per unit and tensor,
        no full gather, no disk); the optimizers' parameter groups and state are re-keyed to the
        new local pieces. Peak memory: old share + new share (one unit's state in flight).
        """
        if len(shares) != self.world_size:
            raise ValueError(f"{len(shares)} shares for a world of {self.world_size} ranks")
        if any(u.gathered or u.pending is not None for u in self.units):
            raise RuntimeError("reshard() between steps only: some units are gathered")
        new_layout = build_layout([u.numel for u in self.layout.units], list(shares),
                                  [u.name for u in self.layout.units], [u.params for u in self.layout.units])
        index_of = {id(p): (opt, gi, pi) for opt in optimizers for gi, g in enumerate(opt.param_groups)
                    for pi, p in enumerate(g["params"])}
        for unit, new_unit in zip(self.units, new_layout.units):
            old_unit = unit.layout
            send, receive = _overlaps(old_unit, new_unit, self.rank)
            lo, hi = new_unit.shard_range(self.rank)
            master = torch.empty(hi - lo, dtype=unit.master.dtype, device=unit.device)
            self.comm.move(unit.master, master, send, receive, name=unit.name)
            old_pieces = list(unit.local_params)
            moved_state = self._move_optimizer_state(unit, old_pieces, old_unit, new_unit, send, receive, optimizers)
            unit.relayout(new_unit, master)
            for old, new, state in zip(old_pieces, unit.local_params, moved_state):
                for opt, key_state in state.items():
                    opt.state.pop(old, None)
                    opt.state[new] = key_state
                if id(old) in index_of:
                    opt, gi, pi = index_of[id(old)]
                    opt.param_groups[gi]["params"][pi] = new
        self.layout = new_layout
        return new_layout

    def _move_optimizer_state(
        self, unit: FlatUnit, pieces: list[nn.Parameter], old: UnitLayout, new: UnitLayout,
        send: list[int], receive: list[int], optimizers: Sequence[torch.optim.Optimizer],
    ) -> list[dict[torch.optim.Optimizer, dict[str, Any]]]:
        """Every optimizer's per-piece state, moved to the new layout like the master shard.

        State tensors shaped like the piece (Adam's moments, momentum) move; everything else
        (Adam's ``step``) is the same for every piece of a parameter and stays.
        """
        out: list[dict[torch.optim.Optimizer, dict[str, Any]]] = [{} for _ in pieces]
        new_lo, new_hi = new.shard_range(self.rank)
        for opt in optimizers:
            members = {id(p) for group in opt.param_groups for p in group["params"]}
            inside = [id(p) in members and p.requires_grad for p in pieces]
            states = [opt.state.get(p, {}) if ins else {} for p, ins in zip(pieces, inside)]
            shaped = [{k for k, v in st.items() if torch.is_tensor(v) and k != "step" and v.shape == p.shape}
                      for p, st, ins in zip(pieces, states, inside) if ins]
            agreed = _agree(shaped, self.comm, unit.name)
            for key in agreed:
                flat = torch.cat([st[key].reshape(-1) if ins else p.detach().new_zeros(p.numel())
                                  for p, st, ins in zip(pieces, states, inside)]) if pieces else unit.master.new_zeros(0)
                moved = torch.empty(new_hi - new_lo, dtype=flat.dtype, device=flat.device)
                self.comm.move(flat, moved, send, receive, name=f"{unit.name}:{key}")
                for index, span in enumerate(new.params):
                    if inside[index]:
                        a, b = new.param_piece(span, self.rank)
                        start = span.offset + a - new_lo
                        out[index].setdefault(opt, {})[key] = moved[start : start + b - a].view(piece_shape(span.shape, b - a)).clone()
            for index, st in enumerate(states):
                for key, value in st.items():
                    if key not in agreed:
                        out[index].setdefault(opt, {})[key] = value
        return out


@torch.no_grad()
def local_grad_norm(parameters: Iterable[nn.Parameter], norm_type: float = 2.0,
                    device: torch.device | None = None) -> torch.Tensor:
    """sum |g|^p over the gradients of ``parameters`` (max |g| for ``inf``), in fp64."""
    grads = [p.grad for p in parameters if p.grad is not None and p.grad.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    if norm_type == math.inf:
        return torch.stack([g.abs().max().double() for g in grads]).max()
    return sum((g.double().abs().pow(norm_type).sum() for g in grads), torch.zeros((), dtype=torch.float64, device=grads[0].device))


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0,
                    comm: Collectives | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters that are every rank's disjoint shards.

    Each element of the model is owned by exactly one rank, so the global norm is the all-reduce
    (sum, or max for ``inf``) of every rank's local figure.
    """
    params = [p for p in parameters]
    comm = comm or Collectives()
    # a rank whose pieces are all empty (share 0) still reduces a tensor on the collective's device
    local = local_grad_norm(params, norm_type, params[0].device if params else None).clone()
    if norm_type == math.inf:
        total = comm.all_reduce_max(local)
    else:
        total = comm.all_reduce_sum(local).pow(1.0 / norm_type)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
    return total


def _overlaps(old: UnitLayout, new: UnitLayout, rank: int) -> tuple[list[int], list[int]]:
    """Split sizes moving ``rank``'s old range to every rank's new range, and back.

    Both layouts cut the unit into consecutive ranges in rank order, so what rank r sends to
    ranks 0..W-1 are consecutive pieces of its old range, and what it receives from them are
    consecutive pieces of its new range: the buffers need no copying.
    """
    def overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
        return max(0, min(a[1], b[1]) - max(a[0], b[0]))

    world = old.world_size
    send = [overlap(old.shard_range(rank), new.shard_range(q)) for q in range(world)]
    receive = [overlap(old.shard_range(q), new.shard_range(rank)) for q in range(world)]
    return send, receive


def _agree(per_piece: list[set[str]], comm: Collectives, unit: str) -> list[str]:
    """The optimizer-state keys every trainable piece of the unit has, on every rank.

    Every rank must move the same tensors: a key some pieces have and others lack (state created
    lazily, say) cannot be moved consistently, and every rank raises alike.
    """
    local = (sorted(set.union(*per_piece)) if per_piece else [], sorted(set.intersection(*per_piece)) if per_piece else None)
    everyone = gather_objects(local, comm.group)
    union = {k for any_keys, _ in everyone for k in any_keys}
    common = [set(all_keys) for _, all_keys in everyone if all_keys is not None]
    complete = set.intersection(*common) if common else set()
    if union != complete:
        raise RuntimeError(
            f"unit {unit}: optimizer state {sorted(union - complete)} exists for some parameters but not others "
            "(created lazily?); take one optimizer step before re-sharding"
        )
    return sorted(union)
