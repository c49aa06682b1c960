"""``Trainer(strategy="cephalo")``: a thin Lightning adapter over the Cephalo runtime.

The strategy owns the plan (per-rank batch, micro-batches, state share). At setup it shards the
LightningModule unevenly (:class:`~cephalo_lightning.runtime.engine.ShardedModel`); the training
dataloader is re-cut so every rank gets its own slice of each global batch; each Lightning batch
runs the rank's micro-batches (layered schedule when the module implements the layered protocol,
micro-batch-major otherwise); checkpoints are sharded by logical tensor and reshard on load.
"""

from __future__ import annotations

import contextlib
import importlib
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
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from cephalo_lightning._lightning_private import (
    SubprocessScriptLauncher,
    default_process_group_backend,
    distributed_is_initialized,
    init_dist_connection,
    logging_as,
    sync_ddp_if_available,
)
from cephalo_lightning.planner import Cluster, Plan, PlanningError, RankPlan, load_cluster
from cephalo_lightning.planner import plan as make_plan
from cephalo_lightning.precision import sharded_precision
from cephalo_lightning.runtime import checkpoint
from cephalo_lightning.runtime.collectives import resolve_mode
from cephalo_lightning.runtime.emulation import DeviceEmulator, emulator_for_rank
from cephalo_lightning.runtime.engine import ShardedModel
from cephalo_lightning.runtime.layered import LayeredSchedule
from cephalo_lightning.runtime.memory import MemoryTracker
from cephalo_lightning.runtime.sampler import PlannedBatchSampler, PlannedDataLoader
from cephalo_lightning.steps import LAYERED_PROTOCOL, LayeredSteps, StepContext, UniformSteps, has_layered_protocol

log = logging.getLogger(__name__)

Mode = Literal["auto", "layered", "uniform"]
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def _import_class(path: str) -> type[nn.Module]:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"units: cannot import module class {path!r} ({err}); give a full path like 'pkg.mod.Block'") from err


def _loading_settings(dataloader: DataLoader) -> dict[str, Any]:
    """How a user's DataLoader loads (workers, collation, pinning), kept when the strategy re-cuts it."""
    return {"num_workers": dataloader.num_workers, "collate_fn": dataloader.collate_fn,
            "pin_memory": dataloader.pin_memory, "worker_init_fn": dataloader.worker_init_fn,
            "persistent_workers": dataloader.persistent_workers}


