"""The best plan over the candidate shard groupings: min over the groupings g of the best step
of g, with the least proven lower bound over them.

One group of every rank is solved by :func:`.solver.solve`, any other grouping by
:class:`.grouped.GroupedProblem` (uniform mode: per micro-batch count, pruned by the count's
floor). A grouping is solved only below the best step found so far, and a tie goes to groups of
one rank (data parallelism issues fewer collectives, at the same predicted price).
"""

from __future__ import annotations

import math

from cephalo_lightning._common.vocabulary import Grouping, Schedule
from cephalo_lightning.planner.cost.collective_prices import link_prices
from cephalo_lightning.planner.cost.prices import FREE, Prices
from cephalo_lightning.planner.schema.planning_error import PlanningError
from cephalo_lightning.planner.search.assignment import Assignment
from cephalo_lightning.planner.search.grouped import GroupedProblem, candidate_groupings
from cephalo_lightning.planner.search.problem import Problem
from cephalo_lightning.planner.search.solver import UNIFORM_COUNTS, solve

TIE_TOL = 1e-9  # groupings whose plans are this close predict the same step


def solve_groupings(problem: Problem, groupings: tuple[str, ...]) -> tuple[Assignment, float, str]:
    """The best assignment over the candidate groupings named, the least proven lower bound over
    them (s) and the name of the grouping chosen (see :mod:`.grouped`)."""
    to_s = 1e-3
    best: Assignment | None = None
    lower_s, chosen = math.inf, ""
    candidates = [(names, labels) for names, labels in candidate_groupings(problem.cluster.nodes)
                  if set(names) & set(groupings)]
    if not candidates:
        raise PlanningError(f"none of the groupings {list(groupings)} applies to this cluster (node-halves and "
                            f"node-pairs need a node of 4, 6, 8, ... ranks); add 'full', 'per-node' or 'per-rank'")
    top_count = problem.B // problem.W
    for names, labels in candidates:
        name = next(n for n in names if n in groupings)
        if Grouping.FULL in names:
            best, lower_s = solve(problem)
            chosen = name
            continue
        priced = problem.for_groups(labels)  # compute alike; collectives as a calibration measured them, if it did
        grouped = GroupedProblem(priced, labels, link_prices(priced.cluster))
        if not grouped.holds:  # some group cannot hold a replica: no plan of this grouping exists
            continue
        top_prices = Prices(max(p[-1][0].ag for p in grouped.priced), max(p[-1][0].rs for p in grouped.priced))
        exposed_top = problem.L * max(p[-1][1] for p in grouped.priced)
        counts: list[int | None] = [None] if problem.mode == Schedule.LAYERED else list(range(1, top_count + 1))
        for i, n in enumerate(counts):
            ceiling = None if best is None else best.step_s / to_s * (1 + TIE_TOL)  # only as good a plan is of use
            floor = problem.compute_floor if n is None else problem.count_floor(n, FREE)
            if ceiling is not None and floor > ceiling:
                lower_s = min(lower_s, ceiling * to_s)  # this and every larger count
                break
            if n is not None and i >= UNIFORM_COUNTS:
                lower_s = min(lower_s, floor * to_s)  # the rest: bounded, not solved
                break
            found, proven = grouped.solve(max(floor * (1 - 1e-9), 1e-12),
                                          priced.saturated(top_prices, n) + exposed_top, ceiling, n)
            lower_s = min(lower_s, proven * to_s)
            # a tie goes to groups of one rank: data parallelism issues no all-gathers, one all-reduce per
            # layer, which the cost model prices like the gathers and reduce-scatters it replaces; any
            # other grouping must be faster than the best (it issues more collectives, not fewer)
            margin = 1 + TIE_TOL if name == Grouping.PER_RANK else 1 - TIE_TOL
            if found is not None and (best is None or found.step_s <= best.step_s * margin):
                best, chosen = found, name
    if best is None:
        raise problem.no_plan()
    return best, min(lower_s, best.step_s), chosen
