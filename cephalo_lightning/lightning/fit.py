"""What one ``fit`` runs on: the sharded module, the step runner, the guards, built once the plan is known.

:class:`FitRuntime` is built by the strategy at setup. It shards the LightningModule
(materialising a meta-device model unit by unit, from pretrained weights where given), attaches
the rank's emulator and memory tracking, and picks the step runner for the schedule
(:mod:`.schedules`). Plan switches (:class:`~.plan_switch.PlanSwitches`) and checkpoint files
(:class:`~.checkpoint_io.FitCheckpoints`) are its parts, each in its own module.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from cephalo_lightning._common import vocabulary
from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning._common.units import GIB
from cephalo_lightning.lightning import loggers
from cephalo_lightning.lightning.checkpoint_io import FitCheckpoints, globals_with_lightning
from cephalo_lightning.lightning.config import Schedule, StrategyConfig
from cephalo_lightning.lightning.discovered import LossPassLogs
from cephalo_lightning.lightning.plan_switch import PlanSwitches
from cephalo_lightning.lightning.schedules import check_plan, loss_weighting
from cephalo_lightning.lightning.steps import LayeredSteps, NonFiniteGuard, TrainingStep, UniformSteps
from cephalo_lightning.models import Resolution, hf, lora, weighting
from cephalo_lightning.models.weighting import Decision
from cephalo_lightning.planner import Plan
from cephalo_lightning.runtime import checkpoint
from cephalo_lightning.runtime.collectives import Links
from cephalo_lightning.runtime.distributed import broadcast_object, gather_objects
from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator
from cephalo_lightning.runtime.emulation.memory import SampledTracking
from cephalo_lightning.runtime.layered import LayeredSchedule
from cephalo_lightning.runtime.liveness import (
    FolderInUseError,
    Heartbeat,
    RunLock,
    dead_heartbeats,
    looks_like_lost_peer,
    os_error_line,
    probe_writable,
    remove_stale_heartbeats,
)
from cephalo_lightning.runtime.sharding.construction import ConstructionRecord
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel, UnitMaterializer
from cephalo_lightning.runtime.sharding.weights import open_weights


class FitRuntime:
    """The runtime objects of one fit (see the module docstring)."""

    def __init__(self, module: pl.LightningModule, plan: Plan, config: StrategyConfig, *, schedule: Schedule,
                 resolution: Resolution, rank: int, device: torch.device, emulator: DeviceEmulator,
                 collective: str, training_step: Callable[..., Any], links: Links | None = None,
                 construction: ConstructionRecord | None = None) -> None:
        check_plan(plan, schedule, resolution, module)  # before any shard is built
        self.module = module
        self.config = config
        self.schedule = schedule
        self.resolution = resolution
        self.rank = rank
        self.loss = loss_weighting(config.loss_weighting, resolution, module)
        self.weighting = self.loss.weighting
        _say_weighting(self.loss, config.router_aux_loss, module)
        self.layered_model = resolution.layered if schedule == vocabulary.Schedule.LAYERED else None
        if self.layered_model is not None and (note := recomputed_twice(module)):
            rank_zero_info(note)
        self.sharded = _shard(module, plan, config, resolution, device, collective, self.layered_model, links, construction)
        self._check_gathers(plan)
        module.to(device)  # buffers; the local pieces are already there
        if emulator.is_emulated:  # a real device gets no observer at all (no clock, no state)
            self.sharded.observers.attach(emulator)
        self.memory = _memory_tracking(self.sharded, emulator, device, config.memory_check_every_n_steps)
        self.steps = self._steps(device, emulator, training_step)
        self.guard = NonFiniteGuard(config.max_nonfinite_skips)
        self.switches = PlanSwitches(plan, self.sharded, lambda p: check_plan(p, self.schedule, resolution, module),
                                     resharded=self._check_gathers)
        self.checkpoints = FitCheckpoints(self.sharded, config, rank, lambda: self.plan, hf.checkpoint_info(module))

    def _check_gathers(self, plan: Plan) -> None:
        """Collective: warn where the model, sharded by ``plan``, holds in-flight all-gather buffers
        beyond the room the plan leaves below a rank's memory limit (:func:`unpriced_gathers`)."""
        warning = unpriced_gathers(gather_objects(_gather_room(self.sharded, plan, self.rank)))
        if warning:
            rank_zero_warn(warning)

    def _steps(self, device: torch.device, emulator: DeviceEmulator,
               training_step: Callable[..., Any]) -> LayeredSteps | UniformSteps:
        layered, config = self.layered_model, self.config
        if layered is None:
            return UniformSteps(self.module, self.sharded, training_step, self.weighting)
        offload = stash_offloaded(config.offload, device, emulator)
        tolerance = 1e-3 if (config.param_dtype or torch.float32).itemsize >= 4 else 3e-2
        layered = dataclasses.replace(layered, weighting=self.weighting)  # the fit's decision (loss_weighting=)
        logs = LossPassLogs(self.module) if layered.discovery is not None else None
        layers = logs.wrap(layered.layers) if logs is not None else layered.layers
        return LayeredSteps(self.module, LayeredSchedule(self.sharded, layers, offload=offload), layered,
                            verify_loss=config.verify_loss, tolerance=tolerance,
                            fallback=lambda why: self._fall_back(why, training_step), logs=logs)

    def _fall_back(self, why: str, training_step: Callable[..., Any]) -> UniformSteps:
        """The first step found that a discovered block sequence does not hold: the uniform mode
        from then on, when the plan allows it (one micro-batch count on every rank)."""
        name = self.layered_model.name
        counts = self.plan.num_micro_batches
        if len(set(counts)) > 1:
            raise ConfigurationError(
                f"Cephalo cannot run {name} layer by layer: {why}. The plan gives ranks different micro-batch counts "
                f"{list(counts)}, which only the layered mode can run: re-plan with mode='uniform' (one count on "
                "every rank), or give the LightningModule the layered protocol (cephalo_layers, cephalo_input, "
                "cephalo_loss)")
        rank_zero_info(f"Cephalo: the uniform mode for {name}: the discovered block sequence does not hold ({why})")
        self.schedule, self.layered_model = "uniform", None
        return UniformSteps(self.module, self.sharded, training_step, self.weighting)

    @property
    def plan(self) -> Plan:
        """The plan the model is sharded under now."""
        return self.switches.plan

    def describe(self) -> str:
        what = self.layered_model.name if self.layered_model is not None else type(self.module).__name__
        built = f", {self.sharded.materialized_units} units materialised from meta" if self.sharded.materialized_units else ""
        return (f"Cephalo: {self.schedule} mode ({what}), {len(self.sharded.units)} units, state shares "
                f"{[round(s, 4) for s in self.plan.state_shares]}, losses weighted by "
                f"{self.loss.words}{built}")

    def start_fit(self, trainer: pl.Trainer, token: str, cluster: Any, reported_elsewhere: bool) -> FailureReport:
        """Collective, before a fit trains: refuse hyperparameters a checkpoint could not load back,
        claim the run's folders (:func:`claim_folders`), clean up what an interrupted save or a killed
        run left, start the heartbeat, report the run to the loggers (unless ``reported_elsewhere``:
        a callback reports it with its profile)."""
        for hparams in (self.module.hparams, getattr(trainer.datamodule, "hparams", {})):
            checkpoint.check_loadable(dict(hparams), globals_with_lightning(self.config.safe_globals), "the hyperparameters")
        root = Path(trainer.default_root_dir) / ".cephalo"
        locks, dead = claim_folders(trainer, root)
        try:
            if trainer.is_global_zero:
                for folder in checkpoint_folders(trainer):
                    checkpoint.clean_stale(folder)
                for directory in remove_stale_heartbeats(root, dead):
                    rank_zero_info(f"Cephalo: removed {directory}, the heartbeats of a run whose processes are gone")
            if not reported_elsewhere:
                loggers.log_run(trainer, self.plan, cluster)
            heartbeat = Heartbeat(root / f"heartbeat-{token}", self.rank, self.sharded.world_size).start()
        except BaseException:
            for lock in locks:  # no FailureReport holds them yet
                lock.release()
            raise
        return FailureReport(heartbeat, locks)

    # ------------------------------------------------------------------ steps

    def start_step(self, trainer: pl.Trainer, sync: bool, scaler: Any, args: tuple) -> TrainingStep:
        """The state of the training step that starts now (``args``: training_step's after the batch)."""
        # the scale as a device tensor (scaler.scale multiplies on the device: no host sync per step)
        scale = scaler.scale(torch.ones((), device=self.sharded.device)) if scaler is not None else 1.0
        plan = self.plan
        return TrainingStep(plan.ranks[self.rank], plan.global_batch_size, trainer.accumulate_grad_batches, sync,
                            scale, args)

    @contextlib.contextmanager
    def step_scope(self, step: int) -> Iterator[None]:
        """The ``with`` block around each piece of a training step (memory accounting)."""
        if self.memory is None:
            yield
            return
        with self.memory.step(step):
            yield


