"""Identical ranks get identical work: the symmetric form of a solved assignment.

Ranks are *interchangeable* when the cost model cannot tell them apart: the same device kind
(:func:`.device_cost.kind_costs`: one profile, whatever the node) in shard groups of one type
(:func:`.grouped.group_types`: the same kinds and counts, the same link class), so that swapping
two of them changes no rank's price. The solve can still give them different work: its knapsack
picks an option per device, so two ranks of a kind may take b and b + 2 samples, shares of 3% and
32%, or micro-batches sized for a share they do not hold. A class of c interchangeable ranks
holding T samples and shares summing to R in the solved assignment gets::

    b = q + 1 on its T - c q lowest ranks (rank order), q on the others     (q = T // c)
    r = R / c on every one
    (n, keep) = the fewest micro-batches (at one, keeping the graph first) whose largest
                micro-batch fits memory beside r and whose step is within S', the largest over the
                ranks of their fastest step at these batches and shares (else the fastest); the same
                on every rank of the class (min(n, q) on a rank of q samples: none runs empty)

Every group still holds one replica (a group of a type holds the same number of ranks of each of
its classes, so its shares sum to sum_classes R / copies = 1), and no group's largest share exceeds
the largest before it (a mean is at most a maximum), so no collective is dearer than the dearest
before. Where the link binds, more micro-batches buy nothing and each costs its overhead: the
fewest that fit are taken (the solve's grouped path sizes micro-batches for the most share room its
option table lists, not for the share a rank ends up holding).

[Note: symmetry never slows a plan] Each candidate is priced by the cost model as the plan is
(:func:`.cost.cluster_cost.evaluate_arrays` on the cluster with its fixed terms) and taken only when
every rank fits and the step is no longer than the solved one's. In order: every class evened at
once; else each class alone, round after round while one is taken (a class evened changes the
collective prices the others see); then the shares averaged over the ranks of a class in one group
that run the same work, which cannot raise the step (their optimizer time and memory are linear in
the share, so their largest falls to the mean, and the group's largest share does not grow), with
every rank's micro-batches chosen anew as above. A class no candidate evens keeps its solved work:
the cost model prices it lower uneven, which happens where memory binds (one rank holding most of
the state in small micro-batches beside one holding little in large ones beats two holding half,
as each micro-batch costs its overhead). The certified gap is against a lower bound the pass does
not touch, so it still holds.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from cephalo_lightning._common.vocabulary import Schedule
from cephalo_lightning.planner.cost.cluster_cost import collective_ms, evaluate_arrays
from cephalo_lightning.planner.cost.device_cost import step_ms
from cephalo_lightning.planner.cost.prices import Prices
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.search.assignment import Assignment
from cephalo_lightning.planner.search.grouped import group_types
from cephalo_lightning.planner.search.problem import Problem

NOT_SLOWER = 1e-12  # relative: a step this close to the solved one is not longer (float sums)


def interchangeable(problem: Problem, groups: np.ndarray | None) -> list[np.ndarray]:
    """Every class of interchangeable ranks of two or more (see the module), each in rank order."""
    labels = np.zeros(problem.W, np.int64) if groups is None else np.asarray(groups, dtype=np.int64)
    nodes = np.asarray(problem.cluster.nodes, dtype=np.int64)
    classes = [np.sort(ranks.ravel()) for t in group_types(labels, problem.of_rank, nodes, len(problem.kinds))
               for ranks in t.ranks]
    return [c for c in classes if len(c) > 1]


def symmetrised(problem: Problem, source: Cluster, best: Assignment) -> Assignment:
    """``best`` with identical work on interchangeable ranks where that is not slower (see the module),
    priced on ``source`` (the cluster the plan is priced on: its fixed terms, synced passes and shared
    host included); ``problem`` is the solve's for ``best``'s groups."""
    classes = interchangeable(problem, best.groups)
    limit = _price(problem, source, best) * (1 + NOT_SLOWER)

    def taken(candidate: Assignment | None) -> bool:
        return candidate is not None and _price(problem, source, candidate) <= limit

    every = next((c for c in _evened(problem, best, classes, _sets(problem.W, classes)) if taken(c)), None)
    if every is not None:
        return _priced(problem, every)
    current = best
    for _ in range(len(classes)):  # a class evened changes the prices the others see: again until none is
        evened = False
        for ranks in classes:
            candidate = next((c for c in _evened(problem, current, [ranks], [ranks]) if taken(c)), None)
            if candidate is not None and not _same(candidate, current):
                current, evened = _priced(problem, candidate), True
        if not evened:
            break
    sets = _same_work(current, classes)
    shares = _same_work_shares(current, sets)
    for fewest in (True, False):
        counts = _counts(problem, current, _sets(problem.W, sets), current.batch, shares, fewest)
        candidate = None if counts is None else replace(current, micro=counts[0], shares=shares, keep=counts[1])
        if taken(candidate):
            return _priced(problem, candidate)
    return current


def _evened(problem: Problem, a: Assignment, classes: list[np.ndarray], sets: list[np.ndarray]) -> list[Assignment]:
    """``a`` with ``classes`` given even work (their samples split as evenly as whole samples allow, the
    remainder on their lowest ranks, one each; their shares averaged) and the ranks of ``sets`` their
    micro-batch counts anew: the fewest within S', then the fastest (none where a set fits at no count)."""
    batch, shares = a.batch.copy(), a.shares.copy()
    for ranks in classes:
        q, extra = divmod(int(batch[ranks].sum()), len(ranks))
        batch[ranks] = q
        batch[ranks[:extra]] += 1
        shares[ranks] = shares[ranks].mean()
    return [replace(a, batch=batch, micro=counts[0], shares=shares, keep=counts[1]) for fewest in (True, False)
            if (counts := _counts(problem, a, sets, batch, shares, fewest)) is not None]


