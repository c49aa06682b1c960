"""One training step of a rank under the plan: the layered schedule or micro-batch-major (uniform).

Both cut the rank's local batch (b_i samples) into its n_i micro-batches and weight micro-batch
k's mean loss by its items over the items of the whole global batch (:mod:`.models.protocol`:
samples for per-sample means, counted with no communication; tokens for per-token means, counted
with one small all-reduce before the forward), so that the gradients summed by the reduce-scatter
equal the gradient of the mean loss over the global batch, whatever the plan.

[Note: one all-reduce per step] Every rank contributes, in ONE all-reduce, its weighted loss, the
weighted values the user logged, and a flag per rank that says whether its loss or its gradient
shard was not finite, and the stop signal (if any) each rank received. So every rank knows the step's
global loss (logged once, exact), whether any rank went non-finite (:class:`NonFiniteGuard`) and
whether any rank was told to stop (:mod:`.preemption`). It is made after the backward; under groups
of one rank it is started before it, the gradient flags coming from each rank's own check of the
replicated gradient (:class:`StepSync`), so data parallelism issues no collective the backward does
not hide.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from cephalo_lightning._common.errors import CephaloError, ConfigurationError
from cephalo_lightning.lightning._private import LoggedValue, captured_logs, logged_values, logging_as
from cephalo_lightning.lightning.discovered import LossPassLogs, discovered_check, user_code
from cephalo_lightning.lightning.step_output import check_training_step_output, user_loss
from cephalo_lightning.models.protocol import LayeredModel, LossWeighting, check_first_inputs
from cephalo_lightning.planner import RankPlan
from cephalo_lightning.runtime.batching import leading_size, micro_batches
from cephalo_lightning.runtime.distributed import Group, all_reduce_, gather_objects, rank_and_size, start_all_reduce_
from cephalo_lightning.runtime.layered import LayeredSchedule
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel


class NonFiniteLossError(CephaloError, RuntimeError):
    """Training stopped: too many consecutive steps had a non-finite loss or gradient."""


@dataclass
class TrainingStep:
    """Everything one training step (one batch) needs, made where it starts and passed along.

    The strategy makes it in ``training_step`` and hands it to the runner's ``forward`` and
    ``backward``; the forward leaves in it what the backward needs (the micro-batches, their
    weights, the losses and logged values so far). Nothing of a step outlives it in a runner.
    """

    rank_plan: RankPlan
    global_batch: int
    accumulate: int  # Trainer(accumulate_grad_batches=...)
    sync: bool  # reduce gradients at the end of this batch (False while Lightning accumulates)
    loss_scale: float | torch.Tensor = 1.0  # a gradient scaler's scale (16-mixed), kept on the device
    args: tuple = ()  # training_step's arguments after the batch (batch_idx, ...)
    micro_batches: list[Any] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # each micro-batch's share of the global mean loss
    losses: list[torch.Tensor] = field(default_factory=list)  # uniform: each micro-batch's loss, detached
    logged: list[tuple[float, list[LoggedValue]]] = field(default_factory=list)  # uniform: (weight, its logs)
    local_loss: torch.Tensor | None = None  # layered: this rank's weighted loss, for the backward
    capturing: bool = False  # inside the user's training_step: the strategy's reduce() leaves logs alone
    pending_signal: Callable[[], int] = int  # the signal this rank received (0: none), read at the all-reduce
    global_items: float | None = None  # the global batch's items where this rank holds all of it (fault tolerance)

    @property
    def batch_idx(self) -> int:
        return self.args[0] if self.args else 0


@dataclass(frozen=True)
class StepReport:
    """What every rank agrees on after a step's all-reduce."""

    loss: float  # the global batch's mean loss (weighted as the gradient is)
    nonfinite: tuple[int, ...]  # ranks whose loss (or, if none, gradient shard) was not finite
    what: str = "loss"  # which of the two
    signals: tuple[tuple[int, int], ...] = ()  # (rank, signal number) of the ranks a stop signal reached


