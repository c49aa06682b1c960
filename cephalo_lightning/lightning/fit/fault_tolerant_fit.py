"""``Trainer.fit`` under ``CephaloStrategy(fault_tolerance=True)``: Lightning's loop around one
:class:`~.fault_tolerance.ReplicaGroup`.

Step ``s`` of the fit trains on global batch ``G_s`` (the planned loader's, the same order on every
group). The loader gives every rank the **whole** ``G_s`` (``B`` samples), so what Lightning cuts and
prefetches never depends on which groups are up. Inside ``training_step`` the step's quorum names the
participants; this rank trains on ``G_s[o + a_r : o + a_r + b_r]`` (``o``: its group's offset in the
re-plan over the participants, ``a_r, b_r``: its part of the group's samples, :func:`~.fault_tolerance.rank_slice`)
with its micro-batch count kept (:func:`~.fault_tolerance.step_rank_plan`), each sample's loss weighted
``1/B`` as always. ``optimizer_step`` runs the closure (whose backward sums the gradients over the
participants: [Note: the sum inside the backward]), sums the logged values, and steps only if
torchft commits; otherwise it runs the closure again on the same ``G_s`` under the next quorum (the
redo), so Lightning counts one optimizer step per committed step.

[Note: a group joining late] Its first quorum is at ``on_train_start``, after the loader exists and
before it is iterated: torchft sends it the live weights, optimizer state and step ``S`` there, the
sampler is set to step ``S`` of the data order (data epoch ``S // n``, step ``S mod n`` of it, ``n``
global batches per epoch) and Lightning's step counters to ``S`` (as a ``ckpt_path`` resume sets
them), so it trains on ``G_S`` with the others and stops at the same ``max_steps``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from cephalo_lightning._common.errors import ConfigurationError, UnsupportedError
from cephalo_lightning._common.vocabulary import Schedule
from cephalo_lightning.lightning._private import set_steps_done
from cephalo_lightning.lightning.fit.fault_tolerance import ReplicaGroup, Settings, check_fit
from cephalo_lightning.lightning.fit.replication import OneReplica, StepPart
from cephalo_lightning.lightning.steps.log_relay import log_all
from cephalo_lightning.lightning.steps.step_state import StepReport
from cephalo_lightning.models.protocol import LossWeighting
from cephalo_lightning.planner import Plan, RankPlan
from cephalo_lightning.planner.replica_groups import StepSlice, local_plan, rank_slice, step_rank_plan
from cephalo_lightning.runtime.batching import slice_batch
from cephalo_lightning.runtime.plan_state import CutBatch
from cephalo_lightning.runtime.sampler import PlannedBatchSampler

log = logging.getLogger(__name__)

GROUP_ENV = "REPLICA_GROUP_ID"  # the group index when CephaloStrategy(replica_group=...) is unset


class FitReplica(OneReplica):
    """One group's fit: its part of the plan, its replica group once the optimizer exists, and the step in progress."""

    whole_batches = True  # every rank is given the whole global batch; its part is cut after the step's quorum

    def __init__(self, plan: Plan, group: int) -> None:
        self.plan = plan  # every group
        self.group = group
        self.local = local_plan(plan, group)  # what this group's Trainer shards by
        self.weights = [plan.ranks[r].batch_size for r in plan.shard_groups[group]]  # its ranks' in-group split
        self.replica: ReplicaGroup | None = None
        self.redoing = False  # the closure runs again on the same global batch (the step did not commit)
        self._first: StepSlice | None = None  # the first quorum's answer, for the first batch
        self._index: int | None = None  # the global batch the loader gave (its index in the whole order)
        self._sampler: PlannedBatchSampler | None = None  # the training loader's, from on_train_start
        self._module: Any = None  # the LightningModule the committed step's values are logged on
        self._logs: list[tuple[str, Any, dict[str, Any]]] = []  # the attempt's logged values (this group's part)
        self.live_seed: int | None = None  # the data seed of the live state this group recovered, if it did

    @classmethod
    def for_plan(cls, plan: Plan | None, group: int | None, environ: Mapping[str, str],
                 world_size: int | None = None) -> FitReplica:
        """This group's fit under ``plan`` (every group's), refused where it cannot run: no whole plan,
        no group index, ``world_size`` (this group's ranks, when given) not the plan's for the group."""
        if not isinstance(plan, Plan):
            raise ConfigurationError(
                "CephaloStrategy(fault_tolerance=True): Trainer.fit needs plan= naming every group (each group's "
                "Trainer sees only its own ranks, so it cannot plan the others); save the plan of the whole cluster "
                "(python -m cephalo_lightning plan ... ) and give it to every group")
        if group is None and environ.get(GROUP_ENV) is not None:
            try:
                group = int(environ[GROUP_ENV])
            except ValueError as err:
                raise ConfigurationError(f"{GROUP_ENV}={environ[GROUP_ENV]!r} is not a group index") from err
        check_fit(plan, group)
        planned = len(plan.shard_groups[group])
        if world_size is not None and world_size != planned:
            raise ConfigurationError(
                f"CephaloStrategy(fault_tolerance=True): replica group {group} started with {world_size} ranks, but the "
                f"plan gives it {planned}; every group starts (and comes back) with its planned ranks, as torchft sums "
                "rank i of every group with rank i of the others: start it with the plan's number of ranks, or plan "
                "again for every group")
        return cls(plan, group)

    def join(self, optimizers: Sequence[torch.optim.Optimizer], *, accumulate: int, rank: int, world_size: int,
             sharded: Any) -> None:
        """Start this rank's torchft manager (it heartbeats to the lighthouse from now); ``sharded``
        sums the gradients over the groups in its backward from now on."""
        if accumulate != 1:
            raise UnsupportedError(
                f"CephaloStrategy(fault_tolerance=True): Trainer(accumulate_grad_batches={accumulate}) is not supported "
                "(a step redone after a lost group would rerun only its last batch); raise the global batch instead")
        if len(optimizers) != 1:
            raise UnsupportedError(
                f"CephaloStrategy(fault_tolerance=True): configure_optimizers returned {len(optimizers)} optimizers; "
                "a replica group sums and recovers the state of one optimizer: return one")
        optimizer = optimizers[0]
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        self.replica = ReplicaGroup(parameters, optimizer, self.plan, self.group, Settings(), sharded=sharded, rank=rank,
                                    world_size=world_size, sampler_state=self._sampler_state,
                                    load_sampler_state=self._load_sampler_state)

    def _sampler_state(self) -> dict[str, Any]:
        """What a group that comes back takes with the weights: the data seed ([Note: one data order])."""
        return {"seed": self._sampler.seed} if self._sampler is not None else {}

    def _load_sampler_state(self, state: dict[str, Any]) -> None:
        """The live state's seed: one that differs from this group's is said here, and the quorum's
        comparison stops the run ([Note: one data order]); it is never adopted silently."""
        self.live_seed = state.get("seed")
        if self._sampler is not None and self.live_seed is not None and int(self.live_seed) != self._sampler.seed:
            log.error("Cephalo fault tolerance: group %d was given data seed %d, but the live groups draw with seed %d; "
                      "the quorum stops the run (give every group the same seed)", self.group, self._sampler.seed,
                      int(self.live_seed))

    @staticmethod
    def check_schedule(schedule: str) -> None:
        """The module runs layer by layer: the uniform mode (one micro-batch count on every rank) is refused."""
        if schedule != Schedule.LAYERED:
            raise ConfigurationError(
                f"CephaloStrategy(fault_tolerance=True): the module runs in the {schedule} mode (it has no layered form, "
                "or mode= asked for it), which fault tolerance refuses (the survivors' parts change the ranks' "
                "micro-batch counts); give the module the layered protocol (cephalo_layers, cephalo_input, "
                "cephalo_loss) or a model the package adapts")

    def shard_plan(self, plan: Plan | None) -> Plan:
        return self.local

    def check_refit(self, fitting: bool) -> None:
        if fitting:
            raise UnsupportedError(
                "CephaloStrategy(fault_tolerance=True): a second fit of the same module with the same strategy is not "
                "supported (its replica group ended with the first); start a new process, or a new "
                "CephaloStrategy and Trainer")

    @staticmethod
    def check_data_seed(seed: int | None, shuffle: bool) -> None:
        """Every group must draw the same global batches: a shuffled order needs a seed every group is given."""
        if shuffle and seed is None:
            raise ConfigurationError(
                "CephaloStrategy(fault_tolerance=True): the training DataLoader shuffles, but no data seed is set, so "
                "each group would draw its own order (its own torch seed); give every group the same "
                "CephaloStrategy(seed=...) or call lightning.seed_everything(...) with the same seed")

    def start(self, trainer: pl.Trainer, sampler: PlannedBatchSampler) -> None:
        """The fit's first quorum at the step this group starts at (a ``ckpt_path`` resume's, else 0):
        Lightning's step counters start at the quorum's step (as a ``ckpt_path`` resume sets them).
        Every group at step 0 while the run's checkpoint folder holds checkpoints is refused: the
        run would start over silently."""
        self._module = trainer.lightning_module
        resumed = trainer.global_step
        step = self.first_quorum(sampler, resumed)
        if step == 0 and resumed == 0:
            found = existing_checkpoints(trainer)
            if found:
                raise ConfigurationError(
                    f"CephaloStrategy(fault_tolerance=True): every replica group starts at step 0, but the run has "
                    f"checkpoints ({', '.join(str(p) for p in found[-3:])}): no live group holds the state, and "
                    "starting over would discard them. Resume every group from one checkpoint (trainer.fit(..., "
                    "ckpt_path=...) with the same path on every group, or ckpt_path='last'), or start over in an empty "
                    "checkpoint folder")
        set_steps_done(trainer, step)

    def first_quorum(self, sampler: PlannedBatchSampler, resumed: int = 0) -> int:
        """The fit's first quorum from committed step ``resumed`` (a checkpoint's; a group behind
        recovers the live state in it); the sampler is set to the quorum's step. Returns that step."""
        assert self.replica is not None
        self._sampler = sampler
        if resumed:
            self.replica.resume_at(resumed)
        self._first = self.replica.start_step(sampler)
        step = self._first.step
        if step != resumed:
            sampler.seek(step)
        return step

    def step_batch(self, batch: Any, runtime: Any, sampler: PlannedBatchSampler) -> StepPart:
        """The step's quorum, then this rank's part of the global batch (a redone step: the same batch
        again); the step's logs wait for its commit."""
        if not self.redoing:
            cut = runtime.next_batch()
            sampler.mark_consumed(cut.step)
            self.batch_cut(cut, len(sampler))
        self._logs.clear()
        return StepPart(*self.this_ranks_part(batch, runtime.rank_plan, runtime.weighting), deferred_logs=self._logs)

    def run_closure(self, closure: Callable[[], Any], optimizer: Any, rank: int) -> tuple[Any, StepReport | None]:
        """The closure until torchft commits the step, and the summed gradient's non-finite report."""
        result = self.until_committed(closure, optimizer)
        return result, self.summed_gradient_report(rank)

    def batch_cut(self, cut: CutBatch, steps_per_epoch: int) -> None:
        """The loader's batch for the step that starts: global batch ``epoch * steps_per_epoch + step``."""
        self._index = cut.epoch * steps_per_epoch + cut.step

    def this_ranks_part(self, batch: Any, rank_plan: RankPlan, weighting: LossWeighting) -> tuple[Any, RankPlan, float]:
        """The step's quorum, then this rank's samples of the global ``batch``, its rank plan for them,
        and the global batch's items (tokens for a per-token mean: counted here, on the whole batch)."""
        assert self.replica is not None
        part, self._first = self._first or self.replica.start_step(self._sampler), None
        if part.step != self._index:
            raise RuntimeError(behind_message(self.group, part.step, self._index, self.redoing))
        start, size = rank_slice(part, self.weights, self.replica.rank)
        items = float(weighting.items(batch, self.plan.global_batch_size))
        return slice_batch(batch, start, start + size), step_rank_plan(rank_plan, size), items

    def until_committed(self, closure: Callable[[], Any], optimizer: Any) -> Any:
        """Run the step's closure (its backward sums the gradients over the participants) until torchft commits the
        step (a group lost mid-step: the survivors run it again on the same global batch). Returns the
        committed run's closure result."""
        assert self.replica is not None
        inner = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer's torch optimizer
        while True:
            self._logs.clear()
            result = closure()
            values = torch.tensor([float(v) for _, v, _ in self._logs], dtype=torch.float64)
            self.replica.finish_sums(values)  # each group's part of the logged values: summed, the step's
            if self.replica.agree():
                self.redoing = False
                if self._module is not None:  # the committed attempt's values, once (a failed one logs nothing)
                    log_all(self._module, [(n, v, o) for (n, _, o), v in zip(self._logs, values.tolist())],
                            self.plan.global_batch_size)
                self._logs.clear()
                return result
            self.redoing = True
            inner.zero_grad(set_to_none=True)

    def summed_gradient_report(self, rank: int) -> StepReport | None:
        """After the cross-group sum: a report naming ``rank`` when the summed gradient is not finite on
        some rank of this group (an in-group all-reduce), else None. Every group holds the same sum, so
        every group's non-finite guard skips the step alike, not only the group whose loss went bad."""
        assert self.replica is not None
        parameters = self.replica.parameters
        bad = torch.zeros((), dtype=torch.float64, device=parameters[0].device if parameters else None)
        for p in parameters:
            if p.grad is not None:
                bad += (~torch.isfinite(p.grad)).any().to(bad.dtype)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad)
        return StepReport(float("nan"), (rank,), "gradient summed over the replica groups") if bad.item() else None

    def shutdown(self) -> None:
        if self.replica is not None:
            self.replica.shutdown()
            self.replica = None


def behind_message(group: int, step: int, index: int | None, redoing: bool) -> str:
    """Why the quorum's step and the loader's global batch differ: the group was healed past the step
    it was redoing (the others committed it without it), or the loaders' positions differ."""
    if redoing and index is not None and step > index:
        return (f"Cephalo fault tolerance: group {group} fell behind while redoing step {index}: the other groups "
                f"committed it without this group, which received their state at step {step}; Lightning's loader "
                "cannot skip ahead inside a step, so the group stops here. Restarted (its torchrun agent's "
                "--max-restarts), it rejoins with the live state; the other groups go on")
    return (f"Cephalo fault tolerance: the quorum is at step {step} but the loader gave global batch {index}; the "
            "groups' data orders differ (the same training data, global batch and seed on every group)")


def existing_checkpoints(trainer: pl.Trainer) -> list[Path]:
    """The checkpoints in the folders of the Trainer's checkpoint callbacks, oldest first."""
    found: list[Path] = []
    for callback in trainer.checkpoint_callbacks:
        folder = getattr(callback, "dirpath", None)
        if folder and Path(folder).is_dir():
            found += [p for p in Path(folder).iterdir() if p.name.endswith(".ckpt")]
    return sorted(found, key=lambda p: p.stat().st_mtime)
