"""``Trainer.fit`` under ``CephaloStrategy(fault_tolerance=True)``: Lightning's loop around one
:class:`~.fault_tolerance.ReplicaGroup`.

Step ``s`` of the fit trains on global batch ``G_s`` (the planned loader's, the same order on every
group). The loader gives every rank the **whole** ``G_s`` (``B`` samples), so what Lightning cuts and
prefetches never depends on which groups are up. Inside ``training_step`` the step's quorum names the
participants; this rank trains on ``G_s[o + a_r : o + a_r + b_r]`` (``o``: its group's offset in the
re-plan over the participants, ``a_r, b_r``: its part of the group's samples, :func:`~.fault_tolerance.rank_slice`)
with its micro-batch count kept (:func:`~.fault_tolerance.step_rank_plan`), each sample's loss weighted
``1/B`` as always. ``optimizer_step`` runs the closure, sums the gradients over the participants, and
steps only if torchft commits; otherwise it runs the closure again on the same ``G_s`` under the next
quorum (the redo), so Lightning counts one optimizer step per committed step.

[Note: a group joining late] Its first quorum is at ``on_train_start``, after the loader exists and
before it is iterated: torchft sends it the live weights, optimizer state and step ``S`` there, the
sampler is set to step ``S`` of the data order (data epoch ``S // n``, step ``S mod n`` of it, ``n``
global batches per epoch) and Lightning's step counters to ``S`` (as a ``ckpt_path`` resume sets
them), so it trains on ``G_S`` with the others and stops at the same ``max_steps``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from cephalo_lightning._common.errors import ConfigurationError, UnsupportedError
from cephalo_lightning._common.vocabulary import Schedule
from cephalo_lightning.lightning._private import set_steps_done
from cephalo_lightning.lightning.fit.fault_tolerance import ReplicaGroup, Settings, check_fit
from cephalo_lightning.lightning.fit.replication import OneReplica
from cephalo_lightning.lightning.steps.step_state import StepReport
from cephalo_lightning.models.protocol import LossWeighting
from cephalo_lightning.planner import Plan, RankPlan
from cephalo_lightning.planner.replica_groups import StepSlice, local_plan, rank_slice, step_rank_plan
from cephalo_lightning.runtime.batching import slice_batch
from cephalo_lightning.runtime.plan_state import CutBatch
from cephalo_lightning.runtime.sampler import PlannedBatchSampler

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

    @classmethod
    def for_plan(cls, plan: Plan | None, group: int | None, environ: Mapping[str, str]) -> FitReplica:
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
        return cls(plan, group)

    def join(self, optimizers: Sequence[torch.optim.Optimizer], *, accumulate: int, rank: int, world_size: int) -> None:
        """Start this rank's torchft manager (it heartbeats to the lighthouse from now)."""
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
        self.replica = ReplicaGroup(parameters, optimizer, self.plan, self.group, Settings(), rank=rank,
                                    world_size=world_size)

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
        """The fit's first quorum: Lightning's step counters start at its step (as a ``ckpt_path``
        resume sets them)."""
        set_steps_done(trainer, self.first_quorum(sampler))

    def first_quorum(self, sampler: PlannedBatchSampler) -> int:
        """The fit's first quorum (a group behind recovers the live state in it); the sampler is set to
        the live step. Returns that step."""
        assert self.replica is not None
        self._first = self.replica.start_step()
        step = self._first.step
        if step:
            sampler.seek(step)
        return step

    def step_batch(self, batch: Any, runtime: Any, sampler: PlannedBatchSampler) -> tuple[Any, RankPlan, float]:
        """The step's quorum, then this rank's part of the global batch (a redone step: the same batch again)."""
        if not self.redoing:
            cut = runtime.next_batch()
            sampler.mark_consumed(cut.step)
            self.batch_cut(cut, len(sampler))
        return self.this_ranks_part(batch, runtime.rank_plan, runtime.weighting)

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
        part, self._first = self._first or self.replica.start_step(), None
        if part.step != self._index:
            raise RuntimeError(
                f"Cephalo fault tolerance: the quorum is at step {part.step} but the loader gave global batch "
                f"{self._index}; the groups' data orders differ (the same training data, global batch and seed on "
                "every group)")
        start, size = rank_slice(part, self.weights, self.replica.rank)
        items = float(weighting.items(batch, self.plan.global_batch_size))
        return slice_batch(batch, start, start + size), step_rank_plan(rank_plan, size), items

    def until_committed(self, closure: Callable[[], Any], optimizer: Any) -> Any:
        """Run the step's closure and sum its gradients over the participants until torchft commits the
        step (a group lost mid-step: the survivors run it again on the same global batch). Returns the
        committed run's closure result."""
        assert self.replica is not None
        inner = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer's torch optimizer
        while True:
            result = closure()
            self.replica.reduce_gradients()
            if self.replica.agree():
                self.redoing = False
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
