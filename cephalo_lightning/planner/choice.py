"""Beyond shard groupings: the plan over every rank weighed against pipelined plans and subsets.

    chosen = argmin over {no pipeline, best subset, best pipelined} of the predicted step

``no pipeline`` is the searched plan over every rank (:func:`.planning.solved_plan`: the best shard
grouping); ``best subset`` the best such plan over the subsets of :mod:`.search.subsets` (the ranks
outside it idle; a subset whose step is bounded above the best found is not planned:
[Note: the pruned subset search]); ``pipelined`` the best pipelined candidate of :mod:`.search.pipeline`. A
departure from ``no pipeline`` needs a strictly shorter predicted step. The chosen plan keeps the
baselines of the plan over every rank and adds the three, each naming its shape, and says of any
idle rank what the plan over every rank predicts.

[Note: one certificate per shape] The optimality gap certifies the shard groupings of the plan's
own ranks only: a pipelined plan carries none ([Note: what the pipeline search leaves out]), a
subset's plan its own over the subset.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from cephalo_lightning._common.vocabulary import Planner, Schedule
from cephalo_lightning.planner.cost.calibration import calibrated
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.plan import BaselineResult, Plan
from cephalo_lightning.planner.schema.planning_error import PlanningError
from cephalo_lightning.planner.search.assemble import model_summary
from cephalo_lightning.planner.search.baselines import upper_bound_samples_per_s
from cephalo_lightning.planner.search.pipeline.pipeline_plan import idle_rank, pipeline_ranks
from cephalo_lightning.planner.search.pipeline.pipeline_search import PipelineCandidate, search_pipelines
from cephalo_lightning.planner.search.subsets import candidate_subsets, sub_cluster

NO_PIPELINE, BEST_SUBSET, PIPELINED = "no pipeline", "best subset", "pipelined"
MAX_SHAPE_RANKS = 64  # beyond, neither subsets nor pipelines are weighed (each subset is a solve of its own)
BOUND_SLACK = 1e-6  # a subset whose bound is within this fraction of the best step is planned still (rounding)


def span_text(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 1 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def devices_text(cluster: Cluster, ranks: tuple[int, ...]) -> str:
    names: dict[str, int] = {}
    for r in ranks:
        names[cluster.devices[r].name] = names.get(cluster.devices[r].name, 0) + 1
    return ", ".join(f"{n} x {name}" for name, n in names.items())


def with_idle(cluster: Cluster, sub: Plan, kept: tuple[int, ...], upper: float | None) -> Plan:
    """A subset's plan over the whole cluster: its ranks renumbered to theirs, the others idle, the
    whole cluster's upper bound."""
    by_rank = dict(zip(kept, sub.ranks))
    ranks = tuple(replace(by_rank[r], rank=r) if r in by_rank else idle_rank(cluster, r) for r in range(cluster.world_size))
    return replace(sub, ranks=ranks, baselines={}, upper_bound_samples_per_s=upper)


def subset_bound_s(cluster: Cluster, global_batch: int) -> float:
    """A lower bound on the step of any plan over ``cluster`` (a subset's, in the layered mode, the only
    one subsets are weighed in): B over its upper bound on samples/s.

    [Note: why the subset bound is valid] :func:`.baselines.upper_bound_samples_per_s` sums every
    device's best samples/s at the micro-batch sizes it can hold with no state, its compute alone
    (no collectives, no overhead): a rank given b samples computes at least b times its best time
    per sample, so any plan's B / step is at most the sum and its step at least B / upper. The
    subset's plan is priced on the same calibrated profiles (:func:`.planning.solved_plan`), and its
    fixed terms (the step overhead, a contention >= 1) only lengthen its step."""
    upper = upper_bound_samples_per_s(calibrated(cluster), global_batch, Schedule.LAYERED)
    return global_batch / upper if upper > 0 else math.inf


