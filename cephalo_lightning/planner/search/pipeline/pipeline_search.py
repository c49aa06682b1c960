"""The fastest pipelined plan over the layouts, micro-batch counts and layer cuts weighed.

For every layout (:mod:`.layouts`) the D pipelines take near-equal batches B_d (the first
``B mod D`` one sample more), and every micro-batch count M with a distinct largest micro-batch
``ceil(max_d B_d / M)``, M <= min_d B_d, is weighed; for each, the layer cut minimising the slowest
stage's micro-step (:func:`.cuts.best_cuts`, memory included) is priced as a whole step
(:class:`~cephalo_lightning.planner.cost.pipeline_cost.PipelineCost`). The schedule is 1F1B: the cost
model prices GPipe's step alike and its memory never lower, so GPipe is never the faster.

[Note: what the pipeline search leaves out] Uneven batches between pipelines, a micro-batch count
per pipeline, interleaved schedules and keeping a stage's autograd graph (no recompute) are not
weighed, nor the layouts :mod:`.layouts` leaves out; the pipelined plan is the best of what is
weighed, with no certified gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cephalo_lightning._common.vocabulary import PipelineSchedule
from cephalo_lightning.planner.cost.pipeline_cost import PipelineCost, PipelineShape, StagePrice
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.search.pipeline.cuts import best_cuts
from cephalo_lightning.planner.search.pipeline.layouts import StageLayout, stage_layouts

SCHEDULE = PipelineSchedule.ONE_F_ONE_B


@dataclass(frozen=True)
class PipelineCandidate:
    """A priced pipelined plan: its layout, batches and micro-batches, cuts and every stage's price."""

    layout: StageLayout
    shape: PipelineShape
    schedule: PipelineSchedule
    stage_layers: tuple[int, ...]
    stages: tuple[StagePrice, ...]
    step_ms: float
    cross_node_bytes: float


def near_equal(total: int, parts: int) -> tuple[int, ...]:
    q, rem = divmod(total, parts)
    return tuple(q + (1 if d < rem else 0) for d in range(parts))


def micro_batch_counts(batches: tuple[int, ...]) -> list[int]:
    """The counts M <= min B_d, one per distinct largest micro-batch ceil(max B_d / M), fewest micro-batches last."""
    top, low = max(batches), min(batches)
    by_size: dict[int, int] = {}
    for M in range(1, low + 1):
        by_size[-(-top // M)] = M  # the largest M giving this micro-batch: the smallest bubble
    return sorted(by_size.values())


def price_cut(cluster: Cluster, shape: PipelineShape, schedule: PipelineSchedule, cuts: tuple[int, ...],
              layout: StageLayout) -> PipelineCandidate:
    """One candidate priced whole."""
    cost = PipelineCost(cluster, shape, schedule)
    stages = tuple(cost.stage(s, layers) for s, layers in enumerate(cuts))
    return PipelineCandidate(layout, shape, schedule, cuts, stages, cost.step_ms(list(stages)), cost.cross_node_bytes())


def best_for(cluster: Cluster, layout: StageLayout, batches: tuple[int, ...], M: int,
             schedule: PipelineSchedule = SCHEDULE) -> PipelineCandidate | None:
    """The best cut of one layout at given batches and micro-batch count, or None when none fits."""
    shape = PipelineShape(layout.chains, batches, M)
    cost = PipelineCost(cluster, shape, schedule)

    counts = np.arange(1, cluster.model.num_layers - layout.num_stages + 2)
    table = [[math.inf] + [float(p.micro_step_ms.max()) if p.fits else math.inf for p in cost.stage_table(s, counts)]
             for s in range(layout.num_stages)]
    found = best_cuts(cluster.model.num_layers, layout.num_stages, lambda s, layers: table[s][layers])
    if found is None:
        return None
    return price_cut(cluster, shape, schedule, found[0], layout)


def search_pipelines(cluster: Cluster, global_batch: int) -> PipelineCandidate | None:
    """The fastest pipelined candidate weighed (see the module), or None when none fits."""
    best: PipelineCandidate | None = None
    for layout in stage_layouts(cluster):
        if global_batch < layout.num_pipelines:
            continue
        batches = near_equal(global_batch, layout.num_pipelines)
        for M in micro_batch_counts(batches):
            found = best_for(cluster, layout, batches, M)
            if found is not None and (best is None or found.step_ms < best.step_ms):
                best = found
    return best
