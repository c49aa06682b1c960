"""What one ``fit`` runs on: the sharded module, the step runner, the guards, built once the plan is known.

:class:`FitRuntime` is built by the strategy at setup. It shards the LightningModule
(materialising a meta-device model unit by unit, from pretrained weights where given), attaches
the rank's emulator and memory tracking, and picks the step runner for the schedule
(:mod:`.schedules`). Plan switches (:class:`~.plan_switch.PlanSwitches`) and checkpoint files
(:class:`~.checkpoint_io.FitCheckpoints`) are its parts, each in its own module; the run's folders
and failure report are :mod:`.run_folders`'.

[Note: one training step's state] Lightning calls the strategy's ``training_step``, ``backward``
and ``optimizer_step`` separately; they call :meth:`FitRuntime.forward`, :meth:`FitRuntime.backward`
and :meth:`FitRuntime.before_optimizer_step`. The forward makes the step's state (one object per
mode, :mod:`.step_state`) and the runtime holds it only while the step runs: until the end of its
backward under automatic optimization, to the end of the forward under manual optimization (whose
backward and optimizer step run inside the user's ``training_step``).

[Note: one owner of the step runner] :attr:`FitRuntime.steps` is the runtime's alone. Where the first
step finds that a discovered block sequence does not hold, the layered runner's ``start`` returns a
:class:`~.layered_steps.FallBack` instead of a step, and :meth:`FitRuntime.forward` swaps in the
uniform runner (:meth:`FitRuntime._fall_back`), whose ``start`` then begins the same step.

[Note: a pipelined plan's runtime] A plan with stages (``plan.stage_layers``) builds this rank's
stage (:class:`~cephalo_lightning.runtime.pipelining.runner.PipelineRunner`) over the layered form's
layers instead of sharding the whole module: :attr:`FitRuntime.sharded` is the stage's, spanning the
stage's ranks; the step (:class:`~cephalo_lightning.lightning.steps.pipeline_steps.PipelineSteps`)
agrees over the whole world; the optimizers keep the stage's pieces
(:meth:`FitRuntime.keep_stage_pieces`); clipping is the runner's global norm; a checkpoint is one
save over every stage (:mod:`~cephalo_lightning.runtime.pipelining.stage_checkpoint`), loaded into a
stage by the names in the model; validation, test and predict steps run through the pipeline. What it
cannot run yet (plan switches, accumulation, fault tolerance, elastic restarts) is refused at setup,
naming the fix (:func:`pipeline_obstacle` in the same words, for planning without pipelines).
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
from torch.optim import Optimizer

from cephalo_lightning._common import vocabulary
from cephalo_lightning._common.errors import ConfigurationError, UnsupportedError
from cephalo_lightning._common.units import GIB
from cephalo_lightning.lightning.fit import loggers
from cephalo_lightning.lightning.fit.checkpoint_io import FitCheckpoints, globals_with_lightning
from cephalo_lightning.lightning.fit.nonfinite import NonFiniteGuard
from cephalo_lightning.lightning.fit.plan_switch import PlanSwitches
from cephalo_lightning.lightning.fit.run_folders import FailureReport, checkpoint_folders, claim_folders
from cephalo_lightning.lightning.steps.discovered import LossPassLogs
from cephalo_lightning.lightning.steps.layered_steps import FallBack, LayeredSteps
from cephalo_lightning.lightning.steps.pipeline_steps import PipelineSteps, item_count, weighted_loss
from cephalo_lightning.lightning.steps.schedules import check_plan, loss_weighting
from cephalo_lightning.lightning.steps.step_state import (
    LayeredStep,
    StepContext,
    StepReport,
    StopSignalProbe,
    UniformStep,
    no_stop_signal,
)
from cephalo_lightning.lightning.steps.uniform_steps import UniformSteps
from cephalo_lightning.lightning.strategy_config import StrategyConfig
from cephalo_lightning.models import Resolution, hf, lora, weighting
from cephalo_lightning.models.weighting import Decision
from cephalo_lightning.planner import Plan, RankPlan
from cephalo_lightning.runtime import checkpoint
from cephalo_lightning.runtime.collectives import Links
from cephalo_lightning.runtime.distributed import gather_objects
from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator
from cephalo_lightning.runtime.emulation.memory import MemoryTracker, SampledTracking
from cephalo_lightning.runtime.layered import LayeredSchedule
from cephalo_lightning.runtime.liveness import (
    Heartbeat,
    remove_stale_heartbeats,
)
from cephalo_lightning.runtime.observers import Observers
from cephalo_lightning.runtime.pipelining.runner import PipelineRunner
from cephalo_lightning.runtime.pipelining.stages import PipelineLayout
from cephalo_lightning.runtime.plan_state import CutBatch, PlanState
from cephalo_lightning.runtime.sharding import handback
from cephalo_lightning.runtime.sharding.construction import ConstructionRecord
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel, ShardSummary, UnitMaterializer
from cephalo_lightning.runtime.sharding.uniform_hooks import Driver
from cephalo_lightning.runtime.sharding.weights import open_weights


class FitRuntime:
    """The runtime objects of one fit (see the module docstring)."""

    def __init__(self, module: pl.LightningModule, plan: Plan, config: StrategyConfig, *, schedule: vocabulary.Schedule,
                 resolution: Resolution, rank: int, device: torch.device, emulator: DeviceEmulator,
                 collective: str, training_step: Callable[..., Any], links: Links | None = None,
                 construction: ConstructionRecord | None = None, frozen_dtype: torch.dtype | None = None) -> None:
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
        self.world_size = plan.world_size
        self.pipeline: PipelineRunner | None = None
        if plan.pipelined:  # [Note: a pipelined plan's runtime]
            refuse_pipelined_options(config)
            self.pipeline = _pipeline(module, plan, config, self.layered_model, self.weighting, device, links)
            self.sharded = self.pipeline.sharded
        else:
            self.sharded = _shard(module, plan, config, resolution, device, collective, self.layered_model, links,
                                  construction, frozen_dtype)
        self.shard_summary = self.sharded.summary()  # what this rank holds under the plan in force
        self._warn_unpriced_buffers(plan, self.shard_summary)
        # buffers; the local pieces are already there. The modules hold the full parameters meanwhile:
        # a quantised frozen piece lives on the meta device, which .to() cannot move
        for unit in self.sharded.units:
            unit.use_full()
        if self.pipeline is None:
            module.to(device)
        else:  # other stages' parameters are meta (no storage): they stay so
            module._apply(lambda t: t if t.is_meta else t.to(device))
        for unit in self.sharded.units:
            unit.use_local()
        if emulator.is_emulated:  # a real device gets no observer at all (no clock, no state)
            self.sharded.observers.attach(emulator)
        self.memory = _memory_tracking(self.shard_summary, self.sharded.observers, emulator, device,
                                       config.memory_check_every_n_steps)
        self._training_step = training_step  # the user's, which the uniform runner calls (also after a fallback)
        self.steps = self._steps(device, emulator)
        self._step: LayeredStep | UniformStep | None = None  # the step in progress (see the module note)
        self.guard = NonFiniteGuard(config.max_nonfinite_skips)
        self.switches = PlanSwitches(plan, self.sharded, lambda p: self._check_switch(p, resolution),
                                     resharded=self._resharded)
        self.checkpoints = FitCheckpoints(self.sharded, config, rank, lambda: self.plan, hf.checkpoint_info(module),
                                          stage=self.pipeline)

    def _check_switch(self, plan: Plan, resolution: Resolution) -> None:
        """A plan the fit would switch to (a re-plan, the callback's): what the schedule runs, and no
        switch to or from a pipelined plan (its stages are built once, at setup)."""
        if self.pipeline is not None or plan.pipelined:
            raise UnsupportedError(
                "a plan switch to or from a pipelined plan is not possible: a pipelined plan's stages are built once, "
                "at setup. Give the pipelined plan at setup (CephaloStrategy(plan=...)) without CephaloCallback "
                "re-planning, or re-plan without pipelines (`python -m cephalo_lightning plan --no-pipelines`)")
        check_plan(plan, self.schedule, resolution, self.module)

    def _resharded(self, plan: Plan) -> None:
        """Collective, after a plan switch re-sharded the model: what this rank holds now, checked."""
        self.shard_summary = self.sharded.summary()
        self._warn_unpriced_buffers(plan, self.shard_summary)

    def _warn_unpriced_buffers(self, plan: Plan, held: ShardSummary) -> None:
        """Collective: warn where the model, sharded by ``plan``, holds padded collective buffers beyond
        the room the plan leaves below a rank's memory limit (:func:`unpriced_buffers`)."""
        warning = unpriced_buffers(gather_objects(_unpriced_room(held, plan, self.rank)))
        if warning:
            rank_zero_warn(warning)

    def _steps(self, device: torch.device, emulator: DeviceEmulator) -> LayeredSteps | UniformSteps | PipelineSteps:
        layered, config = self.layered_model, self.config
        if self.pipeline is not None:
            return PipelineSteps(self.module, self.pipeline)
        if layered is None:
            return UniformSteps(self.module, self.sharded, self._training_step, self.weighting)
        offload = stash_offloaded(config.offload, device, emulator)
        tolerance = 1e-3 if (config.param_dtype or torch.float32).itemsize >= 4 else 3e-2
        layered = dataclasses.replace(layered, weighting=self.weighting)  # the fit's decision (loss_weighting=)
        logs = LossPassLogs(self.module) if layered.discovery is not None else None
        layers = logs.wrap(layered.layers) if logs is not None else layered.layers
        return LayeredSteps(self.module, LayeredSchedule(self.sharded, layers, offload=offload), layered,
                            verify_loss=config.verify_loss, tolerance=tolerance, logs=logs)

    def _fall_back(self, why: str) -> None:
        """The first step found that a discovered block sequence does not hold: the uniform mode
        from then on (:attr:`steps` its runner), when the plan allows it (one micro-batch count on
        every rank); see [Note: one owner of the step runner]."""
        name = self.layered_model.name
        counts = self.plan.num_micro_batches
        if len(set(counts)) > 1:
            raise ConfigurationError(
                f"Cephalo cannot run {name} layer by layer: {why}. The plan gives ranks different micro-batch counts "
                f"{list(counts)}, which only the layered mode can run: re-plan with mode='uniform' (one count on "
                "every rank), or give the LightningModule the layered protocol (cephalo_layers, cephalo_input, "
                "cephalo_loss)")
        rank_zero_info(f"Cephalo: the uniform mode for {name}: the discovered block sequence does not hold ({why})")
        self.schedule, self.layered_model = vocabulary.Schedule.UNIFORM, None
        self.steps = UniformSteps(self.module, self.sharded, self._training_step, self.weighting)

    @property
    def plan(self) -> Plan:
        """The plan the model is sharded under now."""
        return self.switches.plan

    @property
    def rank_plan(self) -> RankPlan:
        """This rank's part of :attr:`plan`."""
        return self.plan.ranks[self.rank]

    @property
    def memory_tracker(self) -> MemoryTracker | None:
        """The emulated capacity's tracker, where the CPU counts the bytes (None otherwise)."""
        return self.memory.tracker if self.memory is not None else None

    # ------------------------------------------------------------------ plans

    @property
    def plan_state(self) -> PlanState:
        """Which plan cuts which step's data (what the planned loader reads)."""
        return self.switches.plan_state

    def next_batch(self) -> CutBatch:
        """The step whose data is cut now (the planned loader's next global batch)."""
        return self.switches.next_batch()

    def schedule_switch(self, plan: Plan, accumulate: int) -> tuple[int, int]:
        """Collective: switch to ``plan`` at the first step whose data no rank has cut yet (see
        :class:`~.plan_switch.PlanSwitches`). Returns (data epoch, step)."""
        return self.switches.schedule_switch(plan, accumulate)

    def adopt(self, plan: Plan, accumulate: int, optimizers: Sequence[Optimizer]) -> None:
        """Collective: re-shard to ``plan`` at once."""
        self.switches.schedule_switch(plan, accumulate)
        self.switches.switch_now(optimizers)

    def switch_if_due(self, optimizers: Sequence[Optimizer]) -> bool:
        """Collective: re-shard to a scheduled plan whose step has come; whether it did."""
        return self.switches.switch_if_due(optimizers)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: Path, checkpoint_dict: dict[str, Any], optimizers: Sequence[Optimizer], *,
                        wait: bool) -> Path | None:
        """Collective: save (:meth:`~.checkpoint_io.FitCheckpoints.save`), waiting for a background
        write where ``wait``; returns the newest checkpoint known to be complete."""
        submitted = self.checkpoints.save(path, checkpoint_dict, optimizers)
        if wait:
            self.checkpoints.wait()
        return self.checkpoints.newest_complete(submitted)

    def wait_for_checkpoints(self) -> None:
        """Return when every save submitted is written and published (raises a failed one's error)."""
        self.checkpoints.wait()

    def remove_checkpoint(self, path: str | Path) -> None:
        """Rank 0: delete a checkpoint, after any save submitted before it has published."""
        self.checkpoints.remove(path)

    def load_checkpoint(self, path: Path, optimizers: Sequence[Optimizer], weights_only: bool | None) -> dict[str, Any]:
        """Collective: a sharded directory (any layout) or a single file (weights only)."""
        return self.checkpoints.load(path, optimizers, weights_only)

    def keep_stage_pieces(self, optimizers: Sequence[Optimizer]) -> None:
        """A pipelined plan: each optimizer keeps this rank's pieces of its stage only (the module's other
        parameters are another stage's, meta here, or the first layer's copy a later stage's input path uses)."""
        if self.pipeline is None:
            return
        mine = {id(p) for p in self.pipeline.parameters()}
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) in mine]

    def clip_gradients(self, max_norm: float) -> torch.Tensor | None:
        """A pipelined plan's global-norm clipping (every stage, a tied parameter once); None: not pipelined."""
        return self.pipeline.clip_grad_norm_(max_norm) if self.pipeline is not None else None

    # ------------------------------------------------------------------ the module between fits

    def take_back(self) -> None:
        """The same module again (e.g. ``trainer.test`` after ``trainer.fit``): its whole parameters into the shards."""
        self.sharded.take_back()
        self.checkpoints.forget_frozen_base()

    def hand_back(self, choice: vocabulary.Handback | vocabulary.Auto, ranks_per_node: int) -> None:
        """The user's module after fit/validate/test (see :mod:`~.runtime.sharding.handback`): the
        choice decided for the model's size, said (with the memory it takes) before any gather."""
        if self.sharded.driver in (Driver.HANDED_BACK, Driver.PARKED):
            return  # handed back already (a second teardown)
        if self.pipeline is not None:  # no rank holds the whole model: each keeps its stage's pieces
            rank_zero_info("Cephalo: under a pipelined plan no rank holds the whole model: after fit the module "
                           "keeps each rank's stage pieces (gather_on_teardown='none')")
            self.sharded.hand_back(vocabulary.Handback.NONE)
            return
        decision = handback.decide(choice, handback.whole_bytes(self.sharded.units), ranks_per_node)
        if choice == vocabulary.AUTO or decision.handback is not vocabulary.Handback.NONE:
            rank_zero_info(decision.line)
        self.sharded.hand_back(decision.handback)

    @contextlib.contextmanager
    def evaluation_step(self) -> Iterator[None]:
        """The ``with`` block around a validation, test or predict step: the root unit gathered for it
        (not under a pipelined plan: :meth:`pipelined_evaluation`, :meth:`pipelined_prediction`)."""
        assert self.pipeline is None, "a pipelined plan's evaluation steps run through the pipeline"
        self.sharded.gather_root()
        try:
            yield
        finally:
            self.sharded.free_all()

    def pipelined_evaluation(self, batch: Any, hook: str) -> torch.Tensor:
        """A validation or test step under a pipelined plan: the model's loss through the pipeline
        (:meth:`~.pipeline_steps.PipelineSteps.evaluate`); the user's step, which would run the whole
        model, is not called."""
        assert isinstance(self.steps, PipelineSteps)
        return self.steps.evaluate(batch, hook)

    def pipelined_prediction(self, batch: Any) -> torch.Tensor:
        """A predict step under a pipelined plan: the last layer's outputs of the pipeline's samples
        (:meth:`~.pipeline_steps.PipelineSteps.predict`); the user's ``predict_step``, which would run the
        whole model, is not called."""
        assert isinstance(self.steps, PipelineSteps)
        return self.steps.predict(batch)

    def describe(self) -> str:
        what = self.layered_model.name if self.layered_model is not None else type(self.module).__name__
        held = self.shard_summary
        built = f", {held.materialized_units} units materialised from meta" if held.materialized_units else ""
        return (f"Cephalo: {self.schedule} mode ({what}), {held.units} units, state shares "
                f"{[round(s, 4) for s in self.plan.state_shares]}, losses weighted by "
                f"{self.loss.words}{built}")

    def start_fit(self, trainer: pl.Trainer, token: str, cluster: Any, reported_elsewhere: bool) -> FailureReport:
        """Collective, before a fit trains: refuse hyperparameters a checkpoint could not load back,
        claim the run's folders (:func:`claim_folders`), clean up what an interrupted save or a killed
        run left, start the heartbeat, report the run to the loggers (unless ``reported_elsewhere``:
        a callback reports it with its profile)."""
        if self.pipeline is not None:
            refuse_pipelined_fit(trainer, reported_elsewhere)
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
            world = self.world_size if self.pipeline is not None else self.sharded.world_size  # a stage spans part of it
            heartbeat = Heartbeat(root / f"heartbeat-{token}", self.rank, world).start()
        except BaseException:
            for lock in locks:  # no FailureReport holds them yet
                lock.release()
            raise
        return FailureReport(heartbeat, locks)

    # ------------------------------------------------------------------ the training step

    def forward(self, batch: Any, args: tuple, trainer: pl.Trainer, *, sync: bool, scaler: Any = None,
                signal: StopSignalProbe = no_stop_signal, rank_plan: RankPlan | None = None,
                global_items: float | None = None, deferred_logs: list | None = None) -> Any:
        """Collective: the training step's forward on this rank's part of the global batch; returns
        what Lightning's ``training_step`` returns. ``args``: training_step's after the batch;
        ``sync``: the gradients are reduced at the end of this batch; ``scaler``: a gradient scaler
        (16-mixed); ``signal()``: the stop signal this rank received, read at the step's all-reduce;
        ``rank_plan``, ``global_items``: this rank's part where it is not the plan's (fault tolerance);
        ``deferred_logs``: where the step's logs go instead of Lightning's (logged once committed).
        The step's state is held until its backward (see the module note)."""
        # the scale as a device tensor (scaler.scale multiplies on the device: no host sync per step)
        scale = scaler.scale(torch.ones((), device=self.sharded.device)) if scaler is not None else 1.0
        plan = self.plan
        context = StepContext(rank_plan=rank_plan if rank_plan is not None else plan.ranks[self.rank],
                              global_batch=plan.global_batch_size, accumulate=trainer.accumulate_grad_batches,
                              sync=sync, loss_scale=scale, args=args,
                              pending_signal=signal, global_items=global_items, deferred_logs=deferred_logs)
        try:
            with self.step_scope(trainer.global_step):
                started = self.steps.start(batch, context)
                if isinstance(started, FallBack):  # [Note: one owner of the step runner]
                    self._fall_back(started.why)
                    started = self.steps.start(batch, context)
                self._step = started
                return self.steps.forward(started)
        finally:
            if not self.module.automatic_optimization:
                self._step = None

    def backward(self, closure_loss: torch.Tensor) -> StepReport:
        """Collective: the training step's backward (``closure_loss`` as Lightning prepared it) and
        its all-reduce; returns the report every rank agrees on, recorded by the non-finite guard."""
        step = self._step
        assert step is not None, "backward outside a training step"
        try:
            with self.step_scope(self.module.trainer.global_step):
                report = self.steps.backward(closure_loss, step)
            self.guard.record(report)
            return report
        finally:
            if self.module.automatic_optimization:
                self._step = None

    def before_optimizer_step(self, step: int, *, scaled: bool, summed: StepReport | None = None) -> bool:
        """Whether the optimizer step goes ahead: not where a rank's loss or gradient was not finite
        (``summed``: the report of a gradient summed over replica groups; ``scaled``: a gradient
        scaler decides on inf steps itself)."""
        if summed is not None:
            self.guard.record(summed)
        return scaled or not self.guard.should_skip(step)

    @contextlib.contextmanager
    def optimizer_step_scope(self) -> Iterator[None]:
        """The ``with`` block around the optimizer's update (its compute, for the observers)."""
        with self.sharded.observers.compute("optimizer_step"):
            yield

    @property
    def capturing_logs(self) -> bool:
        """Inside the user's ``training_step`` of a uniform step: its logs are the step's to combine."""
        return isinstance(self._step, UniformStep) and self._step.capturing

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
           construction: ConstructionRecord | None, frozen_dtype: torch.dtype | None = None) -> ShardedModel:
    """The module sharded by ``plan``'s shard groups and state shares (each group holds a replica),
    a meta-device model materialised unit by unit (its buffers from ``construction`` where nothing
    else gives them); ``links`` slows the collectives crossing emulated links. ``frozen_dtype``: the
    autocast dtype under ``*-mixed`` precision, which frozen parameters are stored and gathered in
    (``param_dtype``, where given, is the compute dtype of both parts)."""
    source = None
    if config.pretrained is not None:
        source = open_weights(config.pretrained, _prefix_of(module, resolution.model), lora.WRAPPED_SEGMENTS)
    try:
        sharded = ShardedModel(
            module, plan.state_shares, shard_groups=plan.shard_groups, links=links,
            units=layered.units if layered is not None else config.units,
            collective=collective, compute_dtype=config.param_dtype, prefetch=config.prefetch, device=device,
            overlap=config.overlap, base=config.base_storage, frozen_dtype=config.param_dtype or frozen_dtype,
            materializer=UnitMaterializer(device, init=resolution.init, source=source, seed=config.seed or 0,
                                          fresh=frozenset(lora.adapter_parameters(module)), construction=construction),
        )
        # collective, once: each rank read only the tensors its shards hold part of
        unused = source.unused(gather_objects(sorted(source.used))) if source is not None else []
    finally:
        if source is not None:
            source.close()
    if unused:
        counted = "1 tensor" if len(unused) == 1 else f"{len(unused)} tensors"
        rank_zero_info(f"Cephalo: {counted} of {config.pretrained} {'was' if len(unused) == 1 else 'were'} not used "
                       f"by any rank, e.g. {unused[:3]}")
    return sharded