def best_subset(cluster: Cluster, solve: Callable[[Cluster], Plan], global_batch: int, upper: float | None = None,
                *, prune: bool = True) -> tuple[Plan | None, tuple[int, ...]]:
    """The fastest plan over the subsets weighed (``solve``: a cluster's plan over its every rank;
    the first of equal steps in :func:`.subsets.candidate_subsets`' order).

    [Note: the pruned subset search] With ``prune`` the subsets are planned in the order of their
    lower bound (:func:`subset_bound_s`), and the search stops at the first bound above the best
    step found: every later subset's step is at least its bound. Of equal steps the first in the
    order listed wins either way, so the pruned search keeps the same subset."""
    best, kept_best, first = None, (), -1
    source = calibrated(cluster)
    kept_of = candidate_subsets(cluster)
    subsets = [sub_cluster(source, kept) for kept in kept_of]
    bounds = [subset_bound_s(sub, global_batch) for sub in subsets] if prune else [0.0] * len(subsets)
    for i in sorted(range(len(subsets)), key=lambda i: (bounds[i], i)):
        if best is not None and bounds[i] > best.predicted_step_s * (1 + BOUND_SLACK):
            break
        try:
            found = solve(subsets[i])
        except PlanningError:
            continue  # the subset cannot hold the model or the batch
        if best is None or (found.predicted_step_s, i) < (best.predicted_step_s, first):
            best, kept_best, first = found, kept_of[i], i
    return (with_idle(cluster, best, kept_best, upper), kept_best) if best is not None else (None, ())


def _result(plan: Plan | None, reason: str) -> BaselineResult:
    if plan is None:
        return BaselineResult(None, False, reason=reason)
    return BaselineResult(plan.predicted_samples_per_s, True, plan.predicted_step_s, reason)


def pipelined_plan(cluster: Cluster, found: PipelineCandidate, base: Plan) -> Plan:
    step = found.step_ms / 1e3
    return Plan(base.global_batch_size, Schedule.LAYERED, pipeline_ranks(cluster, found), step,
                base.global_batch_size / step, base.upper_bound_samples_per_s, model_summary(calibrated(cluster)),
                planner=Planner.CEPHALO, emulated=base.emulated, stage_layers=found.stage_layers,
                pipeline_schedule=found.schedule)


def pipeline_text(found: PipelineCandidate, cross_node_gib: float) -> str:
    return (f"{found.layout.num_pipelines} pipeline(s) x {found.layout.num_stages} stages, layers "
            f"{'+'.join(map(str, found.stage_layers))}, {found.schedule}, {found.shape.num_micro_batches} micro-batches; "
            f"{cross_node_gib:.3g} GiB across nodes a step")


def choose(cluster: Cluster, base: Plan, solve: Callable[[Cluster], Plan], pipelines: bool, subsets: bool) -> Plan:
    """The fastest of ``base`` (the plan over every rank), the best subset's and the best pipelined plan.

    ``solve``: a cluster's plan over its every rank; the subsets' baselines are not read (it may
    leave them out)."""
    candidates: list[Plan] = [base]
    extra: dict[str, BaselineResult] = {NO_PIPELINE: _result(base, "the best shard grouping over every rank")}
    if cluster.world_size > MAX_SHAPE_RANKS:
        skipped = BaselineResult(None, False, reason=f"not weighed: {cluster.world_size} ranks, more than "
                                 f"{MAX_SHAPE_RANKS}", skipped=True)
        extra.update({name: skipped for name, asked in ((BEST_SUBSET, subsets), (PIPELINED, pipelines)) if asked})
        return replace(base, baselines={**base.baselines, **extra})
    if subsets and cluster.world_size > 1:
        sub, kept = best_subset(cluster, solve, base.global_batch_size, base.upper_bound_samples_per_s)
        idle = tuple(r for r in range(cluster.world_size) if r not in kept)
        reason = (f"ranks {span_text(kept)}: {devices_text(cluster, kept)}; idle {span_text(idle)}: "
                  f"{devices_text(cluster, idle)}") if sub is not None else "no subset weighed fits"
        extra[BEST_SUBSET] = _result(sub, reason)
        if sub is not None:
            candidates.append(sub)
    if pipelines and cluster.world_size > 1:
        try:
            found = search_pipelines(calibrated(cluster), base.global_batch_size)
        except PlanningError as error:
            extra[PIPELINED] = BaselineResult(None, False, reason=f"not weighed: {error}", skipped=True)
        else:
            piped = None if found is None else pipelined_plan(cluster, found, base)
            extra[PIPELINED] = _result(piped, "no layout weighed fits" if found is None else
                                       pipeline_text(found, found.cross_node_bytes / 2**30))
            if piped is not None:
                candidates.append(piped)
    chosen = min(candidates, key=lambda p: p.predicted_step_s)  # the first of equals: no pipeline
    ranks = chosen.ranks
    if chosen.idle_ranks:
        why = (f"adding them (the best plan over every rank) predicts {base.predicted_samples_per_s:.3g} samples/s "
               f"against this plan's {chosen.predicted_samples_per_s:.3g}")
        ranks = tuple(replace(r, why=why) if r.idle else r for r in ranks)
    return replace(chosen, ranks=ranks, baselines={**base.baselines, **extra},
                   optimality_gap=chosen.optimality_gap if not chosen.pipelined else None)

