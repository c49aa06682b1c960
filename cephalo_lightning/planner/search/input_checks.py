"""The checks before a solve: the inputs of :func:`.planning.plan` (mode, planner, global batch,
cluster size, groupings), and whether the memory can hold the training state at any step time.

Each check raises a :class:`.PlanningError` that names what is wrong, by how much, and what to
change, so a plan that cannot exist fails before the search instead of after it.
"""

from __future__ import annotations

import math

import numpy as np

from cephalo_lightning._common.units import memory_text
from cephalo_lightning._common.vocabulary import Grouping, Planner, Schedule, values_of
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.files import shown_number
from cephalo_lightning.planner.schema.limits import MAX_GLOBAL_BATCH, MAX_RANKS
from cephalo_lightning.planner.schema.planning_error import PlanningError
from cephalo_lightning.planner.search.peers import BASELINES
from cephalo_lightning.planner.search.problem import Problem

PLANNERS = (Planner.CEPHALO.value, *BASELINES)  # plan(planner=...): the search, or a baseline as a plan


def check_inputs(cluster: Cluster, global_batch: object, mode: object, planner: object) -> int:
    """The global batch as an int, once the mode, the planner, the batch and the cluster's size are
    ones the planner takes."""
    if mode not in values_of(Schedule):
        raise PlanningError(f"mode must be one of {values_of(Schedule)}, got {mode!r}; choose one of those (--mode)")
    if planner not in PLANNERS:
        raise PlanningError(f"planner must be one of {PLANNERS}, got {planner!r}; choose one of those (--planner)")
    if isinstance(global_batch, bool) or not isinstance(global_batch, (int, np.integer)) or global_batch < 1:
        raise PlanningError(f"the global batch size must be a whole number >= 1, got {shown_number(global_batch)}; "
                            "give one, e.g. --global-batch-size 64")
    if not cluster.devices:
        raise PlanningError("the cluster has no devices; list at least one GPU under 'devices:'")
    B, W = int(global_batch), cluster.world_size
    if B > MAX_GLOBAL_BATCH:
        raise PlanningError(
            f"the global batch {B:,} is {B / MAX_GLOBAL_BATCH:,.0f}x the planner's limit of {MAX_GLOBAL_BATCH:,} "
            f"samples per optimizer step; plan a global batch of at most {MAX_GLOBAL_BATCH:,} and accumulate "
            f"the rest with Trainer(accumulate_grad_batches=k) (e.g. plan {-(-B // -(-B // MAX_GLOBAL_BATCH)):,} with "
            f"k = {-(-B // MAX_GLOBAL_BATCH):,})")
    if W > MAX_RANKS:
        raise PlanningError(
            f"the cluster has {W:,} ranks, {W - MAX_RANKS:,} more than the planner's limit of {MAX_RANKS:,} (a plan "
            f"file lists every rank); plan a sub-cluster with the same kinds in proportion (e.g. every count and "
            f"the global batch divided by {-(-W // MAX_RANKS)}): ranks of one kind get the same assignment")
    if mode == Schedule.UNIFORM and B < W:
        raise PlanningError(
            f"uniform mode gives every rank at least one sample, but the global batch {B} is smaller than "
            f"the {W} ranks; raise --global-batch-size to at least {W} or use --mode layered")
    return B


def check_memory(problem: Problem) -> None:
    """Raise with what is short, by how much, when no step time can fit the memory."""
    cluster, s = problem.cluster, problem.cluster.settings
    kinds = problem.kinds
    counts = problem.counts
    state = kinds[0].cost.share_gb
    first = {k: int(np.nonzero(problem.of_rank == k)[0][0]) for k in range(len(kinds))}
    where = (f"after compute memory and the {s.reserved_memory_gb:g} GiB reserve per GPU "
             f"(usable_memory_fraction {s.usable_memory_fraction:g})")
    for k, m in enumerate(kinds):
        if m.m_cap < 0 or m.room[0] < 0:
            need = float(m.cost.compute_memory(0)) + s.reserved_memory_gb
            raise PlanningError(
                f"rank {first[k]} ({m.device.name}) cannot run at all: it needs {memory_text(need)} (compute memory "
                f"of an empty batch plus the reserve) but has {memory_text(s.usable_memory_fraction * m.device.memory_gb)}"
                f" usable; remove it, lower reserved_memory_gb or raise usable_memory_fraction")
    room0 = np.array([m.room[0] * state for m in kinds])
    room1 = np.array([float(m.room_for(np.array([1]), 1, b=1)[0]) * state if m.m_cap >= 1 else -math.inf
                      for m in kinds])
    total0 = float((room0 * counts).sum())
    if state > total0 * (1 + 1e-12):
        raise PlanningError(
            f"the training state and its reduction need {memory_text(state)} ({cluster.model.share_terms}) but the {problem.W} GPUs have "
            f"only {memory_text(total0)} free {where}: short by {memory_text(state - total0)}; add GPUs or memory, or "
            "shrink the model")
    if problem.mode == Schedule.UNIFORM:
        small = [k for k, m in enumerate(kinds) if m.m_cap < 1 or room1[k] < 0]
        if small:
            k = small[0]
            need = float(kinds[k].cost.memory_gb(1, 0.0, s.reserved_memory_gb))
            raise PlanningError(
                f"rank {first[k]} ({kinds[k].device.name}) is too small for one sample even with no state: needs "
                f"{memory_text(need)}, has {memory_text(s.usable_memory_fraction * kinds[k].device.memory_gb)} usable; "
                f"uniform mode gives every rank samples, so use --mode layered (it can hold state only) or remove it")
        total = float((room1 * counts).sum())
        if state > total * (1 + 1e-12):
            raise PlanningError(
                f"with one sample on every rank (uniform mode) the state ({memory_text(state)}) exceeds the "
                f"{memory_text(total)} free {where}: short by {memory_text(state - total)}; use --mode layered or add memory")
        return
    if all(m.m_cap < 1 for m in kinds):
        k = int(np.argmax(room0))
        need = float(kinds[k].cost.compute_memory(1)) + s.reserved_memory_gb
        raise PlanningError(
            f"no GPU fits one sample even with no state: the roomiest, rank {first[k]} ({kinds[k].device.name}), "
            f"needs {memory_text(need)} for one sample and has {memory_text(s.usable_memory_fraction * kinds[k].device.memory_gb)}"
            f" usable; shorten the sequence, shrink the model or add a larger GPU")
    best = total0 + max(float(room1[k] - room0[k]) for k in range(len(kinds)))
    if state > best * (1 + 1e-12):
        raise PlanningError(
            f"the training state ({memory_text(state)}) fits only while no GPU computes: with one sample on the "
            f"roomiest GPU the {problem.W} GPUs have {memory_text(best)} free {where}, short by {memory_text(state - best)}; "
            f"add GPUs or memory, or shrink the model")



def check_groupings(groupings: object) -> tuple[str, ...]:
    """The names of the groupings to weigh (None: all of them)."""
    if groupings is None:
        return tuple(Grouping)
    known = values_of(Grouping)
    if isinstance(groupings, str) or not all(isinstance(g, str) for g in groupings) or not groupings:  # type: ignore[union-attr]
        raise PlanningError(f"groupings must be a non-empty list of names from {known}, got {groupings!r}; "
                            f"e.g. groupings=('full', 'per-node')")
    unknown = [g for g in groupings if g not in known]  # type: ignore[union-attr]
    if unknown:
        raise PlanningError(f"unknown grouping(s) {unknown}; choose from {known}")
    return tuple(groupings)  # type: ignore[arg-type]