def micro_batch_weights(parts: Sequence[Any], weighting: LossWeighting, global_batch: int,
                        device: torch.device, group: Group = None,
                        global_items: float | None = None) -> tuple[list[float], float]:
    """Each micro-batch's share of the global mean loss, and the global batch's items (see the
    module docstring; ``global_items``: already known, counted without the all-reduce)."""
    samples = [leading_size(p) or 0 for p in parts]
    if weighting.kind == "samples":
        return [s / global_batch for s in samples], float(global_batch)
    counts = torch.tensor([float(weighting.items(p, s)) for p, s in zip(parts, samples)] + [0.0], dtype=torch.float64)
    total = float(all_reduce_(counts.sum().to(device), group=group)) if global_items is None else global_items
    return [float(c) / total if total > 0 else 0.0 for c in counts[:-1].tolist()], total


class StepSync:
    """The step's one all-reduce ([Note: one all-reduce per step]): made by :func:`start_step`, read by :meth:`finish`.

    Two flags per rank: its loss, and its gradient shard. A non-finite loss on one rank makes every
    rank's shard non-finite through the reduce-scatter, so the report names the ranks whose loss
    went non-finite (the origin), or, if none did, those whose gradients did.

    Under groups of one rank (:attr:`ShardedModel.replicated_grads`) every rank ends the backward
    holding the same reduced gradient, bit for bit, so its own check of the whole gradient is every
    rank's answer (all ranks' gradients are non-finite or none are) and the vector need not wait for
    it: :func:`start_step` sends the rest at once, before the backward, whose compute hides the
    all-reduce (as DDP hides its buckets'), and :meth:`finish` checks the gradient while it lands.
    Otherwise each rank's flag is known only after the backward, and the all-reduce is made then.
    """

    def __init__(self, local_loss: torch.Tensor, sharded: ShardedModel, extra: Sequence[torch.Tensor],
                 signal: Callable[[], int]) -> None:
        self.sharded = sharded
        self.group = sharded.world_group
        self.rank, self.world = rank_and_size(self.group)
        self.local_loss = local_loss
        self.extra = tuple(extra)
        self.signal = signal
        self.replicated = sharded.replicated_grads
        self.vector: torch.Tensor | None = None
        self.sizes: list[int] = []
        self.work: Any = None
        if self.replicated:
            self._send(gradient_flag=None)

    def _send(self, gradient_flag: float | None) -> None:
        """Build this rank's vector and start its all-reduce (the signal is read now)."""
        world, rank, device = self.world, self.rank, self.sharded.device
        loss = self.local_loss.detach().double().reshape(1).to(device)
        flags = torch.zeros(3 * world, dtype=torch.float64, device=device)
        flags[2 * world + rank] = float(self.signal())
        flags[rank] = (~torch.isfinite(loss).all()).to(flags.dtype)  # on the device: no host sync before a backward
        if gradient_flag is not None:
            flags[world + rank] = gradient_flag
        values = [loss.nan_to_num(0.0, 0.0, 0.0)] + [e.detach().double().reshape(-1).to(device) for e in self.extra]
        values.append(flags)
        self.sizes = [v.numel() for v in values]
        self.vector = torch.cat(values)
        self.work = start_all_reduce_(self.vector, group=self.group)

    def finish(self, check_grads: bool) -> tuple[StepReport, list[torch.Tensor]]:
        """After the backward: the report every rank agrees on, and the ``extra`` sums."""
        replicated_bad = False
        if self.vector is None:
            self._send(gradient_flag=(0.0 if self.sharded.grads_finite() else 1.0) if check_grads else None)
        elif check_grads:  # replicated gradients: this rank's check holds for every rank
            replicated_bad = not self.sharded.grads_finite()
        if self.work is not None:
            self.work.wait()
            self.work = None
        assert self.vector is not None
        world = self.world
        parts = list(self.vector.split(self.sizes))
        flags_back = parts[-1].tolist()
        losses = tuple(i for i in range(world) if flags_back[i] > 0)
        grads = tuple(range(world)) if replicated_bad else tuple(i for i in range(world) if flags_back[world + i] > 0)
        signals = tuple((i, int(flags_back[2 * world + i])) for i in range(world) if flags_back[2 * world + i] > 0)
        return StepReport(float(parts[0]), losses or grads, "loss" if losses else "gradient", signals), parts[1:-1]


