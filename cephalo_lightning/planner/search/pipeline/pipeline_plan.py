"""A priced pipelined candidate as the plan's ranks: each rank's stage, pipeline, batch, share and why.

The ranks of stage s form its shard group; groups are numbered 0, 1, ... in the order of their
first rank, as :func:`~cephalo_lightning.planner.schema.plan.validate_plan` asks. Every active rank
is predicted the plan's step (the pipelines advance together); a rank binds by what dominates its
stage's micro-step: its compute and in-stage collectives (``compute``) or its point-to-point sends
(``link``); the messages on the schedule's critical path are the step's, priced once
(:func:`~cephalo_lightning.planner.cost.pipeline_cost.exposed_hops_ms`). Ranks outside every pipeline
are idle.
"""

from __future__ import annotations

from cephalo_lightning.planner.cost.pipeline_cost import bubble_fraction, exposed_hops_ms
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.plan import Binding, RankPlan
from cephalo_lightning.planner.search.pipeline.pipeline_search import PipelineCandidate


def idle_rank(cluster: Cluster, rank: int, why: str | None = None) -> RankPlan:
    """A rank left out: no samples, no state."""
    device = cluster.devices[rank]
    return RankPlan(rank, device.name, 0, 1, 0, 0.0, source=device.source,
                    memory_limit_gb=cluster.settings.usable_memory_fraction * device.memory_gb,
                    memory_capacity_gb=device.memory_gb, idle=True, why=why)


def stage_spans(stage_layers: tuple[int, ...]) -> list[tuple[int, int]]:
    """Each stage's first and last layer (0-based, inclusive)."""
    out, first = [], 0
    for count in stage_layers:
        out.append((first, first + count - 1))
        first += count
    return out


def pipeline_ranks(cluster: Cluster, found: PipelineCandidate) -> tuple[RankPlan, ...]:
    """Every rank's plan under ``found`` (idle ranks included), rank order."""
    shape, S, M = found.shape, found.shape.num_stages, found.shape.num_micro_batches
    step_s = found.step_ms / 1e3
    slowest = max(float(p.micro_step_ms.max()) for p in found.stages)
    bubble = bubble_fraction(M, S)
    hops = exposed_hops_ms(found.schedule, M, found.hops_ms)
    spans = stage_spans(found.stage_layers)
    placed: dict[int, RankPlan] = {}
    group_of_stage: dict[int, int] = {}
    for rank in sorted(r for chain in shape.chains for r in chain):
        d = next(i for i, chain in enumerate(shape.chains) if rank in chain)
        s = shape.chains[d].index(rank)
        group_of_stage.setdefault(s, len(group_of_stage))
        price = found.stages[s]
        device = cluster.devices[rank]
        w, u, p = (float(price.micro_step_ms[d]) / 1e3, float(price.compute_ms[d]) / 1e3, float(price.send_ms[d]) / 1e3)
        binding = Binding.LINK if p > u else Binding.COMPUTE
        first, last = spans[s]
        why = (f"stage {s} (layers {first}-{last}): micro-step {w:.3g} s of compute and in-stage collectives "
               f"({p:.3g} s sends a micro-batch); the slowest stage's {slowest / 1e3:.3g} s x ({M} + {S} - 1), "
               f"{100 * bubble:.0f}% of it the pipeline's fill and drain, and {hops / 1e3:.3g} s of messages between "
               f"stages on the schedule's critical path set the step")
        placed[rank] = RankPlan(
            rank, device.name, shape.batches[d], M, -(-shape.batches[d] // M), float(price.shares[d]),
            predicted_step_s=step_s, predicted_memory_gb=float(price.memory_gb[d]), source=device.source,
            memory_limit_gb=cluster.settings.usable_memory_fraction * device.memory_gb,
            memory_capacity_gb=device.memory_gb, recompute=True, shard_group=group_of_stage[s], binding=binding,
            why=why, stage=s, pipeline=d)
    return tuple(placed.get(r) or idle_rank(cluster, r) for r in range(cluster.world_size))