def pipelined_option_conflicts(config: StrategyConfig) -> list[tuple[str, str]]:
    """The strategy's options a pipelined plan cannot run with: (the option as given, why)."""
    refused = [(config.fault_tolerance, "fault_tolerance=True", "replica groups recover a stage's pieces from no peer"),
               (config.elastic, "elastic=True", "an elastic restart re-plans for the ranks present, without stages"),
               (config.async_checkpoint, "async_checkpoint=True", "a pipelined plan's save is written in the step"),
               (config.state_dict_type != "sharded", f"state_dict_type={config.state_dict_type!r}",
                "its checkpoints are sharded directories"),
               (not config.checkpoint_frozen, "checkpoint_frozen=False", "its checkpoints hold every parameter"),
               (config.gather_on_teardown not in (vocabulary.AUTO, vocabulary.Handback.NONE),
                f"gather_on_teardown='{config.gather_on_teardown}'", "no rank holds the whole model: each keeps its "
                "stage's pieces after fit; consolidate a checkpoint for the whole model")]
    return [(option, why) for on, option, why in refused if on]


def refuse_pipelined_options(config: StrategyConfig) -> None:
    """What a pipelined plan cannot run with, refused at setup with the fix."""
    conflicts = pipelined_option_conflicts(config)
    if conflicts:
        option, why = conflicts[0]
        raise UnsupportedError(f"CephaloStrategy({option}) cannot run a pipelined plan ({why}): drop {option}, or "
                               "re-plan without pipelines (`python -m cephalo_lightning plan --no-pipelines`)")


