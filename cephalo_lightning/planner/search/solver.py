"""The search for one group of every rank: per-rank batch, micro-batches, state share (and recompute)
minimising the step.

Exact algorithm (for the cost model of :mod:`cephalo_lightning.planner.cost.cluster_cost`), over device *kinds*
(ranks with the same profile and memory share one option table and a count):

1. For a fixed price of the collectives, the smallest feasible step time S is found by bisection.
   At a given S every kind has a short Pareto table of options (samples b, largest micro-batch m,
   state share cap r) (:mod:`.options`), and S is feasible iff one option per device reaches B
   samples with a total share >= 1: a multiple-choice knapsack (:mod:`.problem`). Its linear
   relaxation over kinds bounds S from below (a proof); the exact dynamic program decides S where
   its work is affordable, else the relaxation's choice rounded to whole devices and repaired on a
   few devices per kind gives a feasible S, and the gap to the relaxation's bound is certified.
2. The chosen options are expanded to groups of ranks (:mod:`.assignment`; ranks of one kind may end
   with b and b + 1), trimmed to exactly B samples (the slowest ranks first, to a common time level), each group takes
   its fastest micro-batch count, and the shares are water-filled under the memory caps (and the
   time left for the optimizer step) - the smallest largest share, hence the cheapest collectives.
   One-micro-batch ranks keep their autograd graph instead of recomputing where memory allows.
3. Collectives cost more as the largest share rho grows. Branch and bound over rho: an interval
   [rho_a, rho_b] is bounded below by solving with collectives priced at rho_a and shares capped
   at rho_b, and every solve yields a plan priced exactly. Intervals that cannot beat the best plan
   by the tolerance are pruned, so the result comes with a certified optimality gap.

``mode="uniform"`` fixes one micro-batch count for all ranks and gives every rank samples; the
solver loops over that count, pruning counts that cannot beat the best found.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace

from cephalo_lightning._common.vocabulary import Schedule, Verdict
from cephalo_lightning.planner.cost.prices import Prices
from cephalo_lightning.planner.search.assignment import Assignment, assign
from cephalo_lightning.planner.search.problem import BISECTION_TOL, Problem

RHO_TOL = 1e-3  # branch and bound stops when the best plan is within this of the lower bound
UNIFORM_COUNTS = 16  # uniform mode: counts examined per price of collectives; the rest enter the bound
RHO_NODES = 64  # branch-and-bound nodes over the largest share; open ones enter the bound


@dataclass(frozen=True)
class _Solved:
    lo: float  # per-step ms proven infeasible (or a valid lower bound)
    hi: float  # per-step ms found feasible
    assignment: Assignment


def solve_fixed(problem: Problem, prices: Prices, cap: float, lo_hint: float,
                ceiling: float | None) -> _Solved | None:
    """Smallest feasible S for collectives priced at ``prices`` and shares capped at ``cap``.

    With a ``ceiling``, returns None when nothing at or below it is feasible.
    """
    counts: list[int | None] = [None] if problem.mode == Schedule.LAYERED else list(usable_counts(problem, prices, cap))
    lo_all, best = math.inf, None
    for i, n_fixed in enumerate(counts):
        top = ceiling if best is None else best.hi / (1 + BISECTION_TOL)
        if n_fixed is not None and top is not None and problem.count_floor(n_fixed, prices) >= top:
            lo_all = min(lo_all, top)  # this and every larger count are slower than `top`
            break
        if n_fixed is not None and i >= UNIFORM_COUNTS:
            lo_all = min(lo_all, problem.count_floor(n_fixed, prices))  # the rest: bounded, not solved
            break
        solved = _solve_count(problem, prices, cap, lo_hint, top, n_fixed)
        if solved is None:
            lo_all = min(lo_all, top if top is not None else math.inf)
            continue
        lo_all = min(lo_all, solved.lo)
        if best is None or solved.hi < best.hi:
            best = solved
    if best is None:
        return None
    return replace(best, lo=min(lo_all, best.lo))


def usable_counts(problem: Problem, prices: Prices, cap: float) -> list[int]:
    """Uniform mode: the micro-batch counts that fit memory at all, among 1..B // W.

    From two micro-batches on (the whole gradient accumulates unsharded, whatever the count)
    fitting with no time limit is monotone in n: a plan for n gives one for any larger n (raise
    the ranks below n to n samples, taking them from the others; every micro-batch shrinks or
    stays), so the smallest fitting count >= 2 is found by bisection; one is tried on its own.
    """
    def fits(n: int) -> bool:
        S = problem.saturated(prices, n)
        return problem.check(S, prices, cap, n, problem.dense_affordable(S, prices, cap, n))[0] == Verdict.FEASIBLE

    top = problem.B // problem.W
    counts = [1] if fits(1) else []
    if top < 2 or not fits(top):
        return counts
    lo, hi = 1, top  # lo does not fit (or is 1), hi fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return counts + list(range(hi, top + 1))


def _solve_count(problem: Problem, prices: Prices, cap: float, lo_hint: float, ceiling: float | None,
                 n_fixed: int | None) -> _Solved | None:
    idle = max(k.idle_ms(prices, n_fixed or 1) for k in problem.kinds) * problem.L
    floor = problem.compute_floor if n_fixed is None else problem.count_floor(n_fixed, prices)
    lo = max(lo_hint, floor * (1 - 1e-9), idle * (1 - 1e-9), 1e-12)
    limit = problem.saturated(prices, n_fixed)
    # 1. the relaxation: a proven lower bound and where the integer search starts
    if ceiling is not None:
        if ceiling <= lo or not problem.relaxed_ok(ceiling, prices, cap, n_fixed):
            return None
        hi = ceiling
    else:
        hi = lo * 1.25
        while not problem.relaxed_ok(min(hi, limit), prices, cap, n_fixed):
            if hi >= limit:
                return None
            lo, hi = hi, hi * 2
        hi = min(hi, limit)
    while hi > lo * (1 + BISECTION_TOL / 4):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if problem.relaxed_ok(mid, prices, cap, n_fixed) else (mid, hi)
    proven = lo
    # 2. the integer choice, from the relaxation's threshold upwards
    dense = problem.dense_affordable(hi, prices, cap, n_fixed)
    top = min(limit, ceiling) if ceiling is not None else limit
    step, found = BISECTION_TOL, None
    S = hi
    while True:
        verdict, groups = problem.check(S, prices, cap, n_fixed, dense)
        if verdict == Verdict.FEASIBLE:
            found = (S, groups)
            break
        if verdict == Verdict.INFEASIBLE:
            proven = max(proven, S)
        lo = S
        if S >= top:
            return None
        S = min(top, hi * (1 + step))
        step *= 2
    hi, groups = found
    while hi > lo * (1 + BISECTION_TOL):
        mid = math.sqrt(lo * hi)
        verdict, g = problem.check(mid, prices, cap, n_fixed, dense)
        if verdict == Verdict.FEASIBLE:
            hi, groups = mid, g
        else:
            lo = mid
            if verdict == Verdict.INFEASIBLE:
                proven = max(proven, mid)
    if groups is None:
        groups = problem.check(hi, prices, cap, n_fixed, dense, choice=True)[1]
        assert groups is not None
    return _Solved(proven, hi, assign(problem, hi, prices, cap, n_fixed, groups))


# ---------------------------------------------------------------------- collectives: rho search


def solve(problem: Problem) -> tuple[Assignment, float]:
    """The best assignment and a proven lower bound on the step time (s)."""
    even = Prices(problem.comm.allgather_ms, problem.comm.reduce_scatter_ms)  # every share 1 / W
    slope = problem.comm.uneven_slope
    to_s = 1e-3
    if even.ag + even.rs == 0 or slope == 0 or problem.W == 1:
        solved = solve_fixed(problem, even, 1.0, 0.0, None)
        if solved is None:
            raise problem.no_plan()
        return solved.assignment, solved.lo * to_s

    def cap_at(u: float) -> float:  # the largest share whose collectives cost u times even ones
        return min(1.0, (1.0 + (u - 1.0) / slope) / problem.W)

    u_top = 1.0 + slope * (problem.W - 1)
    heap: list[tuple[float, float, float]] = [(0.0, 1.0, u_top)]
    best: Assignment | None = None
    closed = math.inf
    nodes = 0
    while heap and nodes < RHO_NODES:
        nodes += 1
        lb, ua, ub = heapq.heappop(heap)
        if best is not None and lb * to_s * (1 + RHO_TOL) >= best.step_s:
            closed = min(closed, lb)
            break
        ceiling = None if best is None else best.step_s / to_s / (1 + RHO_TOL)
        solved = solve_fixed(problem, even.scaled(ua), cap_at(ub), lb, ceiling)
        if solved is None:
            if ceiling is None:
                raise problem.no_plan()
            closed = min(closed, ceiling)
            continue
        if best is None or solved.assignment.step_s < best.step_s:
            best = solved.assignment
        if ub <= ua * (1 + RHO_TOL / 2) or solved.lo * to_s * (1 + RHO_TOL) >= best.step_s:
            closed = min(closed, solved.lo)
            continue
        mid = math.sqrt(ua * ub)
        heapq.heappush(heap, (solved.lo, ua, mid))
        heapq.heappush(heap, (solved.lo, mid, ub))
    assert best is not None
    lower = min([closed] + [lb for lb, _, _ in heap])
    return best, min(lower * to_s, best.step_s)

