"""Adopting a new plan during a fit: when it takes effect, and re-sharding the model to it.

A plan decided after setup (the callback's) cannot take effect at once: the loader has already
cut batches under the current one (:mod:`cephalo_lightning.runtime.plan_state`). So every rank
agrees on the first step no rank has cut data for, the plan starts there, and the model is
re-sharded in place just before training on the first batch cut under it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.optim import Optimizer

from cephalo_lightning.planner import Plan
from cephalo_lightning.runtime.plan_state import CutBatch, PlanState, PlanVersion
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel


class PlanSwitches:
    """The fit's plan versions and the one the model is sharded under."""

    def __init__(self, plan: Plan, sharded: ShardedModel, check: Callable[[Plan], None],
                 resharded: Callable[[Plan], None] | None = None) -> None:
        self.plan_state = PlanState(plan)
        self.sharded = sharded
        self.check = check  # refuses a plan the fit's schedule cannot run
        self.resharded = resharded  # collective: told of every plan the model is re-sharded by

    @property
    def plan(self) -> Plan:
        """The plan the model is sharded under now."""
        return self.plan_state.plan

    def schedule_switch(self, plan: Plan, accumulate: int) -> tuple[int, int]:
        """Collective: ``plan`` takes effect at the first step no rank has cut data for (at an
        optimizer-step boundary); batches already cut keep the old plan. Returns (data epoch, step)."""
        self.check(plan)
        at = torch.tensor(self.plan_state.first_uncut(), dtype=torch.int64)
        self.sharded.world.all_reduce_max(at)
        epoch, step = (int(v) for v in at.tolist())
        step = -(-step // accumulate) * accumulate
        self.plan_state.schedule(plan, (epoch, step))
        return epoch, step

    def switch_now(self, optimizers: Sequence[Optimizer]) -> None:
        """Adopt the latest plan version at once (nothing was cut under the current one)."""
        self._reshard(self.plan_state.latest, optimizers)

    def switch_if_due(self, optimizers: Sequence[Optimizer]) -> bool:
        """Before training on the next batch: re-shard if it was cut under a newer plan."""
        upcoming = self.plan_state.peek()
        if upcoming is None or upcoming.version == self.plan_state.sharded_version:
            return False
        self._reshard(self.plan_state.versions[upcoming.version], optimizers)
        return True

    def _reshard(self, version: PlanVersion, optimizers: Sequence[Optimizer]) -> None:
        self.sharded.reshard(version.plan.state_shares, optimizers, shard_groups=version.plan.shard_groups)
        self.plan_state.sharded_version = version.version
        if self.resharded is not None:
            self.resharded(version.plan)

    def next_batch(self) -> CutBatch:
        """The record of the batch this step trains on; it must have been cut under the plan the
        model is sharded by (a switch waits for the batches cut before it)."""
        record = self.plan_state.next_batch()
        if record.version != self.plan_state.sharded_version:
            raise RuntimeError(f"a batch cut under plan version {record.version} reached a model sharded under "
                               f"version {self.plan_state.sharded_version}")
        return record