def _say_weighting(loss: Decision, router_aux_loss: str, module: pl.LightningModule) -> None:
    """Once at setup: a weighting chosen without certainty, and a router term that depends on the plan."""
    if loss.note:
        rank_zero_info(loss.note)
    if loss.router_aux and router_aux_loss == "exclude":
        rank_zero_info(f"Cephalo: router_aux_loss='exclude': {weighting.exclude_router_aux(module)}")
    elif loss.router_aux:
        rank_zero_warn(weighting.router_aux_warning(loss.router_aux))


def recomputed_twice(module: torch.nn.Module) -> str | None:
    """A note when the model's own activation checkpointing is on (Hugging Face's
    ``gradient_checkpointing_enable()`` marks each checkpointed layer): on a rank that recomputes
    (the default) the layered schedule already runs every layer again inside its backward, so the
    library's checkpoint recomputes it once more, a forward per layer and micro-batch that saves no
    memory. Exact either way (tested)."""
    names = sorted({type(m).__name__ for m in module.modules() if getattr(m, "gradient_checkpointing", False) is True})
    if not names:
        return None
    return (f"Cephalo: the model's activation checkpointing is on ({', '.join(names)}); the layered schedule already "
            "recomputes each layer in its backward (ranks with recompute, the default), where the checkpoint adds one "
            "more forward per layer and micro-batch and saves no memory: `model.gradient_checkpointing_disable()` "
            "avoids it")


