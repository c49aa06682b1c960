"""Ranks sharing one host's cores (``settings.host_cores``): the shared-host bound of a plan
(:func:`.cost.shared_host_floor_ms`), a lower bound on it for any plan, and the refinement of a
solved plan under it.

The solve leaves the bound out; the refinement moves one sample at a time between two ranks while
the step priced with the bound falls, and the plan's certified gap is against
max(the solve's bound, :func:`shared_host_lower_ms`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

import numpy as np

from cephalo_lightning._common.vocabulary import Schedule
from cephalo_lightning.planner.cost.cluster_cost import evaluate_arrays
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.search.assignment import Assignment
from cephalo_lightning.planner.search.baselines import per_sample_ms
from cephalo_lightning.planner.search.problem import Problem

SHARED_HOST_REFINE_RANKS = 64  # ranks sharing one host's cores: a handful of CPU processes, never a GPU cluster


def shared_host_lower_ms(problem: Problem, cluster: Cluster) -> float:
    """A lower bound on any plan's shared-host bound (:func:`.cost.shared_host_floor_ms`; 0 without
    ``settings.host_cores``): the B samples cost at least the best real per-sample compute of any kind
    (its best per-sample time over its emulated slowdown), and the state's optimizer step at least the
    cheapest kind's real rate (the shares sum to one)."""
    cores = cluster.settings.host_cores
    if not cores:
        return 0.0
    rate = min(per_sample_ms(k) / k.cost.slowdown for k in problem.kinds)
    optimizer = min(k.kappa / k.cost.slowdown for k in problem.kinds)
    return (problem.L * problem.B * (rate if math.isfinite(rate) else 0.0) + optimizer) / cores + cluster.settings.step_overhead_ms


def refine_on_shared_host(problem: Problem, cluster: Cluster, best: Assignment) -> Assignment:
    """Lower the shared-host bound the solve leaves out (:func:`.cost.shared_host_floor_ms`): move one
    sample at a time between two ranks (the same groups, shares and micro-batch counts) while the
    step, priced exactly with the bound on ``cluster``, falls and every rank still fits. Where the
    bound binds, giving samples to emulated slow ranks (whose sleeps need no core) can beat the
    solved plan. ``problem`` is the solve's (priced without the bound)."""
    mode, kinds, n = problem.mode, (problem.costs, problem.of_rank), best.micro
    least = 1 if mode == Schedule.UNIFORM else 0

    def price(b: np.ndarray, keep: np.ndarray, on: Cluster = cluster) -> float:
        step, _, fits = evaluate_arrays(on, b, np.where(b > 0, n, 1), best.shares, ~keep, mode, kinds, best.groups)
        return float(step.max()) if fits.all() else math.inf

    def moves(b: np.ndarray, keep: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every batch with one sample moved from a rank i to a rank j (an emptied rank keeps no graph)."""
        for i in np.nonzero(b > least)[0]:
            if b[i] - 1 < n[i] and not (mode == Schedule.LAYERED and b[i] == 1):  # its micro-batches would run empty
                continue
            for j in range(len(b)):
                if j != i:
                    moved = b.copy()
                    moved[i] -= 1
                    moved[j] += 1
                    yield moved, keep & (moved > 0)

    b, keep = best.batch, best.keep & (best.batch > 0)
    start = current = price(b, keep)
    if not math.isfinite(current):
        return best
    for _ in range(int(b.sum()) * len(b)):  # every accepted move lowers the step: this many is a bound
        priced = [(price(m, k), m, k) for m, k in moves(b, keep)]
        if not priced:
            break
        step, m, k = min(priced, key=lambda t: t[0])
        if step >= current * (1 - 1e-9):
            break
        current, b, keep = step, m, k
    if current >= start:
        return best
    return replace(best, batch=b, micro=np.where(b > 0, n, 1), keep=keep, step_s=price(b, keep, problem.cluster))