def start_step(local_loss: torch.Tensor, sharded: ShardedModel, extra: Sequence[torch.Tensor] = (),
               signal: Callable[[], int] = int) -> StepSync:
    """The step's all-reduce of the global loss, the ``extra`` weighted sums, the non-finite flags
    and each rank's stop signal (``signal()``: see :mod:`.preemption`); call it once the loss and the
    logged values are known (before the backward where they are), then :meth:`StepSync.finish`."""
    return StepSync(local_loss, sharded, extra, signal)


def finish_step(local_loss: torch.Tensor, sharded: ShardedModel, check_grads: bool,
                extra: Sequence[torch.Tensor] = (), signal: int = 0) -> tuple[StepReport, list[torch.Tensor]]:
    """:func:`start_step` and :meth:`StepSync.finish` at once, after the backward."""
    return start_step(local_loss, sharded, extra, lambda: signal).finish(check_grads)


@dataclass(frozen=True)
class AlreadyGlobal:
    """The ``sync_dist_group`` of values every rank already holds in their global form (the step's
    all-reduce made them): Lightning treats them as synchronised (no "use sync_dist=True" warning at
    the epoch's end) and the strategy's ``reduce`` passes them through unchanged (no collective).
    Every rank logs the same value with the same batch size, so the epoch's mean is the global one."""


ALREADY_GLOBAL = AlreadyGlobal()


def log_scalar(module: pl.LightningModule, name: str, value: float, batch_size: int, **options: Any) -> None:
    """Log an already-global value from inside the strategy (synchronised already, see :class:`AlreadyGlobal`);
    to the loggers unless ``logger`` says otherwise, when there are any (else Lightning warns of none)."""
    options.setdefault("logger", module.trainer.logger is not None)
    with logging_as(module, "training_step"):
        module.log(name, torch.tensor(value, dtype=torch.float32), sync_dist=True, sync_dist_group=ALREADY_GLOBAL,
                   batch_size=batch_size, **options)