def _shard(module: pl.LightningModule, plan: Plan, config: StrategyConfig, resolution: Resolution,
           device: torch.device, collective: str, layered: Any, links: Links | None,
           construction: ConstructionRecord | None) -> ShardedModel:
    """The module sharded by ``plan``'s shard groups and state shares (each group holds a replica),
    a meta-device model materialised unit by unit (its buffers from ``construction`` where nothing
    else gives them); ``links`` slows the collectives crossing emulated links."""
    source = None
    if config.pretrained is not None:
        source = open_weights(config.pretrained, _prefix_of(module, resolution.model), lora.WRAPPED_SEGMENTS)
    try:
        return ShardedModel(
            module, plan.state_shares, shard_groups=plan.shard_groups, links=links,
            units=layered.units if layered is not None else config.units,
            collective=collective, compute_dtype=config.param_dtype, prefetch=config.prefetch, device=device,
            overlap=config.overlap,
            materializer=UnitMaterializer(device, init=resolution.init, source=source, seed=config.seed or 0,
                                          fresh=frozenset(lora.adapter_parameters(module)), construction=construction),
        )
    finally:
        if source is not None:
            unused = source.unused()
            source.close()
            if unused:
                rank_zero_info(f"Cephalo: {len(unused)} tensors of {config.pretrained} were not used, e.g. {unused[:3]}")


def _gather_room(sharded: ShardedModel, plan: Plan, rank: int) -> tuple[int, int, float | None]:
    """(rank, bytes its prefetched all-gathers hold unpriced, bytes the plan leaves below its memory limit)."""
    r = plan.ranks[rank]
    room = None if r.memory_limit_gb is None or r.predicted_memory_gb is None else (
        (r.memory_limit_gb - r.predicted_memory_gb) * GIB)
    return rank, sharded.in_flight_gather_bytes(), room


def unpriced_gathers(rows: Sequence[tuple[int, int, float | None]]) -> str | None:
    """A warning naming the ranks whose in-flight all-gather buffers, which the cost model does not
    price, exceed what their plan leaves below its memory limit (None: no rank)."""
    short = [(rank, held, room) for rank, held, room in rows if held and room is not None and held > room]
    if not short:
        return None
    ranks = "; ".join(f"rank {rank}: {held / 2**20:.1f} MiB against {max(room, 0.0) / 2**20:.1f} MiB"
                      for rank, held, room in short)
    return ("Cephalo: with collective='padded', a prefetched all-gather of a unit whose shards are uneven holds "
            "its padded shard and a staging buffer of one padded shard per rank beside the layer computing, "
            f"which the plan does not price and which exceeds the room the plan leaves below the memory limit ({ranks}); "
            "the step may run out of memory. CephaloStrategy(collective='exact') holds no such buffer.")


def stash_offloaded(offload: bool | None, device: torch.device, emulator: DeviceEmulator) -> bool:
    """Whether the layered stash lives on the host: as asked, else on CUDA and on an emulated GPU (whose
    stash stays on the host as the real one's would, accounted as host memory)."""
    return offload if offload is not None else (device.type == "cuda" or emulator.memory_gb is not None)


