"""The run's plan, versioned: the one object the data cut and the sharding agree on.

A plan (per-rank batch, micro-batches, state share) changes when the callback re-plans. The data
loader cuts index batches ahead of training (``num_workers * prefetch_factor`` of them), so a new
plan cannot take effect "now": it takes effect at the first step whose batch has not been cut yet
(:meth:`PlanState.first_uncut`, agreed by every rank), and every batch records the version it was
cut under. The training loop pops those records in order (:meth:`PlanState.next_batch`) and
re-shards the model to the batch's version before training on it, so the cut and the sharding
always match, whatever the loader's prefetching.

[Note: one global order] Every version cuts the same global batches (one seeded order per data
epoch, ``global_batch_size`` samples per step); versions differ only in how each global batch is
split among the ranks. So the union of the ranks' samples at step s is the single-process global
batch at step s under any plan, any switch and any resume.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from cephalo_lightning.planner import Plan, PlanningError

Position = tuple[int, int]  # (data epoch, step within it)


@dataclass(frozen=True)
class PlanVersion:
    version: int
    plan: Plan
    start: Position  # batches from this (epoch, step) on are cut by this plan


@dataclass(frozen=True)
class CutBatch:
    """What the sampler cut for one step: where it is in the data and under which version."""

    epoch: int
    step: int
    version: int


class PlanState:
    """Plan versions, the batches cut under them, and the version the model is sharded under."""

    def __init__(self, plan: Plan) -> None:
        self.versions: list[PlanVersion] = [PlanVersion(0, plan, (0, 0))]
        self.sharded_version = 0  # what the model's layout follows (the strategy advances it)
        self._cut: deque[CutBatch] = deque()
        self._next_cut: Position = (0, 0)

    @property
    def plan(self) -> Plan:
        """The plan the model is sharded under now."""
        return self.versions[self.sharded_version].plan

    @property
    def latest(self) -> PlanVersion:
        return self.versions[-1]

    def version_at(self, position: Position) -> PlanVersion:
        for version in reversed(self.versions):
            if version.start <= position:
                return version
        return self.versions[0]

    # ------------------------------------------------------------------ the data side

    def cut(self, epoch: int, step: int) -> PlanVersion:
        """The sampler cuts step ``step`` of data epoch ``epoch`` now: by which version."""
        version = self.version_at((epoch, step))
        self._cut.append(CutBatch(epoch, step, version.version))
        self._next_cut = (epoch, step + 1)
        return version

    def restart_cutting(self) -> None:
        """A new iterator over the data: batches cut by an abandoned one will never be trained."""
        self._cut.clear()

    def first_uncut(self) -> Position:
        """The earliest step a new plan can take effect at: no batch of it is cut yet."""
        return self._next_cut

    # ------------------------------------------------------------------ the training side

    def peek(self) -> CutBatch | None:
        return self._cut[0] if self._cut else None

    def next_batch(self) -> CutBatch:
        """The record of the batch the training loop is about to train on (in cut order)."""
        if not self._cut:
            raise RuntimeError("a training batch arrived that the planned sampler did not cut")
        return self._cut.popleft()

    # ------------------------------------------------------------------ switching

    def schedule(self, plan: Plan, at: Position) -> PlanVersion:
        """From data position ``at`` on, cut batches by ``plan`` (same world size, same global batch)."""
        current = self.latest.plan
        if plan.world_size != current.world_size or plan.global_batch_size != current.global_batch_size:
            raise PlanningError(
                f"a new plan must keep the world size ({current.world_size}) and the global batch "
                f"({current.global_batch_size}); got {plan.world_size} ranks and {plan.global_batch_size}"
            )
        if at < self._next_cut:
            raise PlanningError(f"step {at} of the data is already cut; a new plan can start at {self._next_cut} or later")
        version = PlanVersion(len(self.versions), plan, at)
        self.versions.append(version)
        return version