class LayeredSteps:
    """Layer-major: the strategy runs the model's layers itself (:class:`~.models.protocol.LayeredModel`).

    The user's ``training_step`` is not called; the step's global mean loss is logged as
    ``train_loss``. A rank whose plan says ``recompute=False`` (one micro-batch, memory to spare)
    keeps the forward's graph instead of recomputing each layer in the backward pass.
    ``verify_loss``: on the first step, a model found by an adapter checks that the user's
    ``training_step`` computes the same loss as the model's own on a micro-batch, and refuses to
    train a different objective silently.
    """

    def __init__(self, module: pl.LightningModule, schedule: LayeredSchedule, model: LayeredModel,
                 verify_loss: bool = True, tolerance: float = 1e-3,
                 fallback: Callable[[str], UniformSteps] | None = None, logs: LossPassLogs | None = None) -> None:
        self.module = module
        self.schedule = schedule
        self.model = model
        self.weighting = model.weighting  # the fit's decision (loss_weighting=, see .fit)
        self.verify_loss = verify_loss and model.derived  # cleared once checked (the first step of the fit)
        self.check_discovered = model.discovery is not None  # always checked: the structure is only guessed
        self.tolerance = tolerance
        self.fallback = fallback  # a discovered structure that does not hold: the uniform mode, from then on
        self.uniform: UniformSteps | None = None
        self.logs = logs  # a discovered model: what its training_step logs, relayed once per step

    def forward(self, batch: Any, step: TrainingStep) -> torch.Tensor:
        if self.uniform is not None:
            return self.uniform.forward(batch, step)
        sizes = step.rank_plan.micro_batch_sizes
        parts = micro_batches(batch, sizes) if sizes else []
        if self.check_discovered:
            self.check_discovered = self.verify_loss = False
            why = discovered_check(self, parts[0] if parts else batch, bool(parts), step.batch_idx)
            if why:
                if self.fallback is None:
                    raise ConfigurationError(f"Cephalo cannot run {self.model.name} layer by layer: {why}")
                self.uniform = self.fallback(why)
                return self.uniform.forward(batch, step)
        if self.verify_loss:
            self.verify_loss = False
            self._verify(parts[0] if parts else batch, has_samples=bool(parts), batch_idx=step.batch_idx)
        shares, total = micro_batch_weights(parts, self.weighting, step.global_batch, self.schedule.device,
                                           self.schedule.sharded.world_group, step.global_items)
        share = self.weighting.share
        if share is not None:  # the model's loss divides by the global items itself: weight 1
            weights = [(1.0 if w else 0.0) / step.accumulate for w in shares]
            loss = lambda k, out, side: share(out, parts[k], side, total)  # noqa: E731
        else:
            weights = [w / step.accumulate for w in shares]
            loss = lambda k, out, side: self.model.loss(out, parts[k], side)  # noqa: E731

        def prepare(micro_batch: Any) -> tuple[torch.Tensor, Any]:
            x, side = self.model.prepare(micro_batch)
            check_first_inputs([x])
            return x, side

        recompute = step.rank_plan.recompute or len(parts) > 1
        with self._model_code(), self.logs.recorded() if self.logs is not None else contextlib.nullcontext():
            step.local_loss = self.schedule.forward(parts, prepare, loss, weights, recompute=recompute)
        step.weights = shares
        return step.local_loss.detach() * step.accumulate  # Lightning divides what we return by `accumulate`

    def _model_code(self) -> contextlib.AbstractContextManager[Any]:
        """A discovered model's layers run the user's training_step: its self.log calls are dropped
        (the step logs its global loss itself)."""
        return user_code(self.module) if self.model.discovery is not None else contextlib.nullcontext()

    def backward(self, closure_loss: torch.Tensor, step: TrainingStep) -> StepReport:
        if self.uniform is not None:
            return self.uniform.backward(closure_loss, step)
        sharded = self.schedule.sharded
        names, sums = self.logs.sums(step.weights, sharded.world_group) if self.logs is not None else ([], [])
        sync = start_step(step.local_loss * step.accumulate, sharded, sums, signal=step.pending_signal)
        with self._model_code():
            self.schedule.backward(step.loss_scale)
        report, values = sync.finish(step.sync)
        if "train_loss" not in {spec.name for spec in names}:  # the user's own train_loss is relayed instead
            log_scalar(self.module, "train_loss", report.loss, step.global_batch, prog_bar=True, on_step=True,
                       on_epoch=True)
        relog(self.module, names, values, step)
        return report

    @torch.no_grad()
    def _verify(self, micro_batch: Any, has_samples: bool, batch_idx: int) -> None:
        """Collective: the user's ``training_step`` and the model's own loss agree on a micro-batch."""
        sharded = self.schedule.sharded
        trainer = self.module.trainer
        with captured_logs(trainer):  # the check's own self.log calls are dropped
            sharded.gather_root()
            try:
                output = self.module.training_step(micro_batch, batch_idx)
            finally:
                sharded.free_all()
        try:
            user, refusal = user_loss(output), ""
        except ConfigurationError as err:  # every rank learns it at the gather below, and all refuse together
            user, refusal = None, str(err)
        with sharded.scheduled():  # the layers run as the schedule's forward runs them
            sharded.gather_root()
            try:
                x = side = None
                for index, layer in enumerate(self.model.layers, start=1):
                    sharded.gather(index, prefetch=index + 1)
                    if index == 1:
                        x, side = self.model.prepare(micro_batch)
                    x = layer(x, side)
                    sharded.units[index].free()
                derived = self.model.loss(x, micro_batch, side)
            finally:
                sharded.free_all()
        mismatch = 0.0
        if has_samples and torch.is_tensor(user):
            user_value, derived_value = float(user), float(derived)
            if not math.isclose(user_value, derived_value, rel_tol=self.tolerance, abs_tol=self.tolerance):
                mismatch = 1.0
        flag = [mismatch, float(user) if torch.is_tensor(user) else math.nan, float(derived), refusal]
        flags = gather_objects(flag, sharded.world_group)
        refused = next(((r, f[3]) for r, f in enumerate(flags) if f[3]), None)
        if refused is not None:
            raise ConfigurationError(f"{refused[1]} (rank {refused[0]})")
        bad = [(r, f) for r, f in enumerate(flags) if f[0] > 0]
        if bad:
            rank, (_, got, want, _) = bad[0]
            raise ConfigurationError(
                f"Cephalo runs {self.model.name} layer by layer and computes the model's own loss, but on rank {rank} "
                f"your training_step returned {got:.6g} where the model's own loss is {want:.6g} on the same micro-batch. "
                "Your training_step computes a different objective, which the layered mode would silently replace. Use "
                "CephaloStrategy(mode='uniform') to train with your training_step, or implement the layered protocol "
                "(cephalo_layers, cephalo_input, cephalo_loss) for your loss; CephaloStrategy(verify_loss=False) "
                "skips this check"
            )