def refuse_pipelined_fit(trainer: pl.Trainer, callback: bool) -> None:
    """What a pipelined fit cannot do yet, refused before it trains: gradient accumulation, the
    callback's re-planning."""
    if trainer.accumulate_grad_batches != 1:
        raise UnsupportedError(f"a pipelined plan runs each step whole (accumulate_grad_batches="
                               f"{trainer.accumulate_grad_batches}): give the plan the larger global batch instead")
    if callback:
        raise UnsupportedError("CephaloCallback re-plans by switching plans, which a pipelined plan cannot: drop the "
                               "callback and give the pipelined plan to CephaloStrategy(plan=...)")


def pipeline_obstacle(config: StrategyConfig, layered: Any, trainer: pl.Trainer, callback: bool, *,
                      manual: bool = False) -> str | None:
    """Why this fit could not run a pipelined plan (None: it could), in the words of the refusals
    above, of :func:`_pipeline`'s and of :func:`~.schedules.check_plan`'s (``manual``: the module's
    manual optimization): what the strategy's planning from a cluster file says when it plans without
    pipelines, so that it never picks a plan the runtime would refuse at setup."""
    if manual:
        return "manual optimization (automatic_optimization=False) runs your training_step itself"
    if layered is None:
        return "the fit runs in the uniform mode (a pipelined plan runs the model's layers, a stage's on each rank)"
    if layered.discovery is not None:
        return (f"{layered.name}'s layers were discovered from its structure, which the first step checks on the whole "
                "model (give the LightningModule the layered protocol)")
    if config.pretrained is not None:
        return "pretrained= is read into the shards of a plan without pipelines only"
    conflicts = pipelined_option_conflicts(config)
    if conflicts:
        return "; ".join(f"{option} ({why})" for option, why in conflicts)
    if trainer.accumulate_grad_batches != 1:
        return f"accumulate_grad_batches={trainer.accumulate_grad_batches} (a pipelined plan runs each step whole)"
    if callback:
        return "CephaloCallback re-plans by switching plans, which a pipelined plan cannot"
    return None


