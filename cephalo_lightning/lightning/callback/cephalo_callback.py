"""``CephaloCallback``: profile every device at setup, plan, hand the plan over, then watch.

At ``setup`` it tells the :class:`~cephalo_lightning.lightning.strategy.cephalo_strategy.CephaloStrategy` that a plan is
coming, so the strategy shards provisionally, in proportion to each rank's memory (so a small
device is not handed an even share it cannot hold). At ``on_fit_start`` every rank profiles its
device on the sharded model, one unit at a time (:mod:`cephalo_lightning.profiling`), the planner
turns the gathered cluster into a plan, and the strategy re-shards to it (no files, no full
gather) before the first batch is cut. During training it compares each rank's measured compute
time and peak memory with the plan's prediction, logs both, warns about a rank that drifts (a
straggler, a throttled GPU) and, with ``replan=True``, re-profiles, re-plans and re-shards without
losing state.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from cephalo_lightning._common.errors import UnsupportedError
from cephalo_lightning._common.units import GIB
from cephalo_lightning._common.vocabulary import Planner
from cephalo_lightning.lightning.callback.adaptation import RunAdapter
from cephalo_lightning.lightning.callback.callback_config import CallbackConfig
from cephalo_lightning.lightning.callback.profiled_input import planning_sample, profiled_form
from cephalo_lightning.lightning.callback.run_model import CalibrationResult, drifting_ranks
from cephalo_lightning.lightning.fit.callback_api import CallbackAPI
from cephalo_lightning.lightning.fit.loggers import (
    log_plan,
    log_rank_series,
    log_run,
    log_summary,
    save_run_files,
    terminal_width,
)
from cephalo_lightning.planner import Cluster, Plan
from cephalo_lightning.planner import plan as make_plan
from cephalo_lightning.planner.cost.cluster_cost import predicted_busy_s
from cephalo_lightning.planner.report import render_plan
from cephalo_lightning.profiling import ModelDescription, ProfileOptions, default_settings, profile_cluster
from cephalo_lightning.runtime.distributed import gather_objects
from cephalo_lightning.runtime.observers import Observer
from cephalo_lightning.runtime.sharding.flat_unit import full_shape, master_dtype_for
from cephalo_lightning.runtime.timing import BusyTime, ContentionClock


class CollectiveTime(Observer):
    """Seconds this rank is blocked in collectives (the contention-free clock, as :class:`BusyTime`):
    synchronous calls whole, asynchronous ones at their issue and their wait, so what compute
    hid of them does not count.

    A collective also waits for the ranks that reach it later, so the rank that waits least (the
    smallest figure of a step over the ranks) measures the collectives as run; the calibration
    fits the cost model's blocked collective time to it.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0
        self._start: ContentionClock | None = None

    def collective_begin(self, op: str, unit: str, numel: int) -> None:
        if self._depth == 0:
            self._start = ContentionClock.now()
        self._depth += 1

    def collective_end(self, op: str, unit: str, numel: int) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            self.seconds += ContentionClock.now().since(self._start)
            self._start = None


# what "<x>-true" precision turns the parameters into (Lightning converts the module after setup)
_TRUE_PRECISION_DTYPES = {"64-true": torch.float64, "bf16-true": torch.bfloat16, "16-true": torch.float16}