class UniformSteps:
    """Micro-batch-major through the user's own ``training_step`` (any model).

    Micro-batch 0 runs in ``forward`` (Lightning then zeroes the gradients and calls backward);
    the others run in ``backward``, each followed by its own backward, with the gradients kept
    unsharded until the last one. The user's ``self.log`` calls are collected per micro-batch and
    logged once per step with their weighted global value (as single-process training on the
    global batch would log them).

    Manual optimization (one micro-batch per rank): the user's ``training_step`` drives the step
    itself (``manual_backward``, ``optimizer.step()``), so it runs as it is, its logs untouched.
    """

    def __init__(self, module: pl.LightningModule, sharded: ShardedModel, training_step: Callable[..., Any],
                 weighting: LossWeighting) -> None:
        self.module = module
        self.sharded = sharded
        self.training_step = training_step
        self.weighting = weighting
        self.output_checked = False  # the first call's output is checked (check_training_step_output)

    def _run(self, step: TrainingStep, k: int) -> Any:
        """The user's ``training_step`` on micro-batch ``k``, its loss and logged values kept in ``step``."""
        part = step.micro_batches[k]
        if not self.module.automatic_optimization:
            return self.training_step(part, *step.args)
        with captured_logs(self.module.trainer) as capture:
            step.capturing = True
            try:
                output = self.training_step(part, *step.args)
            finally:
                step.capturing = False
        if output is None or not self.output_checked:
            check_training_step_output(output)
            self.output_checked = True
        step.logged.append((step.weights[k], logged_values(capture)))
        step.losses.append(self._loss(output).detach())
        return output

    def forward(self, batch: Any, step: TrainingStep) -> Any:
        step.micro_batches = micro_batches(batch, step.rank_plan.micro_batch_sizes)
        step.weights, _ = micro_batch_weights(step.micro_batches, self.weighting, step.global_batch,
                                              self.sharded.device, self.sharded.world_group, step.global_items)
        self.sharded.gather_root()
        return self._run(step, 0)

    @staticmethod
    def _loss(output: Any) -> torch.Tensor:
        return output["loss"] if isinstance(output, dict) else output

    def backward(self, closure_loss: torch.Tensor, step: TrainingStep) -> StepReport:
        """``closure_loss``: micro-batch 0's loss as Lightning prepared it (already / accumulate
        and, with a gradient scaler, already scaled)."""
        weights = step.weights
        n = len(weights)
        if not self.module.automatic_optimization:  # manual_backward(loss) from inside training_step
            self.sharded.backward(closure_loss * weights[0])  # already scaled by the precision plugin
            report, _ = finish_step(closure_loss.detach() * weights[0], self.sharded, step.sync,
                                    signal=step.pending_signal())
            return report
        self.sharded.set_requires_gradient_sync(step.sync and n == 1)
        started = self._start(step) if n == 1 else None  # the last micro-batch's loss and logs are known
        self.sharded.backward(closure_loss * weights[0])
        for k in range(1, n):
            loss = self._loss(self._run(step, k)) / step.accumulate
            self.sharded.set_requires_gradient_sync(step.sync and k == n - 1)
            if k == n - 1:
                started = self._start(step)
            self.sharded.backward(loss * (weights[k] * step.loss_scale))
        self.sharded.set_requires_gradient_sync(True)
        assert started is not None
        names, sync = started
        report, values = sync.finish(step.sync)
        self._relog(names, values, step)
        return report

    def _start(self, step: TrainingStep) -> tuple[list[LoggedValue], StepSync]:
        """The step's all-reduce, once every micro-batch's loss and logs are in ``step``: the names
        of the logged sums it carries, and the all-reduce."""
        local = sum((w * loss.double() for w, loss in zip(step.weights, step.losses) if w),
                    torch.zeros((), dtype=torch.float64))
        names, sums = _weighted_logs(step.logged)
        return names, start_step(local, self.sharded, sums, signal=step.pending_signal)

    def _relog(self, names: list[LoggedValue], values: list[torch.Tensor], step: TrainingStep) -> None:
        relog(self.module, names, values, step)
        done = {spec.name for spec in names}
        last: dict[str, LoggedValue] = {}
        for _, logged in step.logged:
            for v in logged:
                if v.name not in done:
                    last[v.name] = v
        for v in last.values():  # metrics objects and max/min values: the last micro-batch's, as logged
            with logging_as(self.module, "training_step"):
                kwargs = {"metric_attribute": v.metric_attribute} if not torch.is_tensor(v.value) else {}
                self.module.log(v.name, v.value, prog_bar=v.prog_bar, logger=v.logger, on_step=v.on_step,
                                on_epoch=v.on_epoch, sync_dist=torch.is_tensor(v.value),
                                reduce_fx=v.reduction if v.reduction != "custom" else "mean", **kwargs)