def _pipeline(module: pl.LightningModule, plan: Plan, config: StrategyConfig, layered: Any, loss: Any,
              device: torch.device, links: Links | None) -> PipelineRunner:
    """[Note: a pipelined plan's runtime] This rank's stage of ``plan`` over the layered form's layers."""
    if layered is None:
        raise UnsupportedError("a pipelined plan runs in the layered mode (the strategy runs the model's layers, a "
                               "stage's on each rank): give the model a layered form (the layered protocol, a "
                               "Hugging Face model, a discovered block sequence) or re-plan without pipelines")
    if layered.discovery is not None:
        raise UnsupportedError(
            f"{layered.name}'s layers were discovered from its structure, which the first step checks against your "
            "training_step on the whole model; no rank holds the whole model under a pipelined plan: give the "
            "LightningModule the layered protocol (cephalo_layers, cephalo_input, cephalo_loss), or re-plan without "
            "pipelines")
    if config.pretrained is not None:
        raise UnsupportedError("pretrained= under a pipelined plan is not supported yet: load the weights into the "
                               "module before fit, or re-plan without pipelines")
    layered = dataclasses.replace(layered, weighting=loss)
    layout = PipelineLayout.of(plan, len(layered.layers))
    return PipelineRunner(module, layered.layers, layout, prepare=layered.prepare, loss=weighted_loss(layered),
                          items=item_count(layered), compute_dtype=config.param_dtype, links=links, device=device)


