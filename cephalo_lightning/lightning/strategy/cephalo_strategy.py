"""``Trainer(strategy="cephalo")``: Lightning plumbing over the Cephalo runtime.

The strategy resolves the plan (:mod:`.plan_resolution`) and delegates the fit to a
:class:`~.fit.FitRuntime` (sharding, steps, plan switches, checkpoints) and the data to
:mod:`cephalo_lightning.runtime.sampler` (every rank its slice of every global batch).

Lightning calls ``training_step``, ``backward`` and ``optimizer_step`` separately; each calls the
fit's step API (:meth:`~.fit.FitRuntime.forward`, :meth:`~.fit.FitRuntime.backward`,
:meth:`~.fit.FitRuntime.before_optimizer_step`), which holds the step's state between them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Generator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from cephalo_lightning._common.errors import UnsupportedError
from cephalo_lightning._common.vocabulary import Auto, CollectiveChoice, Handback, HandbackChoice, Schedule, ScheduleChoice
from cephalo_lightning.lightning._private import (
    logging_as,
    module_hidden_from,
    stop_at_batch_end,
    sync_ddp_if_available,
    user_sampler,
)
from cephalo_lightning.lightning.callback.plain_progress import use_progress_lines
from cephalo_lightning.lightning.fit import loggers, plan_resolution
from cephalo_lightning.lightning.fit.callback_api import CallbackAPI
from cephalo_lightning.lightning.fit.fault_tolerance import ReplicaGroup
from cephalo_lightning.lightning.fit.fault_tolerance import check_options as check_fault_tolerance_options
from cephalo_lightning.lightning.fit.fault_tolerant_fit import FitReplica
from cephalo_lightning.lightning.fit.fit_runtime import FitRuntime, pipeline_obstacle, stash_offloaded
from cephalo_lightning.lightning.fit.preemption import Preemption
from cephalo_lightning.lightning.fit.replication import OneReplica
from cephalo_lightning.lightning.fit.run_folders import FailureReport
from cephalo_lightning.lightning.steps.log_relay import AlreadyGlobal
from cephalo_lightning.lightning.steps.schedules import decide_schedule
from cephalo_lightning.lightning.steps.step_state import no_stop_signal
from cephalo_lightning.lightning.strategy.precision import autocast_dtype, sharded_precision
from cephalo_lightning.lightning.strategy.sharded_strategy import ShardedStrategy
from cephalo_lightning.lightning.strategy_config import (
    DEFAULTS,
    BaseStorageChoice,
    LossWeightingChoice,
    RouterAuxLoss,
    StateDictType,
    StrategyConfig,
)
from cephalo_lightning.models import resolve
from cephalo_lightning.planner import Cluster, Plan
from cephalo_lightning.runtime.collectives import resolve_mode
from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator, emulator_for_rank, parse_emulation_specs
from cephalo_lightning.runtime.emulation.links import EmulatedLinks, links_from_emulation
from cephalo_lightning.runtime.emulation.memory import MemoryTracker
from cephalo_lightning.runtime.sampler import evaluation_loader, pipelined_evaluation_loader, planned_loader, shuffles
from cephalo_lightning.runtime.sharding.construction import ConstructionRecord
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel
from cephalo_lightning.runtime.sharding.weights import check_readable

log = logging.getLogger(__name__)


class CephaloStrategy(CallbackAPI, ShardedStrategy):
    """Heterogeneous-cluster training: per-rank batches, micro-batches and state shares.

    ``plan`` (a :class:`~cephalo_lightning.planner.Plan` or a JSON path), or ``cluster`` to plan from
    at setup (with ``global_batch_size``); neither: an even plan, or the :class:`CephaloCallback`'s.
    Every option, its default and its meaning is a field of :class:`~.config.StrategyConfig` (the
    API reference's table); ``process_group_backend`` and ``timeout`` are the process group's.
    """

    strategy_name = "cephalo"

    def __init__(self, plan: Plan | str | Path | None = DEFAULTS.plan, cluster: Cluster | str | Path | None = DEFAULTS.cluster,
                 global_batch_size: int | None = DEFAULTS.global_batch_size, mode: ScheduleChoice = DEFAULTS.mode,
                 collective: CollectiveChoice = DEFAULTS.collective, units: Sequence[Any] | None = DEFAULTS.units,
                 param_dtype: str | None = DEFAULTS.param_dtype,
                 emulate: Sequence[dict[str, float] | None] | None = DEFAULTS.emulate,
                 offload: bool | None = DEFAULTS.offload,
                 memory_check_every_n_steps: int = DEFAULTS.memory_check_every_n_steps,
                 state_dict_type: StateDictType = DEFAULTS.state_dict_type, prefetch: bool = DEFAULTS.prefetch,
                 overlap: bool = DEFAULTS.overlap, pretrained: str | Path | None = DEFAULTS.pretrained,
                 loss_weighting: LossWeightingChoice = DEFAULTS.loss_weighting,
                 router_aux_loss: RouterAuxLoss = DEFAULTS.router_aux_loss,
                 gather_on_teardown: HandbackChoice | bool = DEFAULTS.gather_on_teardown,
                 base_storage: BaseStorageChoice = DEFAULTS.base_storage.value,
                 checkpoint_frozen: bool = DEFAULTS.checkpoint_frozen, verify_loss: bool = DEFAULTS.verify_loss,
                 max_nonfinite_skips: int = DEFAULTS.max_nonfinite_skips, check_devices: bool = DEFAULTS.check_devices,
                 safe_globals: Sequence[Any] = DEFAULTS.safe_globals, seed: int | None = DEFAULTS.seed,
                 verify_checksums: bool = DEFAULTS.verify_checksums, progress_every: int | None = DEFAULTS.progress_every,
                 async_checkpoint: bool = DEFAULTS.async_checkpoint, elastic: bool = DEFAULTS.elastic,
                 fault_tolerance: bool = DEFAULTS.fault_tolerance, replica_group: int | None = DEFAULTS.replica_group,
                 pipelines: bool | Auto = DEFAULTS.pipelines,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 **kwargs: Any) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, **kwargs)
        self.config = StrategyConfig.build(
            plan=plan, cluster=cluster, global_batch_size=global_batch_size, mode=mode, collective=collective,
            units=units, param_dtype=param_dtype, emulate=emulate, offload=offload,
            memory_check_every_n_steps=memory_check_every_n_steps, state_dict_type=state_dict_type,
            prefetch=prefetch, overlap=overlap, pretrained=pretrained, loss_weighting=loss_weighting,
            router_aux_loss=router_aux_loss, gather_on_teardown=gather_on_teardown,
            base_storage=base_storage, checkpoint_frozen=checkpoint_frozen, verify_loss=verify_loss,
            max_nonfinite_skips=max_nonfinite_skips, check_devices=check_devices, safe_globals=safe_globals, seed=seed,
            verify_checksums=verify_checksums, progress_every=progress_every, async_checkpoint=async_checkpoint,
            elastic=elastic, fault_tolerance=fault_tolerance, replica_group=replica_group, pipelines=pipelines)
        if self.config.fault_tolerance:
            check_fault_tolerance_options(self.config.mode, self.config.plan)
        self.plan, self.cluster = self.config.plan, self.config.cluster  # the plan in force; the callback's cluster
        self.emulator = DeviceEmulator()
        self.links: EmulatedLinks | None = None
        self.fit_runtime: FitRuntime | None = None
        self.plan_follows = False  # a plan follows after setup (CephaloCallback's): shard provisionally
        self._failures: FailureReport | None = None
        self._preemption: Preemption | None = None  # while training: SIGTERM / requeue handling
        self._abandon_background_save = False  # the fit failed: teardown does not wait for a background save
        self._sync = True  # False while Lightning accumulates gradients over batches
        self._failed = False  # the current fit/evaluation raised (on_exception)
        self._replication = OneReplica()  # how the ranks take part in each step (fault_tolerance: a replica group)

    # from the configuration

    @property
    def global_batch_size(self) -> int | None:
        """Samples per optimizer step over all ranks, as configured (None: the plan's)."""
        return self.config.global_batch_size

    @property
    def collective(self) -> str:
        """The collective mode, ``auto`` resolved by the backend (read once the backend is known)."""
        return resolve_mode(self.config.collective)

    @property
    def mode(self) -> str:
        """The schedule asked for (``auto``, ``layered`` or ``uniform``); the fit's decision is ``fit_runtime.schedule``."""
        return self.config.mode

    @property
    def emulate(self) -> list[Any] | None:
        """Per-rank emulation: the strategy's ``emulate``, else the cluster file's entries."""
        return plan_resolution.emulation_specs(self.config.emulate, self.cluster)

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The compute dtype of the gathered parameters (None: the model's own)."""
        return self.config.param_dtype

    @property
    def offloads_stash(self) -> bool:
        """Whether the layered stash lives on the host (the cost model's ``settings.stash_on_device`` is its negation)."""
        return stash_offloaded(self.config.offload, self.root_device, self.emulator)

    # the fit's, while it runs

    @property
    def sharded(self) -> ShardedModel | None:
        """The sharded model of the fit (None before setup)."""
        return self.fit_runtime.sharded if self.fit_runtime is not None else None

    @property
    def memory(self) -> MemoryTracker | None:
        """The emulated capacity's tracker, where the CPU counts the bytes (None otherwise)."""
        return self.fit_runtime.memory_tracker if self.fit_runtime is not None else None

    @property
    def replica(self) -> ReplicaGroup | None:
        """fault_tolerance: this group's torchft replica group while it fits (None otherwise)."""
        return self._replication.replica

    # --------------------------------------------------------------------------- Lightning plumbing

    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = sharded_precision(plugin) if plugin is not None else None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.config.pretrained is not None:  # before the callbacks profile: an unreadable file loses no work
            check_readable(self.config.pretrained)
        self._init_process_group()
        self.emulator = emulator_for_rank(self.emulate, self.global_rank, self.world_size,
                                          synchronize_cuda=self.root_device.type == "cuda")
        # collectives crossing emulated nodes are slowed to the emulated link (None: no nodes named)
        self.links = links_from_emulation(parse_emulation_specs(self.emulate, self.world_size))

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor) or (self.fit_runtime is not None and self.fit_runtime.capturing_logs):
            return tensor  # values logged per micro-batch are combined (weighted, global) by the steps
        if isinstance(group, AlreadyGlobal):
            return tensor  # the steps' own logs: global on every rank already
        return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's gradient accumulation: keep this batch's gradients unreduced."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    # --------------------------------------------------------------------------- setup and plans

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self.fit_runtime is None or self.fit_runtime.module is not module:
            with self.construction:  # a true precision casts the meta buffers: their values follow the cast
                self.model = self.precision_plugin.convert_module(self.model)
            if self.config.fault_tolerance:  # this group's Trainer shards by the group's part of the plan
                self._replication = FitReplica.for_plan(self.plan, self.config.replica_group, os.environ,
                                                        world_size=self.world_size)
            resolution = resolve(module, self.config.router_aux_loss)
            schedule = decide_schedule(self.config.mode, resolution, module)
            self._replication.check_schedule(schedule)
            layered = resolution.layered if schedule == Schedule.LAYERED else None
            plan = plan_resolution.resolve(
                plan=self._replication.shard_plan(self.plan), cluster=self.cluster,
                schedule=schedule, config=self.config, trainer=trainer, world_size=self.world_size,
                identities=self._identities, provisional=self.plan_follows,
                pipeline_obstacle=pipeline_obstacle(self.config, layered, trainer, _has_cephalo_callback(trainer),
                                                    manual=not module.automatic_optimization))
            plan_resolution.check_model(plan, module)
            self.fit_runtime = FitRuntime(
                module, plan, self.config, schedule=schedule, resolution=resolution, rank=self.global_rank,
                device=self.root_device, emulator=self.emulator, collective=self.collective,
                training_step=self._user_training_step, links=self.links, construction=self.construction,
                frozen_dtype=autocast_dtype(self.precision_plugin))
            self.construction = ConstructionRecord()  # the model is materialised: nothing left to replay
            self._adopted(self.fit_runtime.plan)
            if self._precision_plugin is not None:  # always one of ours (the setter converts it)
                sharded = self.fit_runtime.sharded
                self._precision_plugin.shard_over(sharded.world, contributes=sharded.group_index == 0)
                if self.fit_runtime.pipeline is not None:  # the norm over every stage, a tied weight once
                    self._precision_plugin.clip_with(self.fit_runtime.clip_gradients)
        else:  # the same module again (e.g. trainer.test after trainer.fit): its whole parameters into the shards
            self._replication.check_refit(trainer.state.fn == TrainerFn.FITTING)
            self.fit_runtime.take_back()
        self._failed = False
        self.model = module
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            use_progress_lines(trainer, self.config.progress_every,
                               self.plan.global_batch_size * trainer.accumulate_grad_batches)
            self.setup_optimizers(trainer)
            self.fit_runtime.keep_stage_pieces(self.optimizers)
            self._failures = self.fit_runtime.start_fit(trainer, self.broadcast(os.urandom(6).hex()), self.cluster,
                                                        reported_elsewhere=_has_cephalo_callback(trainer))
            # fault tolerance: heartbeats from now; the first quorum is at on_train_start
            self._replication.join(self.optimizers, accumulate=trainer.accumulate_grad_batches, rank=self.global_rank,
                                   world_size=self.world_size, sharded=self.fit_runtime.sharded)
        self.setup_precision_plugin()

    def _identities(self) -> list[plan_resolution.DeviceIdentity]:
        mine = plan_resolution.identity(self.global_rank, self.root_device, self.emulator)
        return plan_resolution.gather_identities(mine, self.world_size)

    def _adopted(self, plan: Plan) -> None:
        self.plan = plan
        rank_zero_info(self.fit_runtime.describe())
        loggers.log_rank_lines(plan)

    def _user_training_step(self, *args: Any) -> Any:
        module = self.lightning_module
        with logging_as(module, "training_step"), self.precision_plugin.train_step_context():
            return module.training_step(*args)

    def adopt_plan(self, plan: Plan) -> None:
        """Collective: a plan decided after setup (the callback's); re-shards to it at once."""
        assert self.fit_runtime is not None
        plan_resolution.check_model(plan, self.lightning_module)
        self.fit_runtime.adopt(plan, self.lightning_module.trainer.accumulate_grad_batches, self.optimizers)
        self._adopted(self.fit_runtime.plan)

    def schedule_plan(self, plan: Plan) -> tuple[int, int]:
        """Collective: switch to ``plan`` at the first step whose data no rank has cut yet; the model
        is re-sharded in place (no files, no full gather) just before it. Returns (data epoch, step)."""
        assert self.fit_runtime is not None
        return self.fit_runtime.schedule_switch(plan, self.lightning_module.trainer.accumulate_grad_batches)

    # --------------------------------------------------------------------------- data and steps

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not isinstance(dataloader, DataLoader):
            return dataloader
        if trainer.state.stage != RunningStage.TRAINING:
            runner = self.fit_runtime.pipeline if self.fit_runtime is not None else None
            if runner is not None:  # a pipeline's ranks its samples
                return pipelined_evaluation_loader(dataloader, len(runner.layout.pipelines), runner.pipeline,
                                                   predicting=trainer.state.stage == RunningStage.PREDICTING)
            return evaluation_loader(dataloader, self.world_size)
        plan_resolution.check_loader_batch(dataloader.batch_size, self.fit_runtime.plan, self.config.global_batch_size)
        seed = plan_resolution.data_seed(self.config.seed, os.environ)
        self._replication.check_data_seed(seed, shuffles(dataloader))  # the seed given, before a fallback
        if self.config.seed is None:  # one order on every rank: rank 0's
            seed = int(self.broadcast(torch.initial_seed() % 2**31 if seed is None else seed))
        self._loader = planned_loader(dataloader, self.fit_runtime.plan_state, self.global_rank,
                                      shuffle=shuffles(dataloader), seed=seed, whole=self._replication.whole_batches,
                                      sampler=user_sampler(dataloader.sampler))
        return self._loader

    @override
    def on_train_start(self) -> None:
        # after Lightning registered its own signal handlers (which ours replace while training)
        self._preemption = Preemption.for_trainer(self.lightning_module.trainer, self.cluster_environment)
        self._preemption.install()
        # fault tolerance: the first quorum; a group behind the others recovers the live state here
        self._replication.start(self.lightning_module.trainer, self._loader.batch_sampler)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.fit_runtime.switch_if_due(self.optimizers):
            self._adopted(self.fit_runtime.plan)

    @property
    def _scaler(self) -> Any:
        return getattr(self.precision_plugin, "scaler", None)  # 16-mixed: a loss scaler

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self.lightning_module.trainer
        runtime = self.fit_runtime
        part = self._replication.step_batch(args[0], runtime, self._loader.batch_sampler)
        signal = self._preemption.pending if self._preemption is not None else no_stop_signal
        with self.precision_plugin.train_step_context():
            return runtime.forward(part.batch, args[1:], trainer, sync=self._sync, scaler=self._scaler, signal=signal,
                                   rank_plan=part.rank_plan, global_items=part.global_items,
                                   deferred_logs=part.deferred_logs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> torch.Tensor:
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        with self.precision_plugin.train_step_context():
            report = self.fit_runtime.backward(closure_loss)
        if self._preemption is not None and self._preemption.agree(report.signals, report.synced, module.trainer.global_step):
            stop_at_batch_end(module.trainer)  # every rank: the same step's all-reduce decided it
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The step's closure runs on every rank; the update is skipped on every rank if any went non-finite."""
        step = self.lightning_module.trainer.global_step
        with self.fit_runtime.step_scope(step):
            # fault tolerance: the closure until torchft commits the step; a non-finite sum is skipped by every group
            result, summed = self._replication.run_closure(closure, optimizer, self.global_rank)
            if not self.fit_runtime.before_optimizer_step(step, scaled=self._scaler is not None, summed=summed):
                (optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer).zero_grad(set_to_none=True)
                return result
            with self.fit_runtime.optimizer_step_scope():
                return super().optimizer_step(optimizer, lambda: result, model, **kwargs)

    def _eval_step(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self.fit_runtime.pipeline is not None:  # the user's step would run the whole model: the pipeline's
            if name == "predict_step":
                return self.fit_runtime.pipelined_prediction(args[0])
            return self.fit_runtime.pipelined_evaluation(args[0], name)
        with self.fit_runtime.evaluation_step():
            return getattr(super(), name)(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("predict_step", *args, **kwargs)

    # --------------------------------------------------------------------------- checkpoints

    @override
    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath: str | Path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise UnsupportedError("CephaloStrategy.save_checkpoint(storage_options=...) is not supported")
        state = self.lightning_module.trainer.state
        fitting = state.fn == TrainerFn.FITTING and state.status == TrainerStatus.RUNNING
        # outside a fit, the checkpoint is there when the call returns
        newest = self.fit_runtime.save_checkpoint(Path(self.broadcast(str(filepath))), checkpoint_dict, self.optimizers,
                                                  wait=not fitting)
        if self._failures is not None:
            self._failures.last_checkpoint = newest
        self.barrier()
        loggers.log_checkpoint_artifacts(self.lightning_module.trainer)

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        if self.is_global_zero:
            self.fit_runtime.remove_checkpoint(filepath)  # after a save still being written, if any

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        return self.fit_runtime.load_checkpoint(Path(self.broadcast(str(checkpoint_path))), self.optimizers, weights_only)

    # --------------------------------------------------------------------------- failures and teardown

    @override
    def on_train_end(self) -> None:
        self.fit_runtime.wait_for_checkpoints()  # a background save is published before the final upload
        loggers.log_checkpoint_artifacts(self.lightning_module.trainer, final=True)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # no collective at teardown: a peer may be gone
        if isinstance(exception, SIGTERMException):
            if self._preemption is not None and self._preemption.decision is not None:
                self._preemption.save_and_stop(self.lightning_module.trainer, exception,
                                               wait=self.fit_runtime.wait_for_checkpoints)
            else:
                self._stopped_by_sigterm(exception)
            return
        self._abandon_background_save = True  # its collectives could wait for a peer that is gone
        message = self._failures.describe(exception) if self._failures is not None else None
        if message:
            log.error(message)

    def _stopped_by_sigterm(self, exception: SIGTERMException) -> None:
        """Lightning stops at the batch boundary after a SIGTERM (a save in progress completes
        first) by raising a ``SystemExit`` without a code, which exits 0: a scheduler would count the
        unfinished run a success. The exit status becomes 128 + SIGTERM, as for a process the signal
        killed."""
        exception.code = 128 + signal.SIGTERM
        step = self.lightning_module.trainer.global_step
        hint = self._failures.resume_hint() if self._failures is not None else ""
        log.error(f"Cephalo (rank {self.global_rank}): stopped by SIGTERM after {step} steps; exiting with status "
                  f"{exception.code} (the fit did not finish).{hint}")

    @override
    def teardown(self) -> None:
        try:
            if self.fit_runtime is not None and not self._abandon_background_save:
                self.fit_runtime.wait_for_checkpoints()  # a background save completes before the fit returns
        except BaseException:
            self._failed = True  # a failed save: the module stays sharded (and guarded), no gather
            raise
        finally:
            try:
                if self.fit_runtime is not None:  # the user's module after fit/validate/test: see runtime.sharding.handback
                    self.fit_runtime.hand_back(Handback.NONE if self._failed else self.config.gather_on_teardown,
                                               ranks_per_node=self.num_processes)
            finally:
                self._teardown_run()

    def _teardown_run(self) -> None:
        self._abandon_background_save = False
        self._replication.shutdown()
        if self._preemption is not None:
            self._preemption.uninstall()
            self._preemption = None
        if self._failures is not None:
            self._failures.close()
            self._failures = None
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        module = self.lightning_module
        if module is None or not _holds_meta_tensors(module):
            super().teardown()
            return
        with module_hidden_from(self):  # setup failed before materialising: Lightning's move to the host would
            super().teardown()  # raise over the failure's own error, and there is nothing to move


def _holds_meta_tensors(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def _has_cephalo_callback(trainer: pl.Trainer) -> bool:
    """Whether a :class:`~.callback.CephaloCallback` takes part (it reports the run with its profile)."""
    from cephalo_lightning.lightning.callback.cephalo_callback import CephaloCallback  # it imports this module

    return any(isinstance(c, CephaloCallback) for c in trainer.callbacks)