class CephaloCallback(Callback):
    """Profile, plan and watch for :class:`CephaloStrategy`.

    The arguments are :class:`~.callback_config.CallbackConfig`'s, each with its default and
    meaning there (and in the API reference's table); they are checked here, at construction.
    """

    def __init__(
        self,
        global_batch_size: int | None = CallbackConfig.global_batch_size,
        mode: str | None = CallbackConfig.mode,
        max_micro_batch: int = CallbackConfig.max_micro_batch,
        settings: Mapping[str, Any] | None = CallbackConfig.settings,
        cache_dir: str | Path | None = CallbackConfig.cache_dir,
        force_profile: bool = CallbackConfig.force_profile,
        cluster_file: str | Path | None = CallbackConfig.cluster_file,
        plan_file: str | Path | None = CallbackConfig.plan_file,
        watch_every_n_steps: int = CallbackConfig.watch_every_n_steps,
        drift_threshold: float = CallbackConfig.drift_threshold,
        replan: bool = CallbackConfig.replan,
        calibrate_after_windows: int = CallbackConfig.calibrate_after_windows,
        switch_gain: float = CallbackConfig.switch_gain,
        adapt: bool = CallbackConfig.adapt,
        min_dwell_windows: int = CallbackConfig.min_dwell_windows,
        state_bytes_per_param: float | None = CallbackConfig.state_bytes_per_param,
        print_plan: bool = CallbackConfig.print_plan,
        quiet: bool = CallbackConfig.quiet,
    ) -> None:
        # the signature above is for LightningCLI / YAML (one argument each); the options are the config's
        self.config = CallbackConfig(
            global_batch_size=global_batch_size, mode=mode, max_micro_batch=max_micro_batch, settings=settings,
            cache_dir=cache_dir, force_profile=force_profile, cluster_file=cluster_file, plan_file=plan_file,
            watch_every_n_steps=watch_every_n_steps, drift_threshold=drift_threshold, replan=replan,
            calibrate_after_windows=calibrate_after_windows, switch_gain=switch_gain, adapt=adapt,
            min_dwell_windows=min_dwell_windows, state_bytes_per_param=state_bytes_per_param, print_plan=print_plan,
            quiet=quiet)
        self.cluster: Cluster | None = None
        self.plan: Plan | None = None  # the plan the run is on: set at setup, followed through in-place switches
        self.history: list[dict[str, Any]] = []  # one row per watch window, on every rank
        self._step_start = 0.0
        self._busy_start = (0.0, 0.0, 0.0)  # busy, its wall-clock twin and the collectives' time at the step's start
        self._window: list[tuple[float, float, float, float]] = []  # (wall, busy, busy on the wall clock, collectives) s per step
        self._all_walls: list[float] = []
        self._throughput: Throughput | None = None
        self._t0 = 0.0  # when training started (the throughput's clock)
        self._samples = 0
        self._busy: BusyTime | None = None
        self._collectives: CollectiveTime | None = None
        self._planning = False
        self._adapter = RunAdapter(self.config)  # calibration, drift episodes, stragglers

    # ------------------------------------------------------------------ setup: profile and plan

    @staticmethod
    def _strategy(trainer: pl.Trainer) -> CallbackAPI:
        if not isinstance(trainer.strategy, CallbackAPI):  # only CephaloStrategy mixes it in
            raise UnsupportedError(f"CephaloCallback needs Trainer(strategy='cephalo'), got {type(trainer.strategy).__name__}")
        return trainer.strategy

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = self._strategy(trainer)
        self._planning = strategy.plan is None or self.config.force_profile
        if self._planning:
            strategy.expect_plan()  # the plan follows at on_fit_start
        else:
            rank_zero_info("Cephalo: the strategy's plan is pinned; not profiling.")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = self._strategy(trainer)
        if self._planning:
            self.cluster, self.plan = self._profile_and_plan(trainer, pl_module, strategy, force=self.config.force_profile)
            strategy.adopt_profiled_plan(self.plan, self.cluster)
        else:
            self.plan = strategy.plan
        if trainer.is_global_zero:
            if self.config.print_plan:
                print(render_plan(self.plan, width=terminal_width()), flush=True)
            if self.config.plan_file:
                self.plan.save(self.config.plan_file)
            log_plan(trainer.loggers, self.plan, self.cluster)
            log_run(trainer, self.plan, self.cluster or strategy.cluster, callback=self)

    def _profile_and_plan(self, trainer: pl.Trainer, module: pl.LightningModule, strategy: CallbackAPI,
                          force: bool) -> tuple[Cluster, Plan]:
        """Collective: profile every rank on the sharded model, one unit at a time, and plan."""
        sample, global_batch = planning_sample(trainer, strategy, self.config)
        layers, sample_input, hooks = profiled_form(module, strategy, sample)
        settings = replace(default_settings(strategy.root_device), **self.config.settings)
        if "stash_on_device" not in self.config.settings and not settings.offload_stash:
            settings = replace(settings, stash_on_device=not strategy.offloads_stash)
        every = list(module.parameters())
        trainable = [p for p in every if p.requires_grad]
        parameters = sum(math.prod(full_shape(p)) for p in every)  # the pieces are shards: count the whole
        trainable_parameters = sum(math.prod(full_shape(p)) for p in trainable)
        precision = trainer.precision_plugin
        compute_dtype = strategy.param_dtype or _TRUE_PRECISION_DTYPES.get(getattr(precision, "precision", ""))
        master = master_dtype_for(compute_dtype or (trainable[0].dtype if trainable else torch.float32))
        state_bytes = self.config.state_bytes_per_param or 4 * master.itemsize
        # a frozen parameter costs what its storage holds (its compute dtype: bf16 2 bytes, fp32 4)
        weight_bytes = strategy.frozen_bytes_per_param() or float(master.itemsize)
        with precision.forward_context():  # autocast for "*-mixed"
            cluster = profile_cluster(
                layers, sample_input,
                ModelDescription(name=type(module).__name__, parameters=parameters,
                                 trainable_parameters=trainable_parameters, state_bytes_per_param=state_bytes,
                                 weight_bytes_per_param=weight_bytes),
                hooks, emulator=strategy.emulator,  # its current state: a throttle shows
                options=ProfileOptions(max_micro_batch=self.config.max_micro_batch, compute_dtype=compute_dtype,
                                       collective_modes=(strategy.collective,)),
                settings=settings, device=strategy.root_device, cache_dir=self.config.cache_dir, force=force,
                quiet=self.config.quiet,
            )
        if self.config.cluster_file and trainer.is_global_zero:
            from cephalo_lightning.planner import save_cluster

            save_cluster(cluster, self.config.cluster_file)
        mode = self.config.mode or strategy.fit_mode
        # every rank must shard by the same plan: rank 0's, in case float noise ever made two differ
        plan = strategy.broadcast(make_plan(cluster, global_batch, mode=mode) if trainer.is_global_zero else None)
        return cluster, plan

    # ------------------------------------------------------------------ watching

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._throughput = Throughput(window_size=max(self.config.watch_every_n_steps, 5), world_size=1)
        self._t0 = time.perf_counter()
        strategy = self._strategy(trainer)
        if self.config.watch_every_n_steps:  # the watch measures compute, emulated waits included
            self._busy = BusyTime(cuda=strategy.root_device.type == "cuda")
            strategy.attach_observer(self._busy, outermost=True)
            if strategy.root_device.type != "cuda":  # CUDA collectives run on side streams: no host span says their cost
                self._collectives = CollectiveTime()
                strategy.attach_observer(self._collectives, outermost=True)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = self._strategy(trainer)
        for observer in (self._busy, self._collectives):
            if observer is not None:
                strategy.detach_observer(observer)
        self._summarize(trainer, strategy)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.plan = self._strategy(trainer).plan  # a switch scheduled by a window takes effect at a step's start
        self._step_start = time.perf_counter()
        self._busy_start = ((self._busy.seconds, self._busy.wall_seconds) if self._busy is not None else (0.0, 0.0)) + (
            self._collectives.seconds if self._collectives is not None else 0.0,)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        strategy = self._strategy(trainer)
        wall = time.perf_counter() - self._step_start
        busy, busy_wall = ((self._busy.seconds - self._busy_start[0], self._busy.wall_seconds - self._busy_start[1])
                           if self._busy is not None else (0.0, 0.0))
        collectives = self._collectives.seconds - self._busy_start[2] if self._collectives is not None else None
        self._window.append((wall, busy, busy_wall, collectives))
        self._all_walls.append(wall)
        assert strategy.plan is not None
        self._samples += strategy.plan.global_batch_size
        if self._throughput is not None:
            # this run's steps (a resumed run's global_step also counts the steps before the resume)
            self._throughput.update(time=time.perf_counter() - self._t0, batches=len(self._all_walls), samples=self._samples)
        if self.config.watch_every_n_steps and len(self._window) >= self.config.watch_every_n_steps:
            self._watch(trainer, strategy)
            self._window = []

    def _predicted_busy(self, strategy: CallbackAPI) -> list[float | None]:
        """Each rank's predicted compute seconds per step (the cost model without collectives)."""
        if self.cluster is None or strategy.plan is None:
            return [None] * strategy.world_size
        return list(predicted_busy_s(self.cluster, strategy.plan))

    def _peak_memory_gb(self, strategy: CallbackAPI) -> float | None:
        if strategy.memory is not None:
            return strategy.memory.peak_bytes / GIB
        if strategy.root_device.type == "cuda":  # pragma: no cover - CUDA only
            return torch.cuda.max_memory_allocated(strategy.root_device) / GIB
        return None

    def _watch(self, trainer: pl.Trainer, strategy: CallbackAPI) -> None:
        """Collective: every rank shares its window, every rank takes the same decision."""
        walls = sorted(w for w, *_ in self._window)
        busy, busy_wall = (statistics.median(x[k] for x in self._window) for k in (1, 2))
        collectives = None if self._collectives is None else statistics.median(x[3] for x in self._window)
        rows = gather_objects({"busy_s": busy, "busy_wall_s": busy_wall, "collective_s": collectives,
                               "peak_memory_gb": self._peak_memory_gb(strategy)})
        predicted = self._predicted_busy(strategy)
        assert strategy.plan is not None
        ratios = [r["busy_s"] / p if p else None for r, p in zip(rows, predicted)]
        drifting, reference = drifting_ranks(ratios, self.config.drift_threshold, self.calibration is not None)
        step_s = statistics.median(walls)
        record = {
            "step": trainer.global_step,
            "step_s": step_s,
            "step_spread": statistics.median(abs(w - step_s) for w in walls) / step_s if step_s > 0 else 0.0,
            "samples_per_s": strategy.plan.global_batch_size / statistics.median(walls),
            "predicted_samples_per_s": strategy.plan.predicted_samples_per_s,
            "ranks": [
                {"rank": i, "measured_busy_s": r["busy_s"], "measured_busy_wall_s": r["busy_wall_s"],
                 "measured_collective_s": r["collective_s"],
                 "predicted_busy_s": predicted[i],
                 "peak_memory_gb": r["peak_memory_gb"], "predicted_memory_gb": strategy.plan.ranks[i].predicted_memory_gb}
                for i, r in enumerate(rows)
            ],
            "drifting": drifting,
        }
        self.history.append(record)
        if trainer.is_global_zero:
            throughput = self._throughput.compute() if self._throughput is not None else {}
            log_rank_series(trainer.loggers, record, throughput, trainer.global_step)
        self.cluster = self._adapter.after_window(trainer, strategy, self.cluster, self.history, ratios, reference,
                                                  replan=lambda: self._replan(trainer, strategy) or self.cluster)

    @property
    def calibration(self) -> CalibrationResult | None:
        """The run's calibration, once made (``calibrate_after_windows``)."""
        return self._adapter.calibration

    def _replan(self, trainer: pl.Trainer, strategy: CallbackAPI) -> None:
        module = trainer.lightning_module
        cluster, plan = self._profile_and_plan(trainer, module, strategy, force=True)
        if plan.batch_sizes == strategy.plan.batch_sizes and plan.state_shares == strategy.plan.state_shares:  # type: ignore[union-attr]
            rank_zero_info("Cephalo: re-planned, the plan is unchanged.")
            return
        epoch, step = strategy.schedule_plan(plan)
        self.cluster, self.plan = cluster, plan
        if trainer.is_global_zero:
            table = render_plan(plan, width=terminal_width())
            rank_zero_info(f"Cephalo: new plan from epoch {epoch} step {step}:\n{table}")
            log_plan(trainer.loggers, plan, cluster, prefix="replan")
            save_run_files(trainer.loggers, plan, cluster, suffix=f"-replan-step{trainer.global_step}")

    # ------------------------------------------------------------------ summary

    def _summarize(self, trainer: pl.Trainer, strategy: CallbackAPI) -> None:
        if not self._all_walls or strategy.plan is None:
            return
        steady = self._all_walls[1:] or self._all_walls  # the first step pays for warm-up
        step_s = statistics.median(steady)
        summary = {
            "global_batch_size": strategy.plan.global_batch_size,
            "measured_samples_per_s": strategy.plan.global_batch_size / step_s,
            "measured_step_s": step_s,
            "predicted_samples_per_s": strategy.plan.predicted_samples_per_s,
            "predicted_step_s": strategy.plan.predicted_step_s,
            "even_predicted_samples_per_s": strategy.plan.baselines[Planner.EVEN].predicted_samples_per_s
            if Planner.EVEN in strategy.plan.baselines else None,
            "calibrated_predicted_step_s": self.calibration.predicted_after_s if self.calibration is not None else None,
            "steps": len(self._all_walls),
            "emulated": bool(strategy.emulator.is_emulated or strategy.plan.emulated),
        }
        self.summary = summary
        if trainer.is_global_zero:
            log_summary(trainer.loggers, summary)
            if not self.config.quiet:
                print(format_summary(summary), flush=True)