def relog(module: pl.LightningModule, names: list[LoggedValue], values: list[torch.Tensor], step: TrainingStep) -> None:
    """Log the user's values with their weighted global combination (already all-reduced)."""
    for spec, value in zip(names, values):
        log_scalar(module, spec.name, float(value), step.global_batch, prog_bar=spec.prog_bar, logger=spec.logger,
                   on_step=spec.on_step, on_epoch=spec.on_epoch, reduce_fx=spec.reduction)


def _weighted_logs(logged: list[tuple[float, list[LoggedValue]]]) -> tuple[list[LoggedValue], list[torch.Tensor]]:
    """Per logged name: sum_k w_k v_k (mean), or sum_k v_k (sum); max/min and metrics as they are."""
    first = {v.name: v for _, values in logged for v in values}
    names, sums = [], []
    for name, spec in first.items():
        if not torch.is_tensor(spec.value) or spec.reduction not in ("mean", "sum"):
            continue
        total = torch.zeros((), dtype=torch.float64)
        for weight, values in logged:
            for v in values:
                if v.name == name and (weight or spec.reduction == "sum"):
                    total = total + (weight if spec.reduction == "mean" else 1.0) * v.value.detach().double().cpu()
        names.append(spec)
        sums.append(total)
    return names, sums


class NonFiniteGuard:
    """Skips an optimizer step on every rank when any rank's loss or gradient was not finite.

    The decision comes from the step's all-reduce (:func:`finish_step`), so every rank skips
    together; ``max_consecutive`` skips in a row stop training with :class:`NonFiniteLossError`.
    """

    def __init__(self, max_consecutive: int) -> None:
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.skipped = 0
        self._pending: set[int] = set()
        self._what = "loss"

    @property
    def enabled(self) -> bool:
        return self.max_consecutive > 0

    def record(self, report: StepReport) -> None:
        """A batch finished its backward (several per optimizer step under accumulation)."""
        if report.nonfinite:
            self._pending.update(report.nonfinite)
            self._what = report.what

    def should_skip(self, step: int) -> bool:
        """Before the optimizer step: skip it? Raises after too many skips in a row."""
        bad, self._pending = sorted(self._pending), set()
        if not self.enabled or not bad:
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.skipped += 1
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteLossError(
                f"Cephalo: {self.consecutive} optimizer steps in a row had a non-finite loss or gradient (last at step "
                f"{step}, on rank(s) {bad}); training stopped. The weights are as after the last finite step: resume "
                "from the last checkpoint with a lower learning rate, gradient clipping or cleaner data, or raise "
                "CephaloStrategy(max_nonfinite_skips=...)"
            )
        rank_zero_warn(
            f"Cephalo: step {step} had a non-finite {self._what} on rank(s) {bad}; the optimizer step was skipped "
            f"on every rank ({self.consecutive} in a row, stopping at {self.max_consecutive})"
        )
        return True
