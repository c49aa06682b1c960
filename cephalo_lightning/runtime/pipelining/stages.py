"""Where a pipelined plan puts every layer and every rank: a value object, built from a plan or by hand.

    stage s computes layers [sum(stage_layers[:s]), sum(stage_layers[:s + 1]))
    pipeline d is a chain of ranks, one per stage:    pipelines[d][s]
    stage s's shard group is {pipelines[d][s] for every d}, sharing the stage's state by ``shares``
    pipeline d takes samples [sum(batch_sizes[:d]), sum(batch_sizes[:d + 1])) of the global batch,
    cut into micro_batches[d] micro-batches

The *layers* are the layered protocol's, in order (for a Hugging Face causal LM: the embedding, every
block, the final norm with the head), so the first stage embeds and the last computes the loss.

[Note: one shard group per stage] The ranks of one stage across the pipelines hold that stage's state
between them, by their shares (which sum to 1 over the stage); a stage never spans two shard groups
here (replicated shard groups inside a stage are refused by name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cephalo_lightning._common.vocabulary import PipelineSchedule
from cephalo_lightning.planner.schema.plan import split_sizes


@dataclass(frozen=True)
class PipelineLayout:
    stage_layers: tuple[int, ...]  # layers per stage, in order; their sum is the model's layer count
    pipelines: tuple[tuple[int, ...], ...]  # pipeline d's ranks, stage by stage
    shares: tuple[float, ...]  # per rank: its share of its stage's state
    batch_sizes: tuple[int, ...]  # per pipeline: its samples of the global batch
    micro_batches: tuple[int, ...]  # per pipeline: its micro-batch count M
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", PipelineSchedule(self.schedule))
        stages = len(self.stage_layers)
        if stages < 2:
            raise ValueError(f"a pipeline needs at least 2 stages, got stage_layers={self.stage_layers}; "
                             "plan without a pipeline instead (stage_layers=())")
        if any(n < 1 for n in self.stage_layers):
            raise ValueError(f"stage_layers={self.stage_layers}: every stage needs at least one layer; merge the empty stage")
        if not self.pipelines:
            raise ValueError("a pipelined layout needs at least one pipeline")
        for d, chain in enumerate(self.pipelines):
            if len(chain) != stages:
                raise ValueError(f"pipeline {d} has ranks {chain}, one per stage is {stages}: give it one rank per stage")
        ranks = sorted(r for chain in self.pipelines for r in chain)
        if ranks != list(range(len(ranks))):
            raise ValueError(f"the pipelines' ranks {ranks} must be 0..{len(ranks) - 1}, each once: every rank computes "
                             "one stage of one pipeline")
        if len(self.shares) != len(ranks):
            raise ValueError(f"{len(self.shares)} state shares for {len(ranks)} ranks: give one share per rank")
        for s in range(stages):
            total = sum(self.shares[r] for r in self.stage_ranks(s))
            if not math.isclose(total, 1.0, abs_tol=1e-9):
                raise ValueError(f"stage {s}'s ranks {self.stage_ranks(s)} have shares summing to {total}; make them sum to 1")
        if len(self.batch_sizes) != len(self.pipelines) or len(self.micro_batches) != len(self.pipelines):
            raise ValueError(f"batch_sizes={self.batch_sizes} and micro_batches={self.micro_batches} need one entry per "
                             f"pipeline ({len(self.pipelines)})")
        for d, (b, m) in enumerate(zip(self.batch_sizes, self.micro_batches)):
            if b < 0 or m < 1 or (b and m > b):
                raise ValueError(f"pipeline {d}: batch {b} in {m} micro-batches; give it 1 <= micro-batches <= batch")

    # ------------------------------------------------------------------ building one

    @classmethod
    def of(cls, plan: Any, num_layers: int) -> PipelineLayout:
        """The layout of a pipelined plan (``plan.stage_layers`` non-empty) over a model of ``num_layers``
        layers; refuses what this runtime cannot run, naming the rank and the fix."""
        stage_layers = tuple(getattr(plan, "stage_layers", ()) or ())
        if not stage_layers:
            raise ValueError("the plan is not pipelined (stage_layers is empty); run it without a pipeline")
        if sum(stage_layers) != num_layers:
            raise ValueError(f"the plan's stage_layers {stage_layers} cover {sum(stage_layers)} layers, the model has "
                             f"{num_layers}: re-plan for this model")
        idle = [r.rank for r in plan.ranks if getattr(r, "idle", False)]
        if idle:
            raise ValueError(f"ranks {idle} are idle in the plan; a pipelined run needs every launched rank in a pipeline: "
                             "launch only the plan's busy ranks, or re-plan without idle ranks")
        chains: dict[int, dict[int, int]] = {}
        for r in plan.ranks:
            chain = chains.setdefault(r.pipeline, {})
            if r.stage in chain:
                raise ValueError(f"ranks {chain[r.stage]} and {r.rank} both compute stage {r.stage} of pipeline "
                                 f"{r.pipeline}: give each pipeline one rank per stage")
            chain[r.stage] = r.rank
        for s in range(len(stage_layers)):
            groups = {plan.ranks[chain[s]].shard_group for chain in chains.values() if s in chain}
            if len(groups) > 1:
                raise ValueError(f"stage {s} spans shard groups {sorted(groups)}; this runtime shards a stage over one "
                                 "group of all its ranks: re-plan with one shard group per stage")
        pipelines = tuple(tuple(chains[d][s] for s in sorted(chains[d])) for d in sorted(chains))
        first = [plan.ranks[chain[0]] for chain in pipelines]
        for chain, head in zip(pipelines, first):
            for r in chain:
                rank = plan.ranks[r]
                if (rank.batch_size, rank.num_micro_batches) != (head.batch_size, head.num_micro_batches):
                    raise ValueError(f"rank {r} has batch {rank.batch_size} in {rank.num_micro_batches} micro-batches, "
                                     f"rank {head.rank} of its pipeline {head.batch_size} in {head.num_micro_batches}: "
                                     "a pipeline's ranks share its batch; re-plan")
        schedule = getattr(plan, "pipeline_schedule", None) or PipelineSchedule.ONE_F_ONE_B
        return cls(stage_layers, pipelines, tuple(r.state_share for r in plan.ranks),
                   tuple(r.batch_size for r in first), tuple(r.num_micro_batches for r in first), schedule)

    # ------------------------------------------------------------------ questions

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    @property
    def world_size(self) -> int:
        return len(self.shares)

    @property
    def global_batch_size(self) -> int:
        return sum(self.batch_sizes)

    def stage_of(self, rank: int) -> int:
        return next(s for chain in self.pipelines for s, r in enumerate(chain) if r == rank)

    def pipeline_of(self, rank: int) -> int:
        return next(d for d, chain in enumerate(self.pipelines) if rank in chain)

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """Stage ``stage``'s shard group: its rank in every pipeline, ascending."""
        return tuple(sorted(chain[stage] for chain in self.pipelines))

    def layer_range(self, stage: int) -> range:
        start = sum(self.stage_layers[:stage])
        return range(start, start + self.stage_layers[stage])

    def samples(self, pipeline: int) -> range:
        """Pipeline ``pipeline``'s samples within the global batch."""
        start = sum(self.batch_sizes[:pipeline])
        return range(start, start + self.batch_sizes[pipeline])

    def micro_batch_sizes(self, pipeline: int) -> list[int]:
        """Pipeline ``pipeline``'s micro-batches: near-equal sizes, the larger first."""
        return split_sizes(self.batch_sizes[pipeline], self.micro_batches[pipeline])

    def neighbours(self, rank: int) -> tuple[int | None, int | None]:
        """(the rank computing the stage before, the one after) in ``rank``'s pipeline."""
        chain, s = self.pipelines[self.pipeline_of(rank)], self.stage_of(rank)
        return (chain[s - 1] if s else None), (chain[s + 1] if s + 1 < len(chain) else None)