def format_summary(summary: Mapping[str, Any]) -> str:
    """The end-of-training lines: measured against predicted, and the plan against the even one."""
    where = "emulated heterogeneous cluster on CPU" if summary.get("emulated") else "this cluster"
    lines = [f"Cephalo summary ({where}, {summary['steps']} steps):",
             f"  measured   {summary['measured_samples_per_s']:.2f} samples/s (median step {summary['measured_step_s']:.3f} s)"]
    predicted = summary.get("predicted_samples_per_s")
    if predicted:
        lines.append(f"  predicted  {predicted:.2f} samples/s (measured / predicted = "
                     f"{summary['measured_samples_per_s'] / predicted:.2f})")
    calibrated = summary.get("calibrated_predicted_step_s")
    if calibrated:
        lines.append(f"  calibrated {summary['global_batch_size'] / calibrated:.2f} samples/s predicted after calibration "
                     f"(measured / predicted = {calibrated / summary['measured_step_s']:.2f})")
    even = summary.get("even_predicted_samples_per_s")
    if even and predicted:
        lines.append(f"  even plan  {even:.2f} samples/s predicted (this plan is predicted {predicted / even:.2f}x faster)")
    elif predicted:
        lines.append("  even plan  does not fit in memory (see the plan table)")
    return "\n".join(lines)
