"""What a callback may ask of the strategy: the one door from CephaloCallback into a fit's runtime."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from cephalo_lightning.planner import Cluster, Plan
from cephalo_lightning.runtime.sharding.frozen_storage import stored_bytes_per_element

if TYPE_CHECKING:
    import torch

    from cephalo_lightning.lightning.fit.fit_runtime import FitRuntime
    from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator
    from cephalo_lightning.runtime.emulation.memory import MemoryTracker


class CallbackAPI:
    """Mixed into :class:`~.strategy.CephaloStrategy`; the callback side is typed against this class,
    never the strategy (which imports the callback).

    [Note: what a callback may ask of the strategy] Everything CephaloCallback reads or changes
    goes through the methods below and the strategy's public attributes declared here (``plan``,
    ``cluster``, ``emulator``, ``global_batch_size``, ``param_dtype``, ``collective``, ``memory``,
    ``offloads_stash``, ``root_device``, ``world_size``, ``broadcast``, ``adopt_plan``,
    ``schedule_plan``). These methods alone reach the fit's runtime, through :meth:`_fit_runtime`.
    The attributes are declared only (no values): the strategy and its Lightning bases define them.
    """

    fit_runtime: FitRuntime | None
    plan_follows: bool
    cluster: Cluster | None
    plan: Plan | None
    emulator: DeviceEmulator
    global_batch_size: int | None
    param_dtype: str | None
    collective: str
    memory: MemoryTracker | None
    offloads_stash: bool
    root_device: torch.device
    world_size: int
    broadcast: Callable[..., Any]
    schedule_plan: Callable[[Plan], tuple[int, int]]

    def adopt_plan(self, plan: Plan) -> None:  # the strategy's own; declared for the reader and type checkers
        raise NotImplementedError

    def _fit_runtime(self) -> FitRuntime:
        """The fit's runtime, built at setup: the one accessor of the callbacks' API."""
        assert self.fit_runtime is not None, "the callbacks' API is used after the strategy's setup"
        return self.fit_runtime

    def expect_plan(self) -> None:
        """Before setup: a plan follows after setup (:meth:`adopt_profiled_plan`), so shard
        provisionally, in proportion to each rank's memory (a small device is not handed an even
        share it cannot hold)."""
        self.plan_follows = True

    def adopt_profiled_plan(self, plan: Plan, cluster: Cluster) -> None:
        """Collective: adopt ``plan``, made from the freshly profiled ``cluster``; re-shards at once."""
        self.cluster = cluster
        self.adopt_plan(plan)

    def frozen_bytes_per_param(self) -> float | None:
        """Bytes a frozen parameter's storage holds per element in this fit's sharded model (the same
        on every rank), None where no parameter is frozen."""
        parts = [unit.frozen for unit in self._fit_runtime().sharded.units if unit.frozen is not None]
        if not parts:
            return None
        numel = sum(part.layout.numel for part in parts)  # the mean over every frozen element, as stored
        return sum(part.part_bytes() for part in parts) / numel if numel else stored_bytes_per_element(
            parts[0].kind, parts[0].compute_dtype)

    @property
    def fit_mode(self) -> str:
        """The mode the model is sharded for: ``"layered"`` or ``"uniform"``."""
        return self._fit_runtime().schedule

    @property
    def layered_form(self) -> Any:
        """The model's :class:`~cephalo_lightning.models.protocol.LayeredModel` in the layered mode, else None
        (also for a discovered block sequence before the first step has checked it)."""
        layered = self._fit_runtime().layered_model
        if layered is not None and layered.discovery is not None and layered.discovery.structure is None:
            return None
        return layered

    @property
    def why_not_layered(self) -> str | None:
        """Why the model has no layered form (None when it has one)."""
        layered = self._fit_runtime().layered_model
        if layered is not None and layered.discovery is not None and layered.discovery.structure is None:
            return (f"{layered.name}: the block sequence is checked on the first training step, so it cannot be "
                    "profiled before")
        return self._fit_runtime().resolution.reason

    @contextlib.contextmanager
    def gathered_layer(self, index: int) -> Generator[None, None, None]:
        """Collective: layer ``index`` of :attr:`layered_form` gathered on every rank (its unit and
        the root), hooks off, e.g. to profile it in place."""
        with self._fit_runtime().sharded.unit_gathered(index + 1):  # unit 0 is the root
            yield

    @contextlib.contextmanager
    def gathered_model(self) -> Generator[None, None, None]:
        """Collective: every unit gathered, the modules holding full parameters (the uniform mode's profile)."""
        with self._fit_runtime().sharded.summon_full_params():
            yield

    def attach_observer(self, observer: Any, outermost: bool = False) -> None:
        """Attach a :class:`~cephalo_lightning.runtime.observers.Observer` to the sharded model's
        compute and collectives (``outermost``: around every other observer, e.g. to time them)."""
        self._fit_runtime().sharded.observers.attach(observer, outermost=outermost)

    def detach_observer(self, observer: Any) -> None:
        self._fit_runtime().sharded.observers.detach(observer)
