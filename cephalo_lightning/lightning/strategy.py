"""``Trainer(strategy="cephalo")``: Lightning plumbing over the Cephalo runtime.

The strategy resolves the plan (:mod:`.planning`) and delegates the fit to a
:class:`~.training.FitRuntime` (sharding, steps, plan switches, checkpoints) and the data to
:mod:`.runtime.sampler` (every rank its slice of every global batch).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Generator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from cephalo_lightning.lightning import loggers
from cephalo_lightning.lightning import plan_resolution as planning
from cephalo_lightning.lightning._private import logging_as, sync_ddp_if_available
from cephalo_lightning.lightning.config import StrategyConfig
from cephalo_lightning.lightning.fit import FailureReport, FitRuntime, decide_mode
from cephalo_lightning.lightning.precision import sharded_precision
from cephalo_lightning.lightning.process_group import ProcessGroupStrategy
from cephalo_lightning.models import resolve
from cephalo_lightning.planner import Cluster, Plan
from cephalo_lightning.runtime import checkpoint
from cephalo_lightning.runtime.collectives import resolve_mode
from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator, emulator_for_rank
from cephalo_lightning.runtime.sampler import evaluation_loader, planned_loader, shuffles

log = logging.getLogger(__name__)


class CephaloStrategy(ProcessGroupStrategy):
    """Heterogeneous-cluster training: per-rank batches, micro-batches and state shares.

    ``plan`` (a :class:`~cephalo_lightning.planner.Plan` or a JSON path), or ``cluster`` to plan from
    at setup (with ``global_batch_size``); neither: an even plan, or the :class:`CephaloCallback`'s.
    The other arguments are :class:`~.config.StrategyConfig`'s (see the README's table).
    """

    strategy_name = "cephalo"

    def __init__(self, plan: Plan | str | Path | None = None, cluster: Cluster | str | Path | None = None,
                 global_batch_size: int | None = None, mode: Literal["auto", "layered", "uniform"] = "auto",
                 collective: Literal["auto", "padded", "exact"] = "auto", units: Sequence[Any] | None = None,
                 param_dtype: str | None = None, emulate: Sequence[dict[str, float] | None] | None = None,
                 offload: bool | None = None, memory_check_every_n_steps: int = 50,
                 state_dict_type: Literal["sharded", "full"] = "sharded", prefetch: bool = True, overlap: bool = True,
                 pretrained: str | Path | None = None, loss_weighting: Literal["auto", "samples", "tokens"] = "auto",
                 verify_loss: bool = True, max_nonfinite_skips: int = 5, check_devices: bool = True,
                 safe_globals: Sequence[Any] = (), seed: int | None = None, verify_checksums: bool = True,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 **kwargs: Any) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, **kwargs)
        self.config = StrategyConfig.build(
            global_batch_size=global_batch_size, mode=mode, collective=collective, units=units, param_dtype=param_dtype,
            emulate=emulate, offload=offload, memory_check_every_n_steps=memory_check_every_n_steps,
            state_dict_type=state_dict_type, prefetch=prefetch, overlap=overlap, pretrained=pretrained,
            loss_weighting=loss_weighting, verify_loss=verify_loss, max_nonfinite_skips=max_nonfinite_skips,
            check_devices=check_devices, safe_globals=safe_globals, seed=seed, verify_checksums=verify_checksums)
        self.plan, self.cluster = planning.given(plan, cluster, global_batch_size)
        self.emulator = DeviceEmulator()
        self.run: FitRuntime | None = None
        self.provisional_layout: str | None = None  # "memory": a plan follows (CephaloCallback)
        self._failures: FailureReport | None = None
        self._sync = True  # False while Lightning accumulates gradients over batches

    global_batch_size = property(lambda self: self.config.global_batch_size)
    collective = property(lambda self: resolve_mode(self.config.collective))  # once the backend is known
    mode = property(lambda self: self.config.mode)
    param_dtype = property(lambda self: self.config.param_dtype)
    sharded = property(lambda self: self.run.sharded if self.run is not None else None)
    memory = property(lambda self: self.run.memory.tracker if self.run is not None and self.run.memory else None)
    emulate = property(lambda self: planning.emulation_specs(self.config.emulate, self.cluster))

    # --------------------------------------------------------------------------- Lightning plumbing

    is_distributed = property(lambda self: True)  # else Lightning would not sync self.log(sync_dist=True)
    restore_checkpoint_after_setup = property(lambda self: True)  # shard by this run's plan, then load any layout
    lightning_restore_optimizer = property(lambda self: False)  # loaded with the model, by logical tensor

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = sharded_precision(plugin) if plugin is not None else None

    def setup_environment(self) -> None:
        super().setup_environment()
        self._init_process_group()
        self.emulator = emulator_for_rank(self.emulate, self.global_rank, self.world_size,
                                          synchronize_cuda=self.root_device.type == "cuda")

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor) or (self.run is not None and self.run.steps.capturing):
            return tensor  # values logged per micro-batch are combined (weighted, global) by the steps
        return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    def model_to_device(self) -> None:
        pass  # sharding places every piece on the device

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's gradient accumulation: keep this batch's gradients unreduced."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        with (torch.device("meta") if empty_init else contextlib.nullcontext()), self.precision_plugin.tensor_init_context():
            yield  # on meta, materialised one unit at a time when the model is sharded

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        with torch.device("meta"):  # configure_model() builds on meta; setup() materialises per unit
            yield

    # --------------------------------------------------------------------------- setup and plans

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self.run is None or self.run.module is not module:
            self.model = self.precision_plugin.convert_module(self.model)
            resolution = resolve(module)
            mode = decide_mode(self.config.mode, resolution, module)
            plan = planning.resolve(self.plan, self.cluster, lambda: planning.global_batch(
                self.config.global_batch_size, trainer, self.world_size), mode, self.world_size, self._identities,
                self.provisional_layout == "memory", self.config.check_devices)
            planning.check_model(plan, module)
            self.run = FitRuntime(module, plan, self.config, mode=mode, resolution=resolution, rank=self.global_rank,
                                  device=self.root_device, emulator=self.emulator, collective=self.collective,
                                  training_step=self._user_training_step)
            self._adopted(self.run.plan)
        self.model = module
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._failures = self.run.start_fit(trainer, self.broadcast(os.urandom(6).hex()), self.cluster)
        self.setup_precision_plugin()

    def _identities(self) -> list[planning.DeviceIdentity]:
        return planning.gather_identities(planning.identity(self.global_rank, self.root_device, self.emulator),
                                          self.world_size)

    def _adopted(self, plan: Plan) -> None:
        self.plan = plan
        rank_zero_info(self.run.describe())
        loggers.log_rank_lines(plan)

    def _user_training_step(self, *args: Any) -> Any:
        module = self.lightning_module
        with logging_as(module, "training_step"), self.precision_plugin.train_step_context():
            return module.training_step(*args)

    def adopt_plan(self, plan: Plan) -> None:
        """Collective: a plan decided after setup (the callback's); re-shards to it at once."""
        assert self.run is not None
        planning.check_model(plan, self.lightning_module)
        self.run.schedule(plan, self.lightning_module.trainer.accumulate_grad_batches)
        self.run.switch_now(self.optimizers)
        self._adopted(self.run.plan)

    def schedule_plan(self, plan: Plan) -> tuple[int, int]:
        """Collective: switch to ``plan`` at the first step whose data no rank has cut yet; the model
        is re-sharded in place (no files, no full gather) just before it. Returns (data epoch, step)."""
        assert self.run is not None
        return self.run.schedule(plan, self.lightning_module.trainer.accumulate_grad_batches)

    # --------------------------------------------------------------------------- data and steps

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not isinstance(dataloader, DataLoader):
            return dataloader
        if trainer.state.stage != RunningStage.TRAINING:
            return evaluation_loader(dataloader, self.world_size)
        planning.check_loader_batch(dataloader.batch_size, self.run.plan, self.config.global_batch_size)
        seed = self.config.seed if self.config.seed is not None else int(self.broadcast(torch.initial_seed() % 2**31))
        self._loader = planned_loader(dataloader, self.run.plan_state, self.global_rank, shuffle=shuffles(dataloader), seed=seed)
        return self._loader

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.run.switch_if_due(self.optimizers):
            self._adopted(self.run.plan)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self.lightning_module.trainer
        self._loader.batch_sampler.mark_consumed(self.run.next_batch().step)
        scaler = getattr(self.precision_plugin, "scaler", None)
        self._ctx = self.run.context(trainer, self._sync, scaler, args[1] if len(args) > 1 else 0)
        with self.run.step_scope(trainer.global_step), self.precision_plugin.train_step_context():
            return self.run.steps.forward(args[0], self._ctx, *args[1:])

    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> torch.Tensor:
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        with self.run.step_scope(module.trainer.global_step), self.precision_plugin.train_step_context():
            self.run.record(self.run.steps.backward(closure_loss, self._ctx))
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The step's closure runs on every rank; the update is skipped on every rank if any went non-finite."""
        step = self.lightning_module.trainer.global_step
        with self.run.step_scope(step):
            result = closure()
            scaler = getattr(self.precision_plugin, "scaler", None)  # a loss scaler skips inf steps itself
            if scaler is None and self.run.guard.should_skip(step):
                getattr(optimizer, "_optimizer", optimizer).zero_grad(set_to_none=True)
                return result
            with self.run.sharded.observers.compute("optimizer_step"):
                return super().optimizer_step(optimizer, lambda: result, model, **kwargs)

    def _eval_step(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.run.sharded.gather_root()
        try:
            return getattr(super(), name)(*args, **kwargs)
        finally:
            self.run.sharded.free_all()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("predict_step", *args, **kwargs)

    # --------------------------------------------------------------------------- checkpoints

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the tensors are written by save_checkpoint, each rank its own pieces

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {}

    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath: str | Path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("CephaloStrategy.save_checkpoint(storage_options=...) is not supported")
        path = self.run.save(Path(self.broadcast(str(filepath))), checkpoint_dict, self.optimizers)
        if self._failures is not None:
            self._failures.last_checkpoint = path
        self.barrier()
        loggers.log_checkpoint_artifacts(self.lightning_module.trainer)

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        return self.run.load(Path(self.broadcast(str(checkpoint_path))), self.optimizers, weights_only)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in load_checkpoint, where the layout is known

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass

    def remove_checkpoint(self, filepath: str | Path) -> None:
        if self.is_global_zero:
            checkpoint.remove(filepath)

    # --------------------------------------------------------------------------- failures and teardown

    def on_train_end(self) -> None:
        loggers.log_checkpoint_artifacts(self.lightning_module.trainer, final=True)

    def on_exception(self, exception: BaseException) -> None:
        message = self._failures.describe(exception) if self._failures is not None else None
        if message:
            log.error(message)

    def teardown(self) -> None:
        if self._failures is not None:
            self._failures.heartbeat.stop()
            self._failures = None
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Cephalo: heterogeneous GPUs, uneven sharding",
                                   override=True)

    # =========================================================================== the callbacks' API
    # [Note: what a callback may ask of the strategy] Everything CephaloCallback reads or changes
    # goes through the methods below and the public attributes above (``plan``, ``cluster``,
    # ``emulator``, ``global_batch_size``, ``param_dtype``, ``collective``, ``memory``, ``root_device``,
    # ``world_size``, ``broadcast``, ``adopt_plan``, ``schedule_plan``). This block alone reaches the
    # fit's runtime, through :meth:`_fit_runtime`.

    def _fit_runtime(self) -> FitRuntime:
        """The fit's runtime, built at setup: the one accessor of the callbacks' API."""
        assert self.run is not None, "the callbacks' API is used after the strategy's setup"
        return self.run

    def expect_plan(self) -> None:
        """Before setup: a plan follows after setup (:meth:`adopt_profiled_plan`), so shard
        provisionally, in proportion to each rank's memory (a small device is not handed an even
        share it cannot hold)."""
        self.provisional_layout = "memory"

    def adopt_profiled_plan(self, plan: Plan, cluster: Cluster) -> None:
        """Collective: adopt ``plan``, made from the freshly profiled ``cluster``; re-shards at once."""
        self.cluster = cluster
        self.adopt_plan(plan)

    @property
    def fit_mode(self) -> str:
        """The mode the model is sharded for: ``"layered"`` or ``"uniform"``."""
        return self._fit_runtime().mode

    @property
    def layered_form(self) -> Any:
        """The model's :class:`~cephalo_lightning.models.protocol.LayeredModel` in the layered mode, else None."""
        return self._fit_runtime().layered_model

    @property
    def why_not_layered(self) -> str | None:
        """Why the model has no layered form (None when it has one)."""
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
