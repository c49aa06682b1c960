"""``Trainer(strategy="cephalo")``: Lightning plumbing over the Cephalo runtime.

The strategy owns the plan (per-rank batch, micro-batches, state share) and delegates the rest:
:mod:`.planning` resolves and checks the plan, :class:`~.training.FitRuntime` shards the module and
runs the steps, :mod:`.runtime.sampler` re-cuts the training data, :mod:`.runtime.checkpoint`
writes and reads resharding checkpoints.
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
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from cephalo_lightning import planning
from cephalo_lightning._lightning_private import (
    SubprocessScriptLauncher, default_process_group_backend, distributed_is_initialized, init_dist_connection,
    logging_as, sync_ddp_if_available, training_dataloader,
)
from cephalo_lightning.config import StrategyConfig
from cephalo_lightning.models import resolve
from cephalo_lightning.planner import Cluster, Plan, PlanningError, load_cluster
from cephalo_lightning.precision import sharded_precision
from cephalo_lightning.runtime import checkpoint
from cephalo_lightning.runtime.collectives import resolve_mode
from cephalo_lightning.runtime.emulation import DeviceEmulator, emulator_for_rank
from cephalo_lightning.runtime.liveness import Heartbeat, looks_like_lost_peer
from cephalo_lightning.runtime.sampler import loading_settings, planned_loader
from cephalo_lightning.training import FitRuntime, decide_mode

log = logging.getLogger(__name__)


class CephaloStrategy(ParallelStrategy):
    """Heterogeneous-cluster training: per-rank batches, micro-batches and state shares.

    Args (see the README's table for all of them):
        plan: a :class:`~cephalo_lightning.planner.Plan` or a plan JSON path; ``cluster``: a cluster file
            to plan from at setup (needs ``global_batch_size``); neither: an even plan (or the callback's).
        mode: ``"layered"``, ``"uniform"`` or ``"auto"`` (layered where the model has a layered form).
        emulate: per-rank CPU emulation, e.g. ``[{"slowdown": 1}, {"slowdown": 3, "memory_gb": 0.5}]``.
        pretrained: weights read straight into the shards (a ``save_pretrained`` directory or a file).
        max_nonfinite_skips: skip steps with a non-finite loss or gradient; stop after this many in a row.
        check_devices: refuse a plan made for other devices than the ranks run on.
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
        super().__init__(**kwargs)
        self.config = StrategyConfig.build(
            global_batch_size=global_batch_size, mode=mode, collective=collective, units=units, param_dtype=param_dtype,
            emulate=emulate, offload=offload, memory_check_every_n_steps=memory_check_every_n_steps,
            state_dict_type=state_dict_type, prefetch=prefetch, overlap=overlap, pretrained=pretrained,
            loss_weighting=loss_weighting, verify_loss=verify_loss, max_nonfinite_skips=max_nonfinite_skips,
            check_devices=check_devices, safe_globals=safe_globals, seed=seed, verify_checksums=verify_checksums)
        if cluster is not None and plan is not None:
            raise ValueError("give either plan= or cluster= (to plan at setup), not both")
        if cluster is not None and global_batch_size is None:
            raise ValueError("CephaloStrategy(cluster=...) plans at setup and needs global_batch_size=B")
        self.plan: Plan | None = Plan.load(plan) if isinstance(plan, (str, Path)) else plan
        if self.plan is not None and global_batch_size not in (None, self.plan.global_batch_size):
            raise ValueError(f"global_batch_size={global_batch_size} but the plan is for {self.plan.global_batch_size}: drop one")
        self.cluster: Cluster | None = load_cluster(cluster) if isinstance(cluster, (str, Path)) else cluster
        self.collective = collective
        self.emulator = DeviceEmulator()
        self.run: FitRuntime | None = None
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._sync = True  # False while Lightning accumulates gradients over batches
        self._heartbeat: Heartbeat | None = None
        self.provisional_layout: str | None = None  # "memory": a plan follows (CephaloCallback); shard by memory till then
        self.num_nodes = 1

    # --------------------------------------------------------------------------- what the callback reads

    global_batch_size = property(lambda self: self.config.global_batch_size)
    mode = property(lambda self: self.config.mode)
    param_dtype = property(lambda self: self.config.param_dtype)
    sharded = property(lambda self: self.run.sharded if self.run is not None else None)
    memory = property(lambda self: self.run.memory.tracker if self.run is not None and self.run.memory else None)

    @property
    def emulate(self) -> list[Any] | None:
        """Per-rank emulation: the strategy's ``emulate``, else the cluster file's ``emulate`` entries."""
        if self.config.emulate is not None:
            return list(self.config.emulate)
        if self.cluster is not None and any(d.emulate is not None for d in self.cluster.devices):
            return [d.emulate for d in self.cluster.devices]
        return None

    # --------------------------------------------------------------------------- Lightning plumbing

    @property
    def is_distributed(self) -> bool:
        return True  # Lightning syncs self.log(sync_dist=True) and injects samplers only then

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # shard first (with this run's plan), then load whatever layout was saved

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # optimizer state is loaded with the model, by logical tensor

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = sharded_precision(plugin) if plugin is not None else None

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # CPU ranks share the host's cores: oversubscribed threads make every rank slow and noisy
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, self.num_processes)))
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or default_process_group_backend(self.root_device)
        kwargs = {"timeout": self._timeout} if self._timeout is not None else {}
        init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        self.collective = resolve_mode(self.collective)  # the backend is known now
        self.emulator = emulator_for_rank(self.emulate, self.global_rank, self.world_size,
                                          synchronize_cuda=self.root_device.type == "cuda")

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)

    def barrier(self, name: str | None = None) -> None:
        if distributed_is_initialized():
            dist.barrier(device_ids=[self.root_device.index]) if dist.get_backend() == "nccl" else dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor) or (self.run is not None and self.run.steps.capturing):
            return tensor  # values logged per micro-batch are combined (weighted, global) by the steps
        return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    def model_to_device(self) -> None:
        pass  # sharding places every piece on the device (FitRuntime)

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
        # on the meta device, materialised one unit at a time when the model is sharded
        with (torch.device("meta") if empty_init else contextlib.nullcontext()), self.precision_plugin.tensor_init_context():
            yield

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        with torch.device("meta"):  # configure_model() builds on meta; setup() materialises per unit
            yield

    # --------------------------------------------------------------------------- setup

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self.run is None or self.run.module is not module:
            self.model = self.precision_plugin.convert_module(self.model)
            resolution = resolve(module)
            mode = decide_mode(self.config.mode, resolution, module, self.plan)
            plan = planning.resolve(self.plan, self.cluster, self.config.global_batch_size, mode, self.world_size)
            if plan is None:
                plan = Plan.even(self.world_size, self._global_batch(trainer), mode=mode)
                if self.provisional_layout == "memory":
                    plan = planning.memory_proportional(plan, self._identities())
                else:
                    rank_zero_info("Cephalo: no plan or profile given; using an even split (equal batches and shares). "
                                   "Add CephaloCallback() to profile and plan for heterogeneous devices.")
            planning.check_model(plan, module)
            self._check_devices(plan)
            self._build(plan, mode, resolution)
        self.model = module
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            for hparams in (module.hparams, getattr(trainer.datamodule, "hparams", {})):
                checkpoint.check_loadable(dict(hparams), self.config.safe_globals, "the hyperparameters")
            self._start_heartbeat(trainer)
        self.setup_precision_plugin()

    def _global_batch(self, trainer: pl.Trainer) -> int:
        if self.config.global_batch_size is not None:
            return self.config.global_batch_size
        if trainer.state.fn != TrainerFn.FITTING:
            return self.world_size  # evaluation only: batches are Lightning's even shards anyway
        batch = getattr(training_dataloader(trainer), "batch_size", None)
        if batch is None:
            raise ValueError("set batch_size on the training DataLoader (the global batch) or CephaloStrategy(global_batch_size=B)")
        return batch

    def _identities(self) -> list[planning.DeviceIdentity]:
        mine = planning.identity(self.global_rank, self.root_device, self.emulator)
        identities: list[Any] = [mine] * self.world_size
        if distributed_is_initialized():
            dist.all_gather_object(identities, mine)
        return identities

    def _check_devices(self, plan: Plan) -> None:
        if self.config.check_devices and plan.strategy != "even":
            planning.check_devices(plan, self._identities())

    def _build(self, plan: Plan, mode: str, resolution: Any) -> None:
        self.run = FitRuntime(self.lightning_module, plan, self.config, mode=mode, resolution=resolution,
                              rank=self.global_rank, device=self.root_device, emulator=self.emulator,
                              collective=self.collective, training_step=self._user_training_step)
        self.plan = plan
        rank_zero_info(self.run.describe())

    def _user_training_step(self, *args: Any) -> Any:
        module = self.lightning_module
        with logging_as(module, "training_step"), self.precision_plugin.train_step_context():
            return module.training_step(*args)

    def adopt_plan(self, plan: Plan) -> None:
        """A plan decided after setup (the callback's): the model is re-sharded to it now, before any
        batch is cut (collective)."""
        assert self.run is not None
        planning.check_model(plan, self.lightning_module)
        self.schedule_plan(plan)
        self.run.switch_now(self.optimizers)
        self.plan = self.run.plan
        rank_zero_info(self.run.describe())

    def schedule_plan(self, plan: Plan) -> tuple[int, int]:
        """Switch to ``plan`` at the first step whose data is not cut yet (agreed by every rank).

        The model is re-sharded in place (no files, no full gather) just before that step's batch
        trains; batches already cut keep the old plan. Returns the (data epoch, step) of the switch.
        """
        assert self.run is not None
        self.run.check_plan(plan)
        state = self.run.plan_state
        at = torch.tensor(state.first_uncut(), dtype=torch.int64)
        if distributed_is_initialized():
            dist.all_reduce(at, op=dist.ReduceOp.MAX)
        epoch, step = (int(v) for v in at.tolist())
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        step = -(-step // accumulate) * accumulate  # at an optimizer-step boundary
        state.schedule(plan, (epoch, step))
        return epoch, step

    # --------------------------------------------------------------------------- data

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not isinstance(dataloader, DataLoader):
            return dataloader
        if trainer.state.stage != RunningStage.TRAINING:
            return self._evaluation_loader(dataloader)
        plan = self.run.plan
        if self.config.global_batch_size is None and dataloader.batch_size not in (None, plan.global_batch_size):
            raise PlanningError(
                f"the training DataLoader has batch_size={dataloader.batch_size} but the plan is for a global batch of "
                f"{plan.global_batch_size}: set batch_size={plan.global_batch_size} or re-plan with --global-batch-size "
                f"{dataloader.batch_size}"
            )
        sampler = dataloader.sampler
        shuffle = isinstance(sampler, RandomSampler) or (isinstance(sampler, DistributedSampler) and sampler.shuffle)
        seed = self.config.seed if self.config.seed is not None else int(self.broadcast(torch.initial_seed() % 2**31))
        self._loader = planned_loader(dataloader, self.run.plan_state, self.global_rank, shuffle=shuffle, seed=seed)
        return self._loader

    def _evaluation_loader(self, dataloader: DataLoader) -> DataLoader:
        """Lightning's even sharding, ``batch_size / world_size`` per rank (``limit_val_batches`` keeps its meaning)."""
        if dataloader.batch_size is None:
            return dataloader  # a custom batch sampler: the user decides
        size = -(-dataloader.batch_size // self.world_size)
        if size >= dataloader.batch_size:
            return dataloader
        return DataLoader(dataloader.dataset, batch_size=size, sampler=dataloader.sampler,
                          drop_last=dataloader.drop_last, **loading_settings(dataloader))

    # --------------------------------------------------------------------------- steps

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        assert self.run is not None
        if self.run.switch_if_due(self.optimizers):
            rank_zero_info(f"Cephalo: re-sharded to plan version {self.run.plan_state.sharded_version} "
                           f"(state shares {[round(s, 4) for s in self.run.plan.state_shares]})")
            self.plan = self.run.plan

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.run is not None
        trainer = self.lightning_module.trainer
        record = self.run.plan_state.next_batch()
        if record.version != self.run.plan_state.sharded_version:
            raise RuntimeError(f"a batch cut under plan version {record.version} reached a model sharded under "
                               f"version {self.run.plan_state.sharded_version}")
        self._loader.batch_sampler.mark_consumed(record.step)
        self._ctx = self.run.context(trainer, self._sync, getattr(self.precision_plugin, "scaler", None), args[1] if len(args) > 1 else 0)
        with self.run.step_scope(trainer.global_step), self.precision_plugin.train_step_context():
            return self.run.steps.forward(args[0], self._ctx, *args[1:])

    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.run is not None
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        with self.run.step_scope(module.trainer.global_step), self.precision_plugin.train_step_context():
            self.run.record(self.run.steps.backward(closure_loss, self._ctx))
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The step runs (closure) on every rank; it is skipped on every rank if any went non-finite."""
        assert self.run is not None
        with self.run.step_scope(self.lightning_module.trainer.global_step):
            result = closure()
            scaler = getattr(self.precision_plugin, "scaler", None)  # a loss scaler skips inf steps itself
            if scaler is None and self.run.guard.should_skip(self.lightning_module.trainer.global_step):
                getattr(optimizer, "_optimizer", optimizer).zero_grad(set_to_none=True)
                return result
            with self.run.sharded.observers.compute("optimizer_step"):
                return super().optimizer_step(optimizer, lambda: result, model, **kwargs)

    def _eval_step(self, name: str, *args: Any, **kwargs: Any) -> Any:
        assert self.run is not None
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
        assert self.run is not None
        path = Path(self.broadcast(str(filepath)))
        optimizers = self.optimizers if "optimizer_states" in checkpoint_dict else []  # save_weights_only
        if self.config.state_dict_type == "full":  # one file: consolidate a sharded one beside it
            staging = path.with_name(f".{path.name}.sharded")
            self.run.save(staging, checkpoint_dict, optimizers, self.world_size)
            if self.is_global_zero:
                checkpoint.consolidate(staging, path, self.config.safe_globals)
                checkpoint.remove(staging)
        else:
            self.run.save(path, checkpoint_dict, optimizers, self.world_size)
        self._last_checkpoint = path
        self.barrier()

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.run is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        trusted = weights_only is False  # an explicit opt-in to unpickling meta.pt (never DCP's metadata)
        if path.is_dir() or checkpoint.is_checkpoint(path) or not path.exists():
            return self.run.load(path, self.optimizers, trusted)
        meta = self.run.load_full(path, trusted)
        rank_zero_info("Cephalo: loaded weights from a single-file checkpoint; optimizer state starts fresh.")
        return meta

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in load_checkpoint, where the layout is known

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass

    def remove_checkpoint(self, filepath: str | Path) -> None:
        if self.is_global_zero:
            checkpoint.remove(filepath)

    # --------------------------------------------------------------------------- failures and teardown

    def _start_heartbeat(self, trainer: pl.Trainer) -> None:
        token = self.broadcast(os.urandom(6).hex())
        directory = Path(trainer.default_root_dir) / ".cephalo" / f"heartbeat-{token}"
        self._heartbeat = Heartbeat(directory, self.global_rank, self.world_size).start()
        for callback in trainer.checkpoint_callbacks:  # leftovers of an interrupted save or delete
            if self.is_global_zero and getattr(callback, "dirpath", None):
                checkpoint.clean_stale(callback.dirpath)

    def on_exception(self, exception: BaseException) -> None:
        if self._heartbeat is None or not looks_like_lost_peer(exception):
            return
        suspects = self._heartbeat.suspects()
        last = getattr(self, "_last_checkpoint", None)
        log.error("Cephalo (rank %d): a collective failed (%s: %s). %s%s", self.global_rank, type(exception).__name__,
                  str(exception).splitlines()[0] if str(exception) else "",
                  ("Stopped: " + "; ".join(suspects) + ".") if suspects else "No peer is known to have stopped.",
                  f" Resume with trainer.fit(..., ckpt_path={str(last)!r})." if last else " No checkpoint was written yet.")

    def teardown(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Cephalo: heterogeneous GPUs, uneven sharding",
                                   override=True)
