"""The fastest pipelined plan over the layouts, micro-batch counts and layer cuts weighed.

For every layout (:mod:`.layouts`) the D pipelines take near-equal batches B_d (the first
``B mod D`` one sample more), and every micro-batch count M with a distinct largest micro-batch
``ceil(max_d B_d / M)``, M <= min_d B_d, is weighed (the fewest micro-batches of each size: [Note:
the fewest micro-batches of a size]); for each, the layer cut minimising the slowest
stage's micro-step (:func:`.cuts.best_cuts`, memory included) is priced as a whole step
(:class:`~cephalo_lightning.planner.cost.pipeline_cost.PipelineCost`). The schedule is 1F1B: GPipe holds
every micro-batch's stash (never less memory) and is priced the same compute; it exposes fewer
messages between stages (none in its steady state), so where those weigh it could be the faster, and
it is not weighed (below). The candidates are priced lowest bound first and the search stops
where the bound passes the best step ([Note: the pruned pipeline search]).

[Note: what the pipeline search leaves out] The GPipe schedule, uneven batches between pipelines, a
micro-batch count per pipeline, interleaved schedules and keeping a stage's autograd graph (no recompute) are not
weighed, nor the layouts :mod:`.layouts` leaves out; the pipelined plan is the best of what is
weighed, with no certified gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cephalo_lightning._common.vocabulary import PipelineSchedule
from cephalo_lightning.planner.cost.device_cost import kind_costs
from cephalo_lightning.planner.cost.pipeline_cost import PipelineCost, PipelineShape, StagePrice
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.plan import split_sizes
from cephalo_lightning.planner.search.pipeline.cuts import best_cuts
from cephalo_lightning.planner.search.pipeline.layouts import StageLayout, stage_layouts
from cephalo_lightning.planner.search.pipeline.step_bound import step_bounds

SCHEDULE = PipelineSchedule.ONE_F_ONE_B
BOUND_SLACK = 1e-9  # a bound within this fraction of the best step is priced still (rounding)


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
    hops_ms: tuple[float, ...]  # one message's time across each cut (PipelineCost.hops_ms)


def near_equal(total: int, parts: int) -> tuple[int, ...]:
    """The D pipelines' batches: the plan's near-equal split (:func:`~cephalo_lightning.planner.schema.plan.split_sizes`, the first
    ``total mod parts`` one sample more), ``parts <= total``."""
    return tuple(split_sizes(total, parts))


def micro_batch_counts(batches: tuple[int, ...]) -> list[int]:
    """The counts M <= min B_d, one per distinct largest micro-batch ceil(max B_d / M): the fewest giving it.

    [Note: the fewest micro-batches of a size] The micro-step is priced at the largest micro-batch,
    so of the counts sharing it the fewest makes the shortest step, (M + S - 1) micro-steps, and
    holds no more in flight (1F1B: min(M, S - s))."""
    top, low = max(batches), min(batches)
    by_size: dict[int, int] = {}
    for M in range(1, low + 1):
        by_size.setdefault(-(-top // M), M)
    return sorted(by_size.values())


def price_cut(cluster: Cluster, shape: PipelineShape, schedule: PipelineSchedule, cuts: tuple[int, ...],
              layout: StageLayout) -> PipelineCandidate:
    """One candidate priced whole."""
    cost = PipelineCost(cluster, shape, schedule)
    stages = tuple(cost.stage(s, layers) for s, layers in enumerate(cuts))
    return PipelineCandidate(layout, shape, schedule, cuts, stages, cost.step_ms(list(stages)), cost.cross_node_bytes(),
                             tuple(cost.hops_ms()))


def best_for(cluster: Cluster, layout: StageLayout, batches: tuple[int, ...], M: int,
             schedule: PipelineSchedule = SCHEDULE) -> PipelineCandidate | None:
    """The best cut of one layout at given batches and micro-batch count, or None when none fits."""
    shape = PipelineShape(layout.chains, batches, M)
    cost = PipelineCost(cluster, shape, schedule)

    counts = np.arange(1, cluster.model.num_layers - layout.num_stages + 2)
    prices = [[None, *cost.stage_table(s, counts)] for s in range(layout.num_stages)]
    found = best_cuts(cluster.model.num_layers, layout.num_stages,
                      lambda s, layers: float(prices[s][layers].micro_step_ms.max()) if prices[s][layers].fits
                      else math.inf)
    if found is None:
        return None
    stages = tuple(prices[s][layers] for s, layers in enumerate(found[0]))
    return PipelineCandidate(layout, shape, schedule, found[0], stages, cost.step_ms(list(stages)),
                             cost.cross_node_bytes(), tuple(cost.hops_ms()))


def search_pipelines(cluster: Cluster, global_batch: int, *, prune: bool = True) -> PipelineCandidate | None:
    """The fastest pipelined candidate weighed (see the module), or None when none fits.

    [Note: the pruned pipeline search] Every (layout, micro-batch count) is weighed; with ``prune``
    they are priced in the order of their lower bound (:mod:`.step_bound`), those no rank of a
    stage can hold skipped, and the search stops at the first bound above the best step found
    (every later candidate's step is at least its bound). Of equal steps the first in the order
    listed wins, as without ``prune``: the same candidate either way."""
    weighed: list[tuple[StageLayout, tuple[int, ...], int]] = []
    bounds, fits = [np.zeros(0)], [np.zeros(0, dtype=bool)]
    costs = kind_costs(cluster) if prune else None
    for layout in stage_layouts(cluster):
        if global_batch < layout.num_pipelines:
            continue
        batches = near_equal(global_batch, layout.num_pipelines)
        counts = micro_batch_counts(batches)
        weighed += [(layout, batches, M) for M in counts]
        if costs is not None:
            layout_bounds, layout_fits = step_bounds(cluster, layout, batches, counts, costs)
            bounds.append(layout_bounds)
            fits.append(layout_fits)
    bound, may_fit = np.concatenate(bounds), np.concatenate(fits)
    order = list(range(len(weighed)))
    if prune:  # the lowest bound first, the order listed among equals
        order = [int(i) for i in np.lexsort((np.arange(len(weighed)), bound)) if may_fit[i]]
    best: PipelineCandidate | None = None
    first = len(weighed)  # the best's place in the order listed
    for i in order:
        if prune and best is not None and bound[i] > best.step_ms * (1 + BOUND_SLACK):
            break
        found = best_for(cluster, *weighed[i])
        if found is not None and (best is None or (found.step_ms, i) < (best.step_ms, first)):
            best, first = found, i
    return best