def _unpriced_room(held: ShardSummary, plan: Plan, rank: int) -> tuple[int, int, float | None]:
    """(rank, bytes its padded collectives hold unpriced, bytes the plan leaves below its memory limit).
    The two kinds add up: on CUDA a unit's reduce-scatter runs beside the next layer's backward, whose
    neighbour's gather is in flight."""
    r = plan.ranks[rank]
    room = None if r.memory_limit_gb is None or r.predicted_memory_gb is None else (
        (r.memory_limit_gb - r.predicted_memory_gb) * GIB)
    return rank, held.in_flight_gather_bytes + held.padded_reduction_bytes, room


def unpriced_buffers(rows: Sequence[tuple[int, int, float | None]]) -> str | None:
    """A warning naming the ranks whose padded collective buffers, which the cost model does not
    price, exceed what their plan leaves below its memory limit (None: no rank)."""
    short = [(rank, held, room) for rank, held, room in rows if held and room is not None and held > room]
    if not short:
        return None
    ranks = "; ".join(f"rank {rank}: {held / 2**20:.1f} MiB against {max(room, 0.0) / 2**20:.1f} MiB"
                      for rank, held, room in short)
    return ("Cephalo: with collective='padded', a unit whose shards are uneven is gathered and reduced through "
            "buffers of one padded shard per rank (a prefetched all-gather's staging beside the layer computing, "
            "the reduce-scatter's padded input and sum), which the plan does not price and which exceed the room "
            f"the plan leaves below the memory limit ({ranks}); the step may run out of memory. "
            "CephaloStrategy(collective='exact') holds no such buffers.")


