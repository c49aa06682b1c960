"""What a plan's figures assume that nothing measured, as lines for the plan's output.

* ``settings.free_links``: the collectives cost 0 s, a person's what-if of compute and memory alone
  ([Note: no free links by default]); every figure of the plan is then a bound no network reaches.
* an unmeasured overlap (no ``settings.overlap``, no calibration) on ranks that exchange anything:
  the collectives are priced serial with compute ([Note: an unmeasured overlap]). The plan is solved
  again at overlap 1 (every collective hidden), and where the best shard grouping there differs::

      groups(plan at overlap 0) != groups(plan at overlap 1)

  the line says so: the overlap, not measured, decides the grouping, so it is worth measuring.
"""

from __future__ import annotations

from dataclasses import replace

from cephalo_lightning._common.vocabulary import Planner
from cephalo_lightning.planner.planning import plan as solve
from cephalo_lightning.planner.report import groups_line
from cephalo_lightning.planner.schema.cluster_spec import UNMEASURED_OVERLAP, Cluster
from cephalo_lightning.planner.schema.plan import Plan

FREE_LINKS = ("free links (settings.free_links: true): the collectives cost 0 s, so the plan weighs compute and "
              "memory alone and its figures are a bound no network reaches")
PROFILE = "python -m cephalo_lightning profile"


def overlap_line(cluster: Cluster, plan: Plan, groupings: tuple[str, ...] | None = None) -> str | None:
    """The unmeasured overlap, and whether it decides the plan's grouping (None: measured, or nothing
    to overlap)."""
    s = cluster.settings
    if s.overlap is not None or cluster.calibration is not None or s.free_links or cluster.world_size == 1:
        return None
    line = (f"overlap not measured: priced at {UNMEASURED_OVERLAP:g} (collectives serial with compute, so the step is "
            f"an upper bound); {PROFILE} measures it")
    if plan.planner != Planner.CEPHALO or plan.pipelined or plan.idle_ranks:
        return line  # the grouping weighed at overlap 1 is of every rank, without pipelines
    hidden = solve(replace(cluster, settings=replace(s, overlap=1.0)), plan.global_batch_size, plan.mode,
                   groupings=groupings)
    if hidden.shard_groups == plan.shard_groups:
        return line
    return (f"{line}; it decides the grouping: at overlap 1 (collectives hidden) the best plan has "
            f"{groups_line(hidden)} at {hidden.predicted_samples_per_s:.3g} samples/s")


def assumption_lines(cluster: Cluster, plan: Plan, groupings: tuple[str, ...] | None = None) -> list[str]:
    """Every assumption of the plan's figures that nothing measured, one line each."""
    lines = [FREE_LINKS] if cluster.settings.free_links and cluster.world_size > 1 else []
    overlap = overlap_line(cluster, plan, groupings)
    return lines + ([overlap] if overlap else [])