class CephaloStrategy(ParallelStrategy):
    """Heterogeneous-cluster training: per-rank batches, micro-batches and state shares.

    Args:
        plan: a :class:`~cephalo_lightning.planner.Plan` or the path of a plan JSON file.
        cluster: a cluster file (or :class:`~cephalo_lightning.planner.Cluster`) to plan from at
            setup; needs ``global_batch_size``.
        global_batch_size: samples per optimizer step over all ranks. Without a plan or cluster,
            the training DataLoader's ``batch_size`` is the global batch.
        mode: ``"layered"`` (per-rank micro-batch counts; needs the layered protocol on the
            LightningModule), ``"uniform"`` (any model; one micro-batch count for all ranks) or
            ``"auto"`` (layered when the protocol is there).
        collective: how uneven shards move: ``"padded"``, ``"exact"`` or ``"auto"`` (exact on
            gloo, padded on NCCL).
        units: the wrap policy: module classes (or their import paths); default: the blocks of
            the largest ``nn.ModuleList``. Ignored in layered mode (the layers are the units).
        param_dtype: dtype of gathered parameters for compute (e.g. ``"bf16"``); default: the
            module's dtype. Master shards and gradient reduction stay fp32.
        emulate: per-rank CPU emulation, e.g. ``[{"slowdown": 1}, {"slowdown": 3, "memory_gb": 0.5}]``.
        offload: keep the layered stash on the host (default: on CUDA, and for an emulated
            memory capacity on CPU).
        memory_check_every_n_steps: on CPU an emulated capacity is enforced by counting every
            tensor (slow); it counts the first 3 steps and then every N-th (steps repeat the same
            allocations), so the other steps run at full speed.
        state_dict_type: ``"sharded"`` (a resharding DCP directory) or ``"full"`` (one file,
            gathered on rank 0, loadable by ``LightningModule.load_from_checkpoint``).
    """

    strategy_name = "cephalo"

    def __init__(
        self,
        plan: Plan | str | Path | None = None,
        cluster: Cluster | str | Path | None = None,
        global_batch_size: int | None = None,
        mode: Mode = "auto",
        collective: Literal["auto", "padded", "exact"] = "auto",
        units: Sequence[type[nn.Module] | str] | None = None,
        param_dtype: str | None = None,
        emulate: Sequence[dict[str, float] | None] | None = None,
        offload: bool | None = None,
        memory_check_every_n_steps: int = 50,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        prefetch: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if mode not in ("auto", "layered", "uniform"):
            raise ValueError(f"mode must be 'auto', 'layered' or 'uniform', got {mode!r}")
        if state_dict_type not in ("sharded", "full"):
            raise ValueError(f"state_dict_type must be 'sharded' or 'full', got {state_dict_type!r}")
        if cluster is not None and plan is not None:
            raise ValueError("give either plan= or cluster= (to plan at setup), not both")
        if cluster is not None and global_batch_size is None:
            raise ValueError("CephaloStrategy(cluster=...) plans at setup and needs global_batch_size=B")
        if param_dtype is not None and param_dtype not in _DTYPES:
            raise ValueError(f"param_dtype must be one of {sorted(_DTYPES)}, got {param_dtype!r}")
        self.plan: Plan | None = Plan.load(plan) if isinstance(plan, (str, Path)) else plan
        if self.plan is not None and global_batch_size not in (None, self.plan.global_batch_size):
            raise ValueError(
                f"global_batch_size={global_batch_size} but the plan is for {self.plan.global_batch_size}: drop one of them"
            )
        self.cluster: Cluster | None = load_cluster(cluster) if isinstance(cluster, (str, Path)) else cluster
        self.global_batch_size = global_batch_size  # when set, the DataLoader's batch_size is not consulted
        self.mode = mode
        self.collective = collective
        self.units = [_import_class(u) if isinstance(u, str) else u for u in units] if units else None
        self.param_dtype = _DTYPES[param_dtype] if param_dtype else None
        self.emulate = list(emulate) if emulate is not None else None
        self.offload = offload
        self.memory_check_every_n_steps = max(1, memory_check_every_n_steps)
        self.state_dict_type = state_dict_type
        self.prefetch = prefetch
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1
        self.sharded: ShardedModel | None = None
        self.emulator = DeviceEmulator()
        self.memory: MemoryTracker | None = None
        self._steps: LayeredSteps | UniformSteps | None = None
        self._resolved_mode: str | None = None
        self._sampler: PlannedBatchSampler | None = None
        self._ctx: StepContext | None = None
        self._sync = True  # False while Lightning accumulates gradients over batches
        self._pending: tuple[Plan, int, int] | None = None  # a plan to switch to at (epoch, step)

    # ------------------------------------------------------------------ Lightning plumbing

    @property
    def is_distributed(self) -> bool:
        # Lightning only syncs self.log(sync_dist=True) and injects samplers when this is True.
        return True

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
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or default_process_group_backend(self.root_device)
        self._process_group_backend = backend
        kwargs = {"timeout": self._timeout} if self._timeout is not None else {}
        init_dist_connection(self.cluster_environment, backend, **kwargs)
        self.collective = resolve_mode(self.collective)  # the backend is known now
        self.emulator = emulator_for_rank(self._emulation_specs(), self.global_rank, self.world_size,
                                          synchronize_cuda=self.root_device.type == "cuda")

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)

    def barrier(self, name: str | None = None) -> None:
        if distributed_is_initialized():
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's gradient accumulation: keep this batch's gradients unreduced."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    # ------------------------------------------------------------------ plan

    @property
    def rank_plan(self) -> RankPlan:
        assert self.plan is not None
        return self.plan.ranks[self.global_rank]

    def _resolve_plan(self) -> None:
        """Decide the plan before sharding: given, planned from a cluster file, or even."""
        world = self.world_size
        if self.plan is None and self.cluster is not None:
            self.plan = make_plan(self.cluster, self.global_batch_size, mode="uniform" if self.mode == "uniform" else "layered")
        if self.plan is None:
            rank_zero_info("Cephalo: no plan or profile given; using an even split (equal batches and shares). "
                           "Add CephaloCallback() to profile and plan for heterogeneous devices.")
            return  # batch sizes are fixed when the training dataloader is known
        if self.plan.world_size != world:
            raise PlanningError(
                f"the plan is for {self.plan.world_size} ranks but the job has {world}: re-plan for {world} ranks "
                f"(python -m cephalo_lightning plan ... ) or launch {self.plan.world_size} processes"
            )

    def _check_plan_matches_model(self, module: nn.Module) -> None:
        expected = (self.plan.model or {}).get("parameters") if self.plan else None
        if not expected:
            return
        actual = sum(p.numel() for p in module.parameters() if p.requires_grad)
        if abs(actual - expected) > 0.02 * expected:
            raise PlanningError(
                f"the plan was made for a model with {expected:,} parameters ({self.plan.model.get('name', '?')}) "
                f"but this LightningModule has {actual:,}: re-plan for this model"
            )

    def _shares(self) -> list[float]:
        return self.plan.state_shares if self.plan is not None else [1.0 / self.world_size] * self.world_size

    # ------------------------------------------------------------------ setup: shard, optimizers

    def _resolve_mode(self, module: pl.LightningModule) -> str:
        layered_ok = has_layered_protocol(module)
        if self.mode == "layered" and not layered_ok:
            raise TypeError(
                f"mode='layered' needs the layered protocol on {type(module).__name__}: implement "
                f"{', '.join(LAYERED_PROTOCOL)} (see the README), or use mode='uniform'"
            )
        mode = self.mode if self.mode != "auto" else ("layered" if layered_ok else "uniform")
        if self.mode == "auto" and not layered_ok:
            rank_zero_info(f"Cephalo: {type(module).__name__} does not implement {', '.join(LAYERED_PROTOCOL)}; "
                           "using the uniform mode (one micro-batch count on every rank).")
        if mode == "uniform" and self.plan is not None and len(set(self.plan.num_micro_batches)) > 1:
            raise PlanningError(
                "the plan gives ranks different micro-batch counts, which needs the layered mode: implement "
                f"{', '.join(LAYERED_PROTOCOL)} on the LightningModule or re-plan with --mode uniform"
            )
        return mode

    def _emulation_specs(self) -> list[Any] | None:
        """Per-rank emulation: the strategy's ``emulate``, else the cluster file's ``emulate`` entries."""
        if self.emulate is not None:
            return self.emulate
        if self.cluster is not None and any(d.emulate is not None for d in self.cluster.devices):
            return [d.emulate for d in self.cluster.devices]
        return None

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if self.sharded is None or self.sharded.module is not module:
            self._resolve_plan()
            self._check_plan_matches_model(module)
            self.model = self.precision_plugin.convert_module(self.model)
            self._resolved_mode = self._resolve_mode(module)
            self._shard(module)
        self.model = module
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _shard(self, module: pl.LightningModule, compute_dtype: torch.dtype | None = None) -> None:
        layers = list(module.cephalo_layers()) if self._resolved_mode == "layered" else None
        self.sharded = ShardedModel(
            module, self._shares(), units=layers if layers is not None else self.units, collective=self.collective,
            compute_dtype=compute_dtype or self.param_dtype, emulator=self.emulator, prefetch=self.prefetch,
            device=self.root_device,
        )
        module.to(self.root_device)  # buffers; the local pieces are already there
        if layers is not None:
            # an emulated GPU keeps its stash on the host, as the real one would (accounted as host memory)
            offload = self.offload if self.offload is not None else (self.root_device.type == "cuda" or self.emulator.memory_gb is not None)
            self._steps = LayeredSteps(module, LayeredSchedule(self.sharded, layers, offload=offload))
        else:
            self._steps = UniformSteps(self.sharded, self._user_training_step)
        self.precision_plugin.clip_fn = self.sharded.clip_grad_norm_  # type: ignore[attr-defined]
        self._track_memory()
        rank_zero_info(f"Cephalo: {self._resolved_mode} mode, state shares "
                       f"{[round(s, 4) for s in self._shares()]}, {len(self.sharded.units)} units")

    def _track_memory(self) -> None:
        """Enforce an emulated capacity: CPU accounting (raises like CUDA's OOM) or a CUDA cap."""
        self._stop_memory_tracking()
        if self.emulator.memory_gb is None or self.sharded is None:
            return
        if self.root_device.type == "cuda":
            self.emulator.cap_cuda_memory(self.root_device)
            return
        # the local state (fp32 master) is resident before tracking starts
        self.memory = self.emulator.memory_tracker(baseline_bytes=self.sharded.local_state_numel() * 4)
        self.memory.__enter__()

    def _user_training_step(self, *args: Any) -> Any:
        """The user's training_step for micro-batches after the first, which run inside backward."""
        module = self.lightning_module
        with logging_as(module, "training_step"), self.precision_plugin.train_step_context():
            return module.training_step(*args)

    # ------------------------------------------------------------------ re-planning

    def schedule_plan(self, plan: Plan, after_steps: int = 2) -> tuple[int, int]:
        """Switch to ``plan`` ``after_steps`` training steps from now, on every rank.

        The switch waits for the data loader, which is one batch ahead; at the switch the model
        is re-sharded in place (:meth:`_reshard`) after a checkpoint of the old layout is written.
        Call it on every rank with the same plan. Returns the (epoch, step) of the switch.
        """
        assert self._sampler is not None and self.plan is not None
        if plan.world_size != self.world_size or plan.global_batch_size != self.plan.global_batch_size:
            raise PlanningError("a new plan must keep the world size and the global batch size")
        if plan.mode == "layered" and self._resolved_mode == "uniform" and len(set(plan.num_micro_batches)) > 1:
            raise PlanningError("this model runs the uniform mode; re-plan with mode='uniform'")
        trainer = self.lightning_module.trainer
        epoch, step = trainer.current_epoch, self._sampler.consumed + after_steps
        steps_per_epoch = len(self._sampler)
        epoch, step = epoch + step // steps_per_epoch, step % steps_per_epoch
        self._sampler.switch_sizes(plan.batch_sizes, epoch, step)
        self._pending = (plan, epoch, step)
        return epoch, step

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        trainer = self.lightning_module.trainer
        if self.memory is not None:  # count this step's tensors, or run it at full speed
            step = trainer.global_step
            counting = step < 3 or step % self.memory_check_every_n_steps == 0
            if counting and not self.memory.active:
                self.memory.__enter__()
            elif not counting and self.memory.active:
                self.memory.__exit__(None, None, None)
        if self._pending is not None and (trainer.current_epoch, batch_idx) >= self._pending[1:]:
            plan, self._pending = self._pending[0], None
            self._reshard(plan)

    def _reshard(self, plan: Plan) -> None:
        """Re-shard the running model and optimizer state onto the new plan's shares.

        Goes through a real checkpoint of the old layout (``<root>/cephalo-replan/step=N``), loaded
        back by logical tensor exactly as a resume on the new plan would load it.
        """
        assert self.sharded is not None
        module = self.lightning_module
        trainer = module.trainer
        path = Path(trainer.default_root_dir) / "cephalo-replan" / f"step={trainer.global_step}"
        checkpoint.save_sharded(path, self.sharded, self.optimizers, {"plan": self.plan.to_dict() if self.plan else None})
        names = {id(p): name for name, p in self.sharded.named_parameters()}
        compute_dtype = next((u.compute_dtype for u in self.sharded.units if u.spans), None)
        self.sharded.release()
        self.plan = plan
        self._shard(module, compute_dtype)
        pieces = dict(self.sharded.named_parameters())
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["params"] = [pieces[names[id(p)]] for p in group["params"]]
            optimizer.state.clear()
        checkpoint.load_sharded(path, self.sharded, self.optimizers)
        rank_zero_info(f"Cephalo: re-planned at step {trainer.global_step}; checkpoint of the old layout in {path}")

    # ------------------------------------------------------------------ data

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not isinstance(dataloader, DataLoader):
            return dataloader
        if trainer.state.stage == RunningStage.TRAINING:
            return self._training_loader(dataloader)
        return self._evaluation_loader(dataloader)

    def _training_loader(self, dataloader: DataLoader) -> DataLoader:
        """Every rank the same number of steps, each its own slice of every global batch."""
        loader_batch = dataloader.batch_size
        if self.plan is None:
            batch = self.global_batch_size or loader_batch
            if batch is None:
                raise ValueError("set batch_size on the training DataLoader (the global batch) or CephaloStrategy(global_batch_size=B)")
            self.plan = Plan.even(self.world_size, batch, mode=self._resolved_mode or "layered")
        elif self.global_batch_size is None and loader_batch is not None and loader_batch != self.plan.global_batch_size:
            raise PlanningError(
                f"the training DataLoader has batch_size={loader_batch} but the plan is for a global batch of "
                f"{self.plan.global_batch_size}: set batch_size={self.plan.global_batch_size} or re-plan with "
                f"--global-batch-size {loader_batch}"
            )
        sampler = dataloader.sampler
        shuffle = isinstance(sampler, RandomSampler) or (isinstance(sampler, DistributedSampler) and sampler.shuffle)
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        self._sampler = PlannedBatchSampler(len(dataloader.dataset), self.plan.batch_sizes, self.global_rank,
                                            shuffle=shuffle, seed=seed)
        return PlannedDataLoader(dataloader.dataset, batch_sampler=self._sampler, **_loading_settings(dataloader))

    def _evaluation_loader(self, dataloader: DataLoader) -> DataLoader:
        """Evenly sharded samples (Lightning's sampler), ``batch_size / world_size`` per rank.

        The DataLoader's ``batch_size`` is a global batch here too, so an evaluation step covers
        the same samples whatever the plan (``limit_val_batches`` means the same thing under any
        plan). A device too small for that many samples in a forward pass needs a smaller
        evaluation ``batch_size`` on the DataLoader.
        """
        if dataloader.batch_size is None:
            return dataloader  # a custom batch sampler: the user decides
        size = -(-dataloader.batch_size // self.world_size)
        if size >= dataloader.batch_size:
            return dataloader
        return DataLoader(dataloader.dataset, batch_size=size, sampler=dataloader.sampler, drop_last=dataloader.drop_last,
                          **_loading_settings(dataloader))

    # ------------------------------------------------------------------ steps

    def _context(self) -> StepContext:
        assert self.plan is not None
        trainer = self.lightning_module.trainer
        scaler = getattr(self.precision_plugin, "scaler", None)
        scale = float(scaler.get_scale()) if scaler is not None else 1.0
        return StepContext(self.rank_plan, self.plan.global_batch_size, trainer.accumulate_grad_batches,
                           self._sync, scale)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._steps is not None
        batch, rest = args[0], args[1:]
        self._ctx = self._context()
        with self.precision_plugin.train_step_context():
            out = self._steps.forward(batch, self._ctx, *rest)
        if isinstance(self._steps, LayeredSteps):
            self.lightning_module.log("train_loss", out, prog_bar=True, on_step=True, on_epoch=True,
                                      sync_dist=True, batch_size=self.plan.global_batch_size)
        if self._sampler is not None:
            self._sampler.mark_consumed()
        return out

    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self._steps is not None and self._ctx is not None
        self.pre_backward(closure_loss)
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        with self.precision_plugin.train_step_context():
            self._steps.backward(closure_loss, self._ctx)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _eval_step(self, name: str, *args: Any, **kwargs: Any) -> Any:
        assert self.sharded is not None
        self.sharded.gather_root()
        try:
            return getattr(super(), name)(*args, **kwargs)
        finally:
            self.sharded.free_all()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("predict_step", *args, **kwargs)

    # ------------------------------------------------------------------ checkpoints

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.sharded is not None
        if self.state_dict_type == "full":  # collective: every rank gathers, rank 0 writes
            return checkpoint.full_model_state(self.sharded)
        return checkpoint.model_state(self.sharded)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.sharded is not None
        if self.state_dict_type == "full":
            return {}
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        index = self.optimizers.index(optimizer) if optimizer in self.optimizers else 0
        tensors, meta = checkpoint.optimizer_state(self.sharded, optimizer, f"optim.{index}")
        return {"tensors": tensors, "meta": meta}

    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath: str | Path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("CephaloStrategy.save_checkpoint(storage_options=...) is not supported")
        path = Path(self.broadcast(str(filepath)))
        state_dict = checkpoint_dict.pop("state_dict")
        optimizer_states = checkpoint_dict.pop("optimizer_states", [])
        extra = {"plan": self.plan.to_dict() if self.plan else None, "world_size": self.world_size}
        if self.state_dict_type == "full":
            if self.is_global_zero:
                from cephalo_lightning.atomic_io import write_bytes_atomic
                import io

                buffer = io.BytesIO()
                torch.save({**checkpoint_dict, "state_dict": state_dict, "cephalo": extra}, buffer)
                write_bytes_atomic(path, buffer.getvalue())
            self.barrier()
            return
        tensors = dict(state_dict)
        optim_meta = []
        for state in optimizer_states:
            tensors.update(state["tensors"])
            optim_meta.append(state["meta"])
        assert self.sharded is not None
        checkpoint.save(path, tensors, {**checkpoint_dict, "param_shapes": checkpoint.param_shapes(self.sharded),
                                        "optimizers": optim_meta, "cephalo": extra})

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.sharded is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        if checkpoint.is_checkpoint(path):
            meta = checkpoint.load_sharded(path, self.sharded, self.optimizers)
            meta.pop("param_shapes", None)
            meta.pop("optimizers", None)
            return meta
        if not path.is_file():
            raise FileNotFoundError(f"{path} is neither a Cephalo sharded checkpoint directory nor a checkpoint file")
        loaded = torch.load(path, map_location="cpu", weights_only=False)
        self._load_full_weights(loaded["state_dict"])
        rank_zero_info("Cephalo: loaded weights from a full checkpoint; optimizer state starts fresh.")
        return {k: v for k, v in loaded.items() if k not in ("optimizer_states",)}

    def _load_full_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        assert self.sharded is not None
        with torch.no_grad():
            for unit in self.sharded.units:
                for span, piece in zip(unit.spans, unit.local_params):
                    start, stop = unit.layout.param_piece(span, self.sharded.rank)
                    piece.copy_(state_dict[span.name].reshape(-1)[start:stop])

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in load_checkpoint, where the layout is known

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass

    def remove_checkpoint(self, filepath: str | Path) -> None:
        if self.is_global_zero:
            checkpoint.remove(filepath)

    # ------------------------------------------------------------------ teardown

    @contextlib.contextmanager
    def memory_untracked(self) -> Generator[None, None, None]:
        """Work that is not training (re-profiling, say) does not count against the capacity."""
        tracking = self.memory is not None and self.memory.active
        if tracking:
            self.memory.__exit__(None, None, None)
        try:
            yield
        finally:
            if tracking and self.memory is not None:
                self.memory.__enter__()

    def _stop_memory_tracking(self) -> None:
        if self.memory is not None and self.memory.active:
            self.memory.__exit__(None, None, None)
        self.memory = None

    def teardown(self) -> None:
        self._stop_memory_tracking()
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Cephalo: heterogeneous GPUs, uneven sharding", override=True
        )