def stash_offloaded(offload: bool | None, device: torch.device, emulator: DeviceEmulator) -> bool:
    """Whether the layered stash lives on the host: as asked, else on CUDA and on an emulated GPU (whose
    stash stays on the host as the real one's would, accounted as host memory)."""
    return offload if offload is not None else (device.type == "cuda" or emulator.memory_gb is not None)


def _memory_tracking(held: ShardSummary, observers: Observers, emulator: DeviceEmulator, device: torch.device,
                     every_n_steps: int) -> SampledTracking | None:
    """An emulated capacity: CUDA's allocator capped, or on CPU the tracked bytes checked."""
    if emulator.memory_gb is None:
        return None
    if device.type == "cuda":  # pragma: no cover - CUDA only
        emulator.cap_cuda_memory(device)
        return None
    # the local state (fp32 master) is resident before tracking starts
    tracker = emulator.memory_tracker(baseline_bytes=held.local_state_numel * 4)
    return SampledTracking(tracker, observers, every_n_steps)


def _prefix_of(module: torch.nn.Module, model: torch.nn.Module | None) -> str:
    """The attribute path of the library model inside the LightningModule, as a name prefix."""
    if model is None:
        return ""
    for name, sub in module.named_modules():
        if sub is model:
            return f"{name}." if name else ""
    return ""