def _same(a: Assignment, b: Assignment) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("batch", "micro", "shares", "keep"))


def _same_work(best: Assignment, classes: list[np.ndarray]) -> list[np.ndarray]:
    """The ranks of a class in one group with the same batch, micro-batch count and recompute choice."""
    groups = np.zeros(len(best.batch), np.int64) if best.groups is None else np.asarray(best.groups)
    out = []
    for ranks in classes:
        work = np.column_stack([groups[ranks], best.batch[ranks], best.micro[ranks], best.keep[ranks]])
        same = np.unique(work, axis=0, return_inverse=True)[1].ravel()
        out.extend(ranks[same == s] for s in np.unique(same))
    return out


def _same_work_shares(best: Assignment, sets: list[np.ndarray]) -> np.ndarray:
    """The shares averaged over every set of :func:`_same_work`."""
    shares = best.shares.copy()
    for at in sets:
        shares[at] = shares[at].mean()
    return shares


def _sets(world: int, sets: list[np.ndarray]) -> list[np.ndarray]:
    """``sets`` and every rank in none of them on its own: the ranks that take one micro-batch count."""
    alone = np.ones(world, bool)
    for at in sets:
        alone[at] = False
    return [*sets, *(np.array([r]) for r in np.nonzero(alone)[0])]


def _counts(problem: Problem, a: Assignment, sets: list[np.ndarray], batch: np.ndarray,
            shares: np.ndarray, fewest: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """Every rank's micro-batch count and keep choice for these batches and shares: ``a``'s outside
    ``sets``, one choice per set (its ranks share a kind, a share and batches within one of each
    other): the fewest that fit within S' (``fewest``; S' the largest of the sets' fastest steps and
    the other ranks' steps) or the fastest. None where a set fits at no count."""
    prices, exposed = collective_ms(problem.cluster, shares, a.groups)
    n_fixed = int(a.micro.max()) if problem.mode == Schedule.UNIFORM else None
    options = []
    for ranks in sets:
        found = _ways(problem, ranks, batch, float(shares[ranks].max()), prices.at(int(ranks[0])),
                      float(exposed[ranks[0]]), n_fixed)
        if found is None:
            return None
        options.append(found)
    level = max(float(t.min()) for _, _, t in options)
    others = np.ones(problem.W, bool)
    for ranks in sets:
        others[ranks] = False
    if others.any():
        step, _, _ = evaluate_arrays(problem.cluster, batch, np.where(batch > 0, a.micro, 1), shares,
                                     ~a.keep | (batch == 0), problem.mode, kinds=(problem.costs, problem.of_rank),
                                     shard_groups=a.groups)
        level = max(level, float(step[others].max()) * 1e3)
    micro, keep = a.micro.copy(), a.keep.copy()
    for ranks, (n, kept, times) in zip(sets, options):
        pick = int(np.nonzero(times <= level * (1 + NOT_SLOWER))[0][0]) if fewest else int(np.argmin(times))
        micro[ranks] = np.maximum(np.minimum(n[pick], batch[ranks]), 1)
        keep[ranks] = kept[pick] & (batch[ranks] > 0)
    return micro, keep


def _ways(problem: Problem, ranks: np.ndarray, batch: np.ndarray, share: float, prices: Prices, exposed: float,
          n_fixed: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(n, keep, step ms of the class's busiest rank) of every way its ranks fit memory beside
    ``share``, fewest micro-batches first (at one, keeping the graph first); None where none fits."""
    model = problem.kinds[int(problem.of_rank[ranks[0]])]
    top, low = int(batch[ranks].max()), int(batch[ranks].min())
    n = np.array([n_fixed], np.int64) if n_fixed is not None else np.arange(1, max(top, 1) + 1, dtype=np.int64)
    keep = np.zeros(len(n), bool)
    if n_fixed is None and model.cost.can_keep and 0 < top <= model.keep_cap:
        n, keep = np.concatenate(([1], n)), np.concatenate(([True], keep))
    ok = np.ones(len(n), bool)
    for b in {top, low}:
        runs = np.minimum(n, max(b, 1))  # a rank of q samples runs min(n, q) micro-batches
        m = -(-b // runs)
        inside = m <= model.m_cap
        room = np.full(len(n), -np.inf)
        room[inside] = model.room_for(m[inside], runs[inside], keep[inside] & (b > 0), b)
        ok &= room >= share - 1e-12
    if not ok.any():
        return None
    n, keep = n[ok], keep[ok]
    layer = model.layer_ms(np.full(len(n), top), n, prices, keep) + exposed
    times = step_ms(model.cost.settings, problem.L * layer + float(model.cost.optimizer_ms(share)))
    return n, keep, np.asarray(times, dtype=float)


def _price(problem: Problem, cluster: Cluster, a: Assignment) -> float:
    """The step (s) ``a`` is priced at on ``cluster``, as the plan prices it; inf where a rank does not fit."""
    b = np.asarray(a.batch, dtype=np.int64)
    step, _, fits = evaluate_arrays(cluster, b, np.where(b > 0, a.micro, 1), a.shares, ~a.keep | (b == 0),
                                    problem.mode, kinds=(problem.costs, problem.of_rank), shard_groups=a.groups)
    return float(step.max()) if fits.all() else math.inf


def _priced(problem: Problem, a: Assignment) -> Assignment:
    """``a`` with its step as the solve prices it (Assignment.step_s)."""
    return replace(a, step_s=_price(problem, problem.cluster, a))
