"""What one ``fit`` runs on: the sharded module, its plan versions, the step runner, the guards.

:class:`FitRuntime` is built by the strategy at setup, once the plan is known. It decides the mode
from what :func:`cephalo_lightning.models.resolve` found, shards the LightningModule (materialising
a meta-device model unit by unit, from pretrained weights where given), attaches the rank's
emulator, and owns everything the strategy delegates to: steps, plan switches, memory tracking,
the non-finite guard and checkpoint assembly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer

from cephalo_lightning.lightning import reporting
from cephalo_lightning.lightning.config import StrategyConfig
from cephalo_lightning.lightning.steps import LayeredSteps, NonFiniteGuard, StepContext, StepReport, UniformSteps
from cephalo_lightning.models import SUPPORTED, Resolution, hf
from cephalo_lightning.models.protocol import LossWeighting
from cephalo_lightning.planner import Plan, PlanningError
from cephalo_lightning.runtime import checkpoint
from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator
from cephalo_lightning.runtime.emulation.memory import SampledTracking
from cephalo_lightning.runtime.layered import LayeredSchedule
from cephalo_lightning.runtime.liveness import Heartbeat, looks_like_lost_peer
from cephalo_lightning.runtime.plan_state import CutBatch, PlanState
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel, UnitMaterializer
from cephalo_lightning.runtime.sharding.weights import open_weights


def decide_mode(requested: str, resolution: Resolution, module: pl.LightningModule) -> str:
    """``layered`` when the model has a layered form (or was asked for), else ``uniform``."""
    layered_ok = resolution.layered is not None
    manual = not module.automatic_optimization
    if requested == "layered" and (not layered_ok or manual):
        why = "manual optimization runs your training_step itself" if manual else resolution.reason
        raise TypeError(f"mode='layered' is not possible: {why}. Supported: {'; '.join(SUPPORTED)}. Or use mode='uniform'")
    mode = requested if requested != "auto" else ("layered" if layered_ok and not manual else "uniform")
    if requested == "auto" and mode == "uniform":
        why = "manual optimization (automatic_optimization=False)" if manual else resolution.reason
        rank_zero_info(f"Cephalo: {why}; using the uniform mode (your training_step per micro-batch, one micro-batch "
                       f"count on every rank). The layered mode supports {'; '.join(SUPPORTED)}.")
    return mode


def check_plan(plan: Plan, mode: str, resolution: Resolution, module: pl.LightningModule) -> None:
    """What the mode can run: every plan a fit adopts (given, planned at setup, or re-planned)
    passes here, so none can train on part of its batches."""
    manual = not module.automatic_optimization
    if mode == "uniform" and len(set(plan.num_micro_batches)) > 1:
        raise PlanningError(
            f"the plan gives ranks different micro-batch counts {plan.num_micro_batches}, which needs the layered mode "
            f"(here: {resolution.reason or 'manual optimization'}); re-plan with --mode uniform"
        )
    if manual and max(plan.num_micro_batches) > 1:  # the manual step runs training_step on one micro-batch
        raise PlanningError(
            f"manual optimization runs your training_step once per step on each rank, but the plan gives ranks "
            f"{plan.num_micro_batches} micro-batches; re-plan with one micro-batch per rank or use automatic optimization"
        )


def loss_weighting(requested: str, resolution: Resolution) -> LossWeighting:
    if requested == "samples":
        return LossWeighting("samples")
    if requested == "tokens":
        return resolution.weighting if resolution.weighting.kind == "items" else LossWeighting("items", hf.label_count)
    return resolution.weighting


class FitRuntime:
    """The runtime objects of one fit (see the module docstring)."""

    def __init__(self, module: pl.LightningModule, plan: Plan, config: StrategyConfig, *, mode: str,
                 resolution: Resolution, rank: int, device: torch.device, emulator: DeviceEmulator,
                 collective: str, training_step: Any) -> None:
        check_plan(plan, mode, resolution, module)  # before any shard is built
        self.module = module
        self.config = config
        self.mode = mode
        self.rank = rank
        self.emulator = emulator
        self.plan_state = PlanState(plan)
        self.weighting = loss_weighting(config.loss_weighting, resolution)
        layered = resolution.layered if mode == "layered" else None
        source = None
        if config.pretrained is not None:
            prefix = _prefix_of(module, resolution.model)
            source = open_weights(config.pretrained, prefix)
        try:
            self.sharded = ShardedModel(
                module, plan.state_shares, units=layered.units if layered is not None else config.units,
                collective=collective, compute_dtype=config.param_dtype, prefetch=config.prefetch, device=device,
                overlap=config.overlap,
                materializer=UnitMaterializer(device, init=resolution.init, source=source, seed=config.seed or 0),
            )
        finally:
            if source is not None:
                unused = source.unused()
                source.close()
                if unused:
                    rank_zero_info(f"Cephalo: {len(unused)} tensors of {config.pretrained} were not used, e.g. {unused[:3]}")
        module.to(device)  # buffers; the local pieces are already there
        if emulator.is_emulated:  # a real device gets no observer at all (no clock, no state)
            self.sharded.observers.attach(emulator)
        self.memory: SampledTracking | None = None
        if emulator.memory_gb is not None:
            if device.type == "cuda":  # pragma: no cover - CUDA only
                emulator.cap_cuda_memory(device)
            else:  # the local state (fp32 master) is resident before tracking starts
                tracker = emulator.memory_tracker(baseline_bytes=self.sharded.local_state_numel() * 4)
                self.memory = SampledTracking(tracker, self.sharded.observers, config.memory_check_every_n_steps)
        if layered is not None:
            # an emulated GPU keeps its stash on the host, as the real one would (accounted as host memory)
            offload = config.offload if config.offload is not None else (device.type == "cuda" or emulator.memory_gb is not None)
            schedule = LayeredSchedule(self.sharded, layered.layers, offload=offload)
            tolerance = 1e-3 if (config.param_dtype or torch.float32).itemsize >= 4 else 3e-2
            self.steps: LayeredSteps | UniformSteps = LayeredSteps(
                module, schedule, layered, recompute=self._recompute(plan), verify_loss=config.verify_loss,
                tolerance=tolerance)
        else:
            self.steps = UniformSteps(module, self.sharded, training_step, self.weighting)
        self.guard = NonFiniteGuard(config.max_nonfinite_skips)
        self.layered_model = layered
        self.resolution = resolution

    def start_fit(self, trainer: pl.Trainer, token: str, cluster: Any) -> FailureReport:
        """Before a fit trains: refuse hyperparameters a checkpoint could not load back, clean up
        what an interrupted save left, start the heartbeat, report the run to the loggers."""
        for hparams in (self.module.hparams, getattr(trainer.datamodule, "hparams", {})):
            checkpoint.check_loadable(dict(hparams), self.config.safe_globals, "the hyperparameters")
        if trainer.is_global_zero:
            for callback in trainer.checkpoint_callbacks:
                if getattr(callback, "dirpath", None):
                    checkpoint.clean_stale(callback.dirpath)
        if not any(type(c).__name__ == "CephaloCallback" for c in trainer.callbacks):
            reporting.log_run(trainer, self.plan, cluster)
        directory = Path(trainer.default_root_dir) / ".cephalo" / f"heartbeat-{token}"
        return FailureReport(Heartbeat(directory, self.rank, self.sharded.world_size).start())

    def _recompute(self, plan: Plan) -> bool:
        """Whether this rank recomputes each layer in the backward pass (the plan's choice: a rank
        with one micro-batch may keep its graph where its memory allows)."""
        return plan.ranks[self.rank].recompute

    @property
    def plan(self) -> Plan:
        return self.plan_state.plan

    def describe(self) -> str:
        what = self.layered_model.name if self.layered_model is not None else type(self.module).__name__
        built = f", {self.sharded.materialized_units} units materialised from meta" if self.sharded.materialized_units else ""
        return (f"Cephalo: {self.mode} mode ({what}), {len(self.sharded.units)} units, state shares "
                f"{[round(s, 4) for s in self.plan.state_shares]}, losses weighted by "
                f"{'items (non-ignored label tokens)' if self.weighting.kind == 'items' else 'samples'}{built}")

    # ------------------------------------------------------------------ steps

    def context(self, trainer: pl.Trainer, sync: bool, scaler: Any, batch_idx: int) -> StepContext:
        plan = self.plan
        # the scale as a device tensor (scaler.scale multiplies on the device: no host sync per step)
        scale = scaler.scale(torch.ones((), device=self.sharded.device)) if scaler is not None else 1.0
        return StepContext(plan.ranks[self.rank], plan.global_batch_size, trainer.accumulate_grad_batches, sync,
                           scale, trainer.global_step, batch_idx)

    @contextlib.contextmanager
    def step_scope(self, step: int) -> Iterator[None]:
        """The ``with`` block around each piece of a training step (memory accounting)."""
        if self.memory is None:
            yield
            return
        with self.memory.step(step):
            yield

    def next_batch(self) -> CutBatch:
        """The record of the batch this step trains on; it must have been cut under the plan the
        model is sharded by (a switch waits for the batches cut before it)."""
        record = self.plan_state.next_batch()
        if record.version != self.plan_state.sharded_version:
            raise RuntimeError(f"a batch cut under plan version {record.version} reached a model sharded under "
                               f"version {self.plan_state.sharded_version}")
        return record

    def record(self, report: StepReport) -> None:
        self.guard.record(report)

    # ------------------------------------------------------------------ plan switches

    def schedule(self, plan: Plan, accumulate: int) -> tuple[int, int]:
        """Collective: ``plan`` takes effect at the first step no rank has cut data for (at an
        optimizer-step boundary); batches already cut keep the old plan."""
        check_plan(plan, self.mode, self.resolution, self.module)
        at = torch.tensor(self.plan_state.first_uncut(), dtype=torch.int64)
        self.sharded.comm.all_reduce_max(at)
        epoch, step = (int(v) for v in at.tolist())
        step = -(-step // accumulate) * accumulate
        self.plan_state.schedule(plan, (epoch, step))
        return epoch, step

    def switch_now(self, optimizers: Sequence[Optimizer]) -> None:
        """Adopt the latest plan version at once (nothing was cut under the current one)."""
        latest = self.plan_state.latest
        self.sharded.reshard(latest.plan.state_shares, optimizers)
        self.plan_state.sharded_version = latest.version
        if isinstance(self.steps, LayeredSteps):
            self.steps.recompute = self._recompute(latest.plan)

    def switch_if_due(self, optimizers: Sequence[Optimizer]) -> bool:
        """Before training on the next batch: re-shard if it was cut under a newer plan."""
        upcoming = self.plan_state.peek()
        if upcoming is None or upcoming.version == self.plan_state.sharded_version:
            return False
        version = self.plan_state.versions[upcoming.version]
        self.sharded.reshard(version.plan.state_shares, optimizers)
        self.plan_state.sharded_version = version.version
        if isinstance(self.steps, LayeredSteps):
            self.steps.recompute = self._recompute(version.plan)
        return True

    # ------------------------------------------------------------------ checkpoints

    def save(self, path: Path, checkpoint_dict: dict[str, Any], optimizers: Sequence[Optimizer]) -> Path:
        """Collective: a sharded checkpoint directory, or with ``state_dict_type="full"`` one file
        (consolidated on rank 0 from a sharded one written beside it). ``checkpoint_dict`` without
        ``optimizer_states`` (``save_weights_only``) saves no optimizer state."""
        meta = {k: v for k, v in checkpoint_dict.items() if k not in ("state_dict", "optimizer_states")}
        info = {"plan": self.plan.to_dict(), "world_size": self.sharded.world_size}
        optimizers = optimizers if "optimizer_states" in checkpoint_dict else []
        if self.config.state_dict_type == "sharded":
            return checkpoint.save(path, self.sharded, optimizers, meta, info, self.config.safe_globals)
        staging = path.with_name(f".{path.name}.sharded")
        checkpoint.save(staging, self.sharded, optimizers, meta, info, self.config.safe_globals)
        if self.rank == 0:
            checkpoint.consolidate(staging, path, self.config.safe_globals, verify_checksums=False)  # hashed by save
            checkpoint.remove(staging)
        return path

    def load(self, path: Path, optimizers: Sequence[Optimizer], weights_only: bool | None = None) -> dict[str, Any]:
        """Collective: a sharded directory (any layout) or a single file (weights only)."""
        trusted = weights_only is False  # an explicit opt-in to unpickling meta.pt (never DCP's metadata)
        if path.is_dir() or checkpoint.is_checkpoint(path) or not path.exists():
            meta, _ = checkpoint.load(path, self.sharded, optimizers, self.config.safe_globals,
                                      self.config.verify_checksums, trusted=trusted)
            return meta
        rank_zero_info("Cephalo: loading weights from a single-file checkpoint; optimizer state starts fresh.")
        return self.load_full(path, trusted)

    def load_full(self, path: Path, trusted: bool = False) -> dict[str, Any]:
        """Weights from a single-file checkpoint (optimizer state starts fresh)."""
        loaded = checkpoint.safe_load(path, self.config.safe_globals, trusted=trusted)
        state = loaded.get("state_dict", loaded)
        with torch.no_grad():
            for name, piece in self.sharded.named_parameters():
                if name not in state:
                    raise checkpoint.CheckpointError(f"{path} has no weights for {name!r}")
                unit = next(u for u in self.sharded.units if any(s.name == name for s in u.spans))
                index = [s.name for s in unit.spans].index(name)
                start, stop = unit.local_range(index)
                piece.copy_(state[name].reshape(-1)[start:stop].view(piece.shape))
        return {k: v for k, v in loaded.items() if k not in ("optimizer_states", "state_dict")}


def _prefix_of(module: torch.nn.Module, model: torch.nn.Module | None) -> str:
    """The attribute path of the library model inside the LightningModule, as a name prefix."""
    if model is None:
        return ""
    for name, sub in module.named_modules():
        if sub is model:
            return f"{name}." if name else ""
    return ""


class FailureReport:
    """Heartbeats while training; when a collective fails, which rank stopped and where to resume."""

    def __init__(self, heartbeat: Heartbeat) -> None:
        self.heartbeat = heartbeat
        self.last_checkpoint: Path | None = None

    def describe(self, exception: BaseException) -> str | None:
        if not looks_like_lost_peer(exception):
            return None
        suspects = self.heartbeat.suspects()
        first_line = str(exception).splitlines()[0] if str(exception) else ""
        return (f"Cephalo (rank {self.heartbeat.rank}): a collective failed ({type(exception).__name__}: {first_line}). "
                + ("Stopped: " + "; ".join(suspects) + "." if suspects else "No peer is known to have stopped.")
                + (f" Resume with trainer.fit(..., ckpt_path={str(self.last_checkpoint)!r})." if self.last_checkpoint
                   else " No checkpoint was written yet."))
