"""``Fabric(strategy="cephalo")``: the uniform mode under Lightning Fabric's own training loop.

:class:`CephaloFabricStrategy` shards the model unevenly by the plan's state shares
(:class:`~cephalo_lightning.runtime.sharding.sharded_model.ShardedModel`, its hooks gathering each
unit around its forward and backward) and gives every rank its own slice of every global batch
(:mod:`cephalo_lightning.runtime.sampler`). The user's loop stays Fabric's::

    fabric = Fabric(strategy=CephaloFabricStrategy(plan="plan.json"), devices=4)
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=B))  # B: the global batch
    for x, y in loader:                 # this rank's b_r samples
        loss = loss_fn(model(x), y)     # the mean over the rank's b_r samples
        fabric.backward(loss)           # scaled by b_r / B, then reduce-scattered
        optimizer.step(); optimizer.zero_grad()

[Note: loss weighting] The reduce-scatter SUMS the ranks' gradients. With per-rank batch sizes b_r,
each rank's mean loss must count b_r / B of the global mean for the sum to be the gradient of the
global batch's mean loss (what one process training on the whole batch computes), so
``fabric.backward`` multiplies the loss by :attr:`CephaloFabricStrategy.loss_weight` (b_r / B).
A loss that is not a per-sample mean (a per-token mean over uneven padding, say) is weighted by
the user: ``scale_loss=False`` and multiply by the rank's share of the global items yourself.

Boundaries, refused with the reason: the layered mode (its schedule runs the model's layers and
owns the forward and backward loop, which under Fabric is the user's), precisions other than
``32-true`` and ``bf16-mixed`` (a loss scaler would skip steps rank by rank), checkpoints
under another plan (``fabric.save`` writes each rank's own shard; the Trainer's checkpoints reshard),
and ``fabric.save`` / ``fabric.load`` of a model whose base is stored as NF4 (its pieces hold no
values; the Trainer's checkpoints store the blocks).

Frozen parameters (``requires_grad=False``) are stored as the Trainer's strategy stores them:
``base_storage="compute"`` keeps them in the compute dtype (bf16 under ``bf16-mixed``, where the
trainable ones stay fp32), ``"nf4"`` as 4-bit NF4 blocks (QLoRA, the ``qlora`` extra).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from cephalo_lightning._common.errors import ConfigurationError, UnsupportedError
from cephalo_lightning._common.vocabulary import AUTO, BaseStorage, Collective, CollectiveChoice, Schedule, member_of
from cephalo_lightning.lightning._private import BackwardSyncControl, user_sampler
from cephalo_lightning.lightning.fit.plan_resolution import check_loader_batch, data_seed
from cephalo_lightning.lightning.steps.schedules import refuse_idle, refuse_pipelined
from cephalo_lightning.lightning.strategy_config import COLLECTIVES, BaseStorageChoice, base_storage_of, check_flag
from cephalo_lightning.planner import Plan
from cephalo_lightning.runtime.collectives import resolve_mode
from cephalo_lightning.runtime.plan_state import PlanState
from cephalo_lightning.runtime.sampler import planned_loader, shuffles
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

CHECKPOINT_FORMAT = "cephalo-fabric/1"
PRECISIONS = ("32-true", "bf16-mixed")


class CephaloFabricStrategy(DDPStrategy):
    """Fabric strategy: uneven state shares and per-rank batches of ``plan`` (uniform mode).

    ``plan``: a uniform :class:`~cephalo_lightning.planner.Plan` or its JSON path; ``None`` with
    ``global_batch_size``: an even plan. ``units``: the wrap policy (module classes; default the
    largest ``nn.ModuleList``). ``scale_loss``: ``fabric.backward`` weights the loss by b_r / B
    (see the module note). ``seed``: the data order's (default rank 0's torch seed). ``base_storage``:
    how frozen parameters are stored, sharded and gathered (``compute`` or ``nf4``, see the module).
    """

    def __init__(self, plan: Plan | str | Path | None = None, global_batch_size: int | None = None, *,
                 units: Sequence[type[nn.Module]] | None = None, collective: CollectiveChoice = AUTO, prefetch: bool = True,
                 scale_loss: bool = True, seed: int | None = None, base_storage: BaseStorageChoice = "compute",
                 **kwargs: Any) -> None:
        owner = "CephaloFabricStrategy"
        if kwargs.pop("fault_tolerance", False):  # CephaloStrategy's option, refused here by name
            raise UnsupportedError(
                f"{owner}(fault_tolerance=True): Fabric runs every rank in one process group and the uniform mode, so a "
                "lost rank ends the whole job; fault tolerance needs one process group per shard group, each its own "
                "job: drive cephalo_lightning.lightning.fit.fault_tolerance.ReplicaGroup from a plain loop "
                "(docs/fault-tolerance.md)")
        super().__init__(**kwargs)
        for name, flag in (("prefetch", prefetch), ("scale_loss", scale_loss)):
            check_flag(name, flag, owner=owner)
        if collective not in COLLECTIVES:
            raise ConfigurationError(f"{owner}(collective={collective!r}): choose one of {', '.join(map(repr, COLLECTIVES))}")
        if plan is not None and not isinstance(plan, (Plan, str, os.PathLike)):
            raise ConfigurationError(f"{owner}(plan={plan!r}) must be a Plan or the path of a plan JSON file")
        self.plan: Plan | None = Plan.load(plan) if isinstance(plan, (str, os.PathLike)) else plan
        if self.plan is not None:
            _check_plan(self.plan, global_batch_size)
        self._global_batch_size = global_batch_size if self.plan is None else self.plan.global_batch_size
        self.units = tuple(units) if units is not None else None
        self.collective = member_of(Collective, collective)  # or AUTO, resolved by the backend at setup
        self.prefetch = prefetch
        self.scale_loss = scale_loss
        self.seed = seed
        self.base_storage = base_storage_of(base_storage, owner)
        self.sharded: ShardedModel | None = None
        self._backward_sync_control = _ShardedBackwardSync(self)

    @property
    def loss_weight(self) -> float:
        """This rank's share of the global batch, b_r / B: what ``fabric.backward`` scales the loss by."""
        plan = self._plan()
        return plan.ranks[self.global_rank].batch_size / plan.global_batch_size

    def _plan(self, loader_batch: int | None = None) -> Plan:
        """The plan in force; without one, an even plan of ``global_batch_size`` or the loader's batch."""
        if self.plan is None:
            batch = self._global_batch_size or loader_batch
            if batch is None:
                raise ConfigurationError("CephaloFabricStrategy has no plan yet: give plan=... or global_batch_size=B, "
                                         "or set up the training dataloader (its batch_size is the global batch) first")
            self.plan = Plan.even(self.world_size, batch, mode=Schedule.UNIFORM)
        if self.plan.world_size != self.world_size:
            raise ConfigurationError(f"the plan is for {self.plan.world_size} ranks but Fabric runs {self.world_size}: "
                                     f"re-plan for {self.world_size} devices or launch {self.plan.world_size}")
        return self.plan

    # --------------------------------------------------------------------------- model and optimizers

    @override
    def setup_environment(self) -> None:
        name = getattr(self.precision, "precision", None)
        if name not in PRECISIONS:  # before any process group exists
            raise UnsupportedError(
                f"CephaloFabricStrategy supports precision {' or '.join(map(repr, PRECISIONS))}, not {name!r}: a loss "
                "scaler (16-mixed) decides on each rank alone whether to skip a step, and sharded state in 16-bit "
                "loses updates; use Fabric(precision='bf16-mixed') or '32-true'")
        super().setup_environment()
        if self.plan is not None or self._global_batch_size is not None:
            self._describe(self._plan())

    def _describe(self, plan: Plan) -> None:
        if not self.is_global_zero:
            return
        rank_zero_info(f"Cephalo (Fabric): batches {list(plan.batch_sizes)} of {plan.global_batch_size}, state shares "
                 f"{[round(s, 4) for s in plan.state_shares]}; fabric.backward weights each rank's loss by its batch")
        if any(r.num_micro_batches > 1 for r in plan.ranks):
            rank_zero_info("Cephalo (Fabric): the plan's micro-batches are not applied, your loop runs each rank's batch in "
                     "one forward (split it under fabric.no_backward_sync(model) if it does not fit)")

    def _state_shares(self) -> list[float]:
        """The plan's shares; with no plan yet, an even plan's (which any batch size gives)."""
        plan = self.plan if self.plan is not None else Plan.even(self.world_size, self.world_size, mode=Schedule.UNIFORM)
        return list(plan.state_shares)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` in place by the plan's state shares; its parameters become this rank's pieces."""
        if self.sharded is not None:
            raise UnsupportedError("CephaloFabricStrategy shards one model per Fabric: set up one model, or use "
                                   "one Fabric per model")
        # bf16-mixed: the frozen parameters in bf16 (autocast's dtype), the trainable ones fp32
        frozen_dtype = torch.bfloat16 if getattr(self.precision, "precision", None) == "bf16-mixed" else None
        self.sharded = ShardedModel(module, self._state_shares(), units=self.units,
                                    collective=resolve_mode(self.collective), prefetch=self.prefetch,
                                    device=self.root_device, base=self.base_storage, frozen_dtype=frozen_dtype)
        return module

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
                                    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """Optimizers made before sharding are pointed at the local pieces of their parameters."""
        names = {id(p): name for name, p in module.named_parameters()}
        for optimizer in optimizers:
            if optimizer.state:
                raise UnsupportedError("fabric.setup(model, optimizer): the optimizer has state already (it stepped); "
                                       "set it up before training, or make it after fabric.setup(model)")
            unknown = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
            if unknown:
                raise ConfigurationError(f"fabric.setup(model, optimizer): the optimizer holds {len(unknown)} tensors "
                                         "that are not parameters of the model; build it from model.parameters()")
        module = self.setup_module(module)
        local = dict(module.named_parameters())
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [local[names[id(p)]] for p in group["params"]]
        return module, optimizers, scheduler

    @override
    def module_to_device(self, module: nn.Module) -> None:
        module.to(self.root_device)

    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """The loss weighted by b_r / B (see the module note), then every unit's gradient reduce-scattered."""
        sharded = self._sharded()
        tensor = tensor * self.loss_weight if self.scale_loss else tensor
        self.precision.pre_backward(tensor, module)
        self.precision.backward(tensor, module, *args, **kwargs)
        sharded.finish_backward()
        self.precision.post_backward(tensor, module)

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """By the norm of the whole model's gradient, summed over the uneven shards."""
        self.precision.unscale_gradients(optimizer)
        norm = self._sharded().clip_grad_norm_(float(max_norm), float(norm_type))
        if error_if_nonfinite and not bool(torch.isfinite(norm)):  # the global norm: every rank alike
            raise RuntimeError(f"the total norm of the gradients is {float(norm)}: a loss or gradient went non-finite "
                               "(pass error_if_nonfinite=False to clip anyway)")
        return norm

    def _sharded(self) -> ShardedModel:
        if self.sharded is None:
            raise ConfigurationError("no model is set up: call fabric.setup(model, optimizer) first")
        return self.sharded

    # --------------------------------------------------------------------------- data

    @property
    @override
    def distributed_sampler_kwargs(self) -> None:
        return None  # Fabric then keeps the loader's sampler; process_dataloader cuts the batches

    @override
    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        """Every rank its slice of every global batch (the loader's ``batch_size``) of one order."""
        described = self.plan is not None
        plan = self._plan(dataloader.batch_size)
        if not described:
            self._describe(plan)
        check_loader_batch(dataloader.batch_size, plan, None)
        seed = data_seed(self.seed, os.environ)
        if seed is None:  # one order on every rank: rank 0's
            seed = int(self.broadcast(torch.initial_seed() % 2**31))
        return planned_loader(dataloader, PlanState(plan), self.global_rank, shuffle=shuffles(dataloader), seed=seed,
                              sampler=user_sampler(dataloader.sampler))

    # --------------------------------------------------------------------------- checkpoints

    @override
    def save_checkpoint(self, path: str | Path, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """``path`` becomes a directory with one file per rank: its model pieces, its optimizer state
        and the other entries (on every rank alike). Loads back under the same plan."""
        if storage_options is not None or filter is not None:
            raise UnsupportedError("CephaloFabricStrategy.save_checkpoint: storage_options and filter are not supported")
        self._check_checkpointable("fabric.save")
        folder = Path(self.broadcast(str(path)))
        converted = {key: self._saved(key, value) for key, value in state.items()}
        if self.is_global_zero:
            folder.mkdir(parents=True, exist_ok=True)
        self.barrier()
        torch.save({"format": CHECKPOINT_FORMAT, "state_shares": self._state_shares(), "state": converted},
                   _rank_file(folder, self.global_rank, self.world_size))
        self.barrier()

    def _check_checkpointable(self, what: str) -> None:
        if self.sharded is not None and self.base_storage is not BaseStorage.COMPUTE:
            raise UnsupportedError(
                f"{what}: a Fabric checkpoint holds each rank's parameter pieces, and a base stored as "
                f"{self.base_storage} holds none (its blocks live in the storage): save the trainable parameters "
                "yourself, or train under the Trainer's CephaloStrategy, whose checkpoints store the blocks")

    def _saved(self, key: str, value: Any) -> Any:
        if isinstance(value, nn.Module):
            if value is not self._sharded().module:
                raise UnsupportedError(f"fabric.save: {key!r} is not the model set up with this strategy")
            return {name: p.detach().clone() for name, p in self._sharded().named_parameters()}
        if isinstance(value, DataLoader):
            raise UnsupportedError(f"fabric.save: {key!r} is a DataLoader; under CephaloFabricStrategy its position "
                                   "is not tracked (your loop owns it): save the step and skip to it on resume")
        if isinstance(value, Optimizer) or hasattr(value, "state_dict"):
            return value.state_dict()
        return value

    @override
    def load_checkpoint(self, path: str | Path, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if not isinstance(state, dict):
            raise UnsupportedError("CephaloFabricStrategy loads into a state dict: fabric.load(path, {'model': model, "
                                   "'optimizer': optimizer, ...}), not fabric.load_raw or a bare object")
        self._check_checkpointable("fabric.load")
        folder = Path(self.broadcast(str(path)))
        file = _rank_file(folder, self.global_rank, self.world_size)
        if not file.is_file():
            raise ConfigurationError(f"fabric.load({str(folder)!r}): no {file.name} there: the checkpoint was written by "
                                     f"another number of ranks, or is not a CephaloFabricStrategy checkpoint directory")
        saved = torch.load(file, map_location=self.root_device, weights_only=True if weights_only is None else weights_only)
        shares = self._state_shares()
        if saved.get("format") != CHECKPOINT_FORMAT or saved["state_shares"] != shares:
            raise ConfigurationError(
                f"fabric.load({str(folder)!r}): written under state shares {saved.get('state_shares')}, this run has "
                f"{shares}: load under the same plan (Fabric checkpoints hold each rank's own shard)")
        entries = saved["state"]
        missing = [k for k in state if k not in entries]
        if strict and missing:
            raise KeyError(f"fabric.load: the checkpoint has no {missing}; pass strict=False to skip them")
        for key in [k for k in state if k in entries]:
            self._load_entry(state, key, entries.pop(key))
        return entries

    def _load_entry(self, state: dict[str, Any], key: str, saved: Any) -> None:
        value = state[key]
        if isinstance(value, nn.Module):
            with torch.no_grad():
                for name, piece in self._sharded().named_parameters():
                    piece.copy_(saved[name])
        elif isinstance(value, Optimizer) or hasattr(value, "load_state_dict"):
            value.load_state_dict(saved)
        else:
            state[key] = saved


class _ShardedBackwardSync(BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: gradients accumulate unreduced until a backward outside it."""

    def __init__(self, strategy: CephaloFabricStrategy) -> None:
        self.strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return self._unsynced() if enabled else contextlib.nullcontext()

    @contextlib.contextmanager
    def _unsynced(self) -> Generator[None, None, None]:
        sharded = self.strategy._sharded()
        sharded.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            sharded.set_requires_gradient_sync(True)


def _check_plan(plan: Plan, global_batch_size: int | None) -> None:
    refuse_pipelined(plan, "CephaloFabricStrategy")
    refuse_idle(plan, "CephaloFabricStrategy")
    if plan.mode != Schedule.UNIFORM:
        raise UnsupportedError(
            "CephaloFabricStrategy runs uniform plans: the layered schedule runs the model's layers itself and owns "
            "the forward and backward loop, which under Fabric is yours. Plan with mode='uniform' "
            "(cephalo plan --mode uniform), or use Trainer(strategy=CephaloStrategy(...)) for the layered mode")
    if plan.num_shard_groups > 1:  # its shares sum to 1 per group: as one group they would be re-normalised
        raise UnsupportedError(
            f"CephaloFabricStrategy shards over one group of every rank; this plan has {plan.num_shard_groups} shard "
            f"groups {[list(g) for g in plan.shard_groups]}: plan with groupings=('full',) "
            "(cephalo plan --groupings full), or use Trainer(strategy=CephaloStrategy(...)) for shard groups")
    if global_batch_size not in (None, plan.global_batch_size):
        raise ConfigurationError(f"global_batch_size={global_batch_size} but the plan is for {plan.global_batch_size}: "
                                 "drop one")


def _rank_file(folder: Path, rank: int, world_size: int) -> Path:
    return folder / f"rank{rank}-of-{world_size}.pt"
