"""How the fit's ranks take part in each step: the whole job one replica (:class:`OneReplica`), or
one of several torchft replica groups (:class:`~.fault_tolerant_fit.FitReplica`).

The strategy asks the same questions of either, at the same points of the fit:

* at setup: the plan its ranks shard by (:meth:`OneReplica.shard_plan`; ``P`` itself, or the group's
  part of it), whether the schedule and a second fit are allowed, and :meth:`~OneReplica.join` once
  the optimizer exists;
* for the training loader: the data seed's check and whether every rank takes the whole global
  batch (:attr:`~OneReplica.whole_batches`);
* at ``on_train_start``: the step the fit starts at (:meth:`~OneReplica.start`);
* every step: this rank's part of the batch (:meth:`~OneReplica.step_batch`, a :class:`StepPart`)
  and the closure run until the step is committed (:meth:`~OneReplica.run_closure`);
* at teardown: :meth:`~OneReplica.shutdown`.

[Note: one replica] The whole job is one replica: every step commits, the loader already gives
each rank its planned slice, and nothing here issues a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch

from cephalo_lightning.lightning.steps.step_state import StepReport
from cephalo_lightning.planner import Plan, RankPlan
from cephalo_lightning.runtime.sampler import PlannedBatchSampler


@dataclass(frozen=True)
class StepPart:
    """What this rank trains on in the step that starts: ``batch``, its ``rank_plan`` and the global
    batch's ``global_items`` (None: the plan's and the steps' own count); ``deferred_logs``: where the
    step's logs wait until the step commits (None: logged at the step's all-reduce)."""

    batch: Any
    rank_plan: RankPlan | None = None
    global_items: float | None = None
    deferred_logs: list | None = None


class OneReplica:
    """The plain fit: the whole job is one replica (see the module notes)."""

    replica: Any = None  # a torchft replica group, where there is one
    whole_batches = False  # every rank is given its planned slice of every global batch

    def shard_plan(self, plan: Plan | None) -> Plan | None:
        """The plan this process's ``Trainer`` shards by."""
        return plan

    def check_schedule(self, schedule: str) -> None:
        """Refuse a schedule the replication cannot run (every schedule runs here)."""

    def check_refit(self, fitting: bool) -> None:
        """Refuse a second fit of the same module (allowed here)."""

    def check_data_seed(self, seed: int | None, shuffle: bool) -> None:
        """Refuse a data order the replicas could draw differently (one replica draws one order)."""

    def join(self, optimizers: Sequence[torch.optim.Optimizer], *, accumulate: int, rank: int, world_size: int,
             sharded: Any) -> None:
        """The optimizer exists: start taking part, ``sharded`` the module's sharded model (nothing to start here)."""

    def start(self, trainer: pl.Trainer, sampler: PlannedBatchSampler) -> None:
        """Training starts: the fit starts where its checkpoint (if any) put it."""

    def step_batch(self, batch: Any, runtime: Any, sampler: PlannedBatchSampler) -> StepPart:
        """The step starts: the runtime cuts its next batch (the loader's, already this rank's slice)."""
        cut = runtime.next_batch()
        sampler.mark_consumed(cut.step)
        return StepPart(batch)

    def run_closure(self, closure: Callable[[], Any], optimizer: Any, rank: int) -> tuple[Any, StepReport | None]:
        """The step's closure, once (the step always commits); no report beyond the step's own."""
        return closure(), None

    def shutdown(self) -> None:
        """The fit ended."""