def _memory_tracking(sharded: ShardedModel, emulator: DeviceEmulator, device: torch.device,
                     every_n_steps: int) -> SampledTracking | None:
    """An emulated capacity: CUDA's allocator capped, or on CPU the tracked bytes checked."""
    if emulator.memory_gb is None:
        return None
    if device.type == "cuda":  # pragma: no cover - CUDA only
        emulator.cap_cuda_memory(device)
        return None
    # the local state (fp32 master) is resident before tracking starts
    tracker = emulator.memory_tracker(baseline_bytes=sharded.local_state_numel() * 4)
    return SampledTracking(tracker, sharded.observers, every_n_steps)


def _prefix_of(module: torch.nn.Module, model: torch.nn.Module | None) -> str:
    """The attribute path of the library model inside the LightningModule, as a name prefix."""
    if model is None:
        return ""
    for name, sub in module.named_modules():
        if sub is model:
            return f"{name}." if name else ""
    return ""


def checkpoint_folders(trainer: pl.Trainer) -> list[Path]:
    """The distinct folders the fit's checkpoint callbacks write (resolved by their setup)."""
    folders = [Path(c.dirpath) for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None)]
    return list(dict.fromkeys(folders))


def claim_folders(trainer: pl.Trainer, root: Path) -> tuple[list[RunLock], list[str]]:
    """Collective, before the fit writes or deletes anything: rank 0 locks every checkpoint folder
    (refused while another live run holds one); then every rank checks it can write there and in
    ``root``, where the heartbeats go, and names the heartbeat files of dead processes its host can
    tell. Every rank raises the same error when any rank found a problem. Returns rank 0's locks
    and the union of the dead heartbeat files."""
    folders = checkpoint_folders(trainer)
    roles = {**{f: "a checkpoint folder" for f in folders}, root: "under Trainer(default_root_dir)"}
    locks: list[RunLock] = []
    refusal, unwritable = None, {}
    if trainer.is_global_zero:
        for folder in folders:
            try:
                locks.append(RunLock.acquire(folder, rank_zero_info))
            except FolderInUseError as err:
                refusal = str(err)
                break
            except OSError as err:
                unwritable[folder] = os_error_line(err)
    refusal = broadcast_object(refusal)
    if refusal is None:
        for folder in roles:
            why = unwritable.get(folder) or probe_writable(folder)
            if why is not None:
                unwritable[folder] = why
    problems = [f"rank {trainer.global_rank} cannot write to {folder} ({roles[folder]}): {why}"
                for folder, why in unwritable.items()]
    gathered = gather_objects((problems, dead_heartbeats(root) if refusal is None else []))
    problems = [line for rank_problems, _ in gathered for line in rank_problems]
    if refusal is not None or problems:
        for lock in locks:
            lock.release()
        raise FolderInUseError(refusal) if refusal is not None else ConfigurationError(
            "Cephalo: " + "; ".join(problems) + ". Every rank writes its part of each checkpoint and its heartbeat: "
            "give folders every rank can write (shared across nodes), with Trainer(default_root_dir=...) or "
            "ModelCheckpoint(dirpath=...), or make these writable.")
    return locks, [file for _, dead in gathered for file in dead]


class FailureReport:
    """While a fit runs: heartbeats, the folder locks, and, when a collective fails, which rank
    stopped and where to resume."""

    def __init__(self, heartbeat: Heartbeat, locks: Sequence[RunLock] = ()) -> None:
        self.heartbeat = heartbeat
        self.locks = list(locks)
        self.last_checkpoint: Path | None = None

    def close(self) -> None:
        """The fit ended (also by an exception): stop the heartbeat, release the folders."""
        self.heartbeat.stop()
        for lock in self.locks:
            lock.release()
        self.locks = []

    def resume_hint(self) -> str:
        return (f" Resume with trainer.fit(..., ckpt_path={str(self.last_checkpoint)!r})." if self.last_checkpoint
                else " No checkpoint was written yet.")

    def describe(self, exception: BaseException) -> str | None:
        if not looks_like_lost_peer(exception):
            return None
        suspects = self.heartbeat.suspects()
        first_line = str(exception).splitlines()[0] if str(exception) else ""
        return (f"Cephalo (rank {self.heartbeat.rank}): a collective failed ({type(exception).__name__}: {first_line}). "
                + ("Stopped: " + "; ".join(suspects) + "." if suspects else "No peer is known to have stopped.")
                + self.resume_hint())
