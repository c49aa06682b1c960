"""The assignment planner: per-rank batch, micro-batches, state share (and recompute) minimising the step.

Exact algorithm (for the cost model of :mod:`cephalo_lightning.planner.cluster_cost`), over device *kinds*
(ranks with the same profile and memory share one option table and a count):

1. For a fixed price of the collectives, the smallest feasible step time S is found by bisection.
   At a given S every kind has a short Pareto table of options (samples b, largest micro-batch m,
   state share cap r) (:mod:`.options`), and S is feasible iff one option per device reaches B
   samples with a total share >= 1: a multiple-choice knapsack (:mod:`.knapsack`). Its linear
   relaxation over kinds bounds S from below (a proof); the exact dynamic program decides S where
   its work is affordable, else the relaxation's choice rounded to whole devices and repaired on a
   few devices per kind gives a feasible S, and the gap to the relaxation's bound is certified.
2. The chosen options are expanded to groups of ranks (ranks of one kind may end with b and b + 1),
   trimmed to exactly B samples (the slowest ranks first, to a common time level), each group takes
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from cephalo_lightning._common.units import memory_text
from cephalo_lightning._common.vocabulary import Schedule, values_of
from cephalo_lightning.planner.assemble import model_summary, rank_plans
from cephalo_lightning.planner.assignment import Assignment, assign
from cephalo_lightning.planner.baselines import per_sample_ms, upper_bound_samples_per_s
from cephalo_lightning.planner.calibration import calibrated
from cephalo_lightning.planner.cluster_cost import evaluate_arrays
from cephalo_lightning.planner.cluster_spec import Cluster
from cephalo_lightning.planner.collective_prices import communication, link_prices
from cephalo_lightning.planner.device_cost import DeviceCost, kind_costs
from cephalo_lightning.planner.errors import PlanningError
from cephalo_lightning.planner.files import shown_number
from cephalo_lightning.planner.grouped import GROUPINGS, GroupedProblem, candidate_groupings
from cephalo_lightning.planner.knapsack import (
    SHARE_TOL,
    Group,
    choose,
    dense_work,
    feasible,
    groups_of,
    relaxation,
    round_and_repair,
)
from cephalo_lightning.planner.limits import MAX_GLOBAL_BATCH, MAX_RANKS
from cephalo_lightning.planner.options import DeviceModel, Options
from cephalo_lightning.planner.plan import Plan
from cephalo_lightning.planner.why import explain

PLANNERS = ("cephalo", "even", "proportional", "poplar", "reference", "ddp-even", "hsdp-even")
BISECTION_TOL = 5e-4  # relative width of the final step-time bracket
RHO_TOL = 1e-3  # branch and bound stops when the best plan is within this of the lower bound
DENSE_WORK_LIMIT = 3e7  # element operations of one exact knapsack check
DENSE_CALL_LIMIT = 20_000  # options summed over devices (one vector operation each)
UNIFORM_COUNTS = 16  # uniform mode: counts examined per price of collectives; the rest enter the bound
RHO_NODES = 64  # branch-and-bound nodes over the largest share; open ones enter the bound
TIE_TOL = 1e-9  # groupings whose plans are this close predict the same step


@dataclass(frozen=True)
class _Solved:
    lo: float  # per-step ms proven infeasible (or a valid lower bound)
    hi: float  # per-step ms found feasible
    assignment: Assignment


class Problem:
    """One planning problem: the cluster, the batch, the mode, and the per-kind device models."""

    def __init__(self, cluster: Cluster, global_batch: int, mode: str, group_kinds: bool = True,
                 shard_groups: Sequence[int] | np.ndarray | None = None) -> None:
        # a calibration is folded in as it prices shard_groups (None: one group of all)
        self.source, self.group_kinds = cluster, group_kinds
        self._for_groups: dict[tuple[int, ...], Problem] = {}
        cluster = calibrated(cluster, np.zeros(cluster.world_size, np.int64) if shard_groups is None
                             else shard_groups)
        self.cluster = cluster
        self.B = global_batch
        self.mode = mode
        self.W = cluster.world_size
        self.L = cluster.model.num_layers
        if group_kinds:
            self.costs, self.of_rank = kind_costs(cluster, mode)
        else:  # every rank its own kind: the reference the grouping is tested against
            self.costs = [DeviceCost(d, cluster, mode) for d in cluster.devices]
            self.of_rank = np.arange(self.W)
        self.kinds = [DeviceModel(c, global_batch) for c in self.costs]
        self.counts = np.bincount(self.of_rank, minlength=len(self.kinds)).astype(np.int64)
        self.device_kind = np.repeat(np.arange(len(self.kinds)), self.counts)  # the exact program's devices
        self.comm = communication(cluster)
        # no rank beats its best rate: S >= L * B / (sum of samples per per-layer ms)
        rate = sum(c / ps for c, ps in zip(self.counts, (per_sample_ms(k) for k in self.kinds)) if ps < math.inf)
        self.compute_floor = self.L * global_batch / rate if rate > 0 else 0.0
        self.rate = rate

    def for_groups(self, labels: np.ndarray | None) -> Problem:
        """The problem with the collectives priced as under ``labels`` (every rank's group; None: one
        group of all): itself, unless the cluster's calibration measured the collectives of one of the
        two groupings and not of the other."""
        cal = self.source.calibration
        one = np.zeros(self.W, np.int64)
        if labels is None or cal is None or (cal.prices_collectives_of(labels)
                                             == cal.prices_collectives_of(one)):
            return self
        key = tuple(int(v) for v in labels)
        if key not in self._for_groups:
            self._for_groups[key] = Problem(self.source, self.B, self.mode, self.group_kinds, labels)
        return self._for_groups[key]

    # ------------------------------------------------------------------ feasibility at S

    def tables(self, S: float, ag: float, rs: float, cap: float, n_fixed: int | None
               ) -> tuple[list[Options], list[Options]]:
        pairs = [k.options(S, ag, rs, cap, n_fixed) for k in self.kinds]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def relaxed_ok(self, S: float, ag: float, rs: float, cap: float, n_fixed: int | None) -> bool:
        return relaxation(self.tables(S, ag, rs, cap, n_fixed)[1], self.counts, self.B).value >= 1.0 - SHARE_TOL

    def dense_affordable(self, S: float, ag: float, rs: float, cap: float, n_fixed: int | None) -> bool:
        inner, _ = self.tables(S, ag, rs, cap, n_fixed)
        per_device = [inner[k] for k in self.device_kind]
        calls = sum(len(inner[k]) * int(c) for k, c in enumerate(self.counts))
        return calls <= DENSE_CALL_LIMIT and dense_work(per_device, self.B) <= DENSE_WORK_LIMIT

    def check(self, S: float, ag: float, rs: float, cap: float, n_fixed: int | None, dense: bool,
              choice: bool = False) -> tuple[str, list[Group] | None]:
        """("feasible", groups) | ("infeasible", None): a proof | ("unknown", None): the repair missed.

        The exact program backtracks its choice only when asked (``choice``); the repair always has one.
        """
        inner, outer = self.tables(S, ag, rs, cap, n_fixed)
        bound = relaxation(outer, self.counts, self.B)
        if bound.value < 1.0 - SHARE_TOL:
            return "infeasible", None
        if dense:
            per_device = [inner[k] for k in self.device_kind]
            if not feasible(per_device, self.B):
                return "infeasible", None
            if not choice:
                return "feasible", None
            picks = choose(per_device, self.B)
            if picks is None:  # pragma: no cover - feasible() said yes on the same tables
                raise RuntimeError("knapsack backtrack failed at a feasible time")
            return "feasible", groups_of(picks, self.device_kind)
        relaxed = bound if all(i is o for i, o in zip(inner, outer)) else relaxation(inner, self.counts, self.B)
        groups = round_and_repair(inner, self.counts, self.B, relaxed)
        return ("feasible", groups) if groups is not None else ("unknown", None)

    def saturated(self, ag: float, rs: float, n_fixed: int | None) -> float:
        """A per-step time at which every device can take all B samples in any split and the whole state."""
        # memory-wise the best split of any b is b micro-batches of one sample, no slower than B of them
        worst = 0.0
        for kind in self.kinds:
            n = np.array([1, self.B]) if n_fixed is None else np.array([n_fixed])
            layer = float(kind.layer_ms(np.full(len(n), self.B), n, ag, rs).max())
            worst = max(worst, self.L * max(layer, kind.idle_ms(ag, rs, n_fixed or 1)) + kind.kappa)
        return worst * (1 + 1e-9)

    # ------------------------------------------------------------------ one price of collectives

    def solve_fixed(self, ag: float, rs: float, cap: float, lo_hint: float,
                    ceiling: float | None) -> _Solved | None:
        """Smallest feasible S for collectives priced (ag, rs) and shares capped at ``cap``.

        With a ``ceiling``, returns None when nothing at or below it is feasible.
        """
        counts: list[int | None] = [None] if self.mode == "layered" else list(self.usable_counts(ag, rs, cap))
        lo_all, best = math.inf, None
        for i, n_fixed in enumerate(counts):
            top = ceiling if best is None else best.hi / (1 + BISECTION_TOL)
            if n_fixed is not None and top is not None and self.count_floor(n_fixed, ag, rs) >= top:
                lo_all = min(lo_all, top)  # this and every larger count are slower than `top`
                break
            if n_fixed is not None and i >= UNIFORM_COUNTS:
                lo_all = min(lo_all, self.count_floor(n_fixed, ag, rs))  # the rest: bounded, not solved
                break
            solved = self._solve_count(ag, rs, cap, lo_hint, top, n_fixed)
            if solved is None:
                lo_all = min(lo_all, top if top is not None else math.inf)
                continue
            lo_all = min(lo_all, solved.lo)
            if best is None or solved.hi < best.hi:
                best = solved
        if best is None:
            return None
        return replace(best, lo=min(lo_all, best.lo))

    def usable_counts(self, ag: float, rs: float, cap: float) -> list[int]:
        """Uniform mode: the micro-batch counts that fit memory at all, among 1..B // W.

        From two micro-batches on (the whole gradient accumulates unsharded, whatever the count)
        fitting with no time limit is monotone in n: a plan for n gives one for any larger n (raise
        the ranks below n to n samples, taking them from the others; every micro-batch shrinks or
        stays), so the smallest fitting count >= 2 is found by bisection; one is tried on its own.
        """
        def fits(n: int) -> bool:
            S = self.saturated(ag, rs, n)
            return self.check(S, ag, rs, cap, n, self.dense_affordable(S, ag, rs, cap, n))[0] == "feasible"

        top = self.B // self.W
        counts = [1] if fits(1) else []
        if top < 2 or not fits(top):
            return counts
        lo, hi = 1, top  # lo does not fit (or is 1), hi fits
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        return counts + list(range(hi, top + 1))

    def count_floor(self, n: int, ag: float, rs: float) -> float:
        """A per-step floor for count n, non-decreasing in n: every rank runs n micro-batches of at
        least one sample, and the B samples cost at least each kind's best per-sample time plus the
        n - 1 micro-batch overheads."""
        throughput = (n - 1) * min(k.c for k in self.kinds) + (self.B / self.rate if self.rate > 0 else 0.0)
        return self.L * max(max(max(n * k.unit_ms + (n - 1) * k.c, k.idle_ms(ag, rs, n)) for k in self.kinds),
                            throughput)

    def _solve_count(self, ag: float, rs: float, cap: float, lo_hint: float, ceiling: float | None,
                     n_fixed: int | None) -> _Solved | None:
        idle = max(k.idle_ms(ag, rs, n_fixed or 1) for k in self.kinds) * self.L
        floor = self.compute_floor if n_fixed is None else self.count_floor(n_fixed, ag, rs)
        lo = max(lo_hint, floor * (1 - 1e-9), idle * (1 - 1e-9), 1e-12)
        limit = self.saturated(ag, rs, n_fixed)
        # 1. the relaxation: a proven lower bound and where the integer search starts
        if ceiling is not None:
            if ceiling <= lo or not self.relaxed_ok(ceiling, ag, rs, cap, n_fixed):
                return None
            hi = ceiling
        else:
            hi = lo * 1.25
            while not self.relaxed_ok(min(hi, limit), ag, rs, cap, n_fixed):
                if hi >= limit:
                    return None
                lo, hi = hi, hi * 2
            hi = min(hi, limit)
        while hi > lo * (1 + BISECTION_TOL / 4):
            mid = math.sqrt(lo * hi)
            lo, hi = (lo, mid) if self.relaxed_ok(mid, ag, rs, cap, n_fixed) else (mid, hi)
        proven = lo
        # 2. the integer choice, from the relaxation's threshold upwards
        dense = self.dense_affordable(hi, ag, rs, cap, n_fixed)
        top = min(limit, ceiling) if ceiling is not None else limit
        step, found = BISECTION_TOL, None
        S = hi
        while True:
            verdict, groups = self.check(S, ag, rs, cap, n_fixed, dense)
            if verdict == "feasible":
                found = (S, groups)
                break
            if verdict == "infeasible":
                proven = max(proven, S)
            lo = S
            if S >= top:
                return None
            S = min(top, hi * (1 + step))
            step *= 2
        hi, groups = found
        while hi > lo * (1 + BISECTION_TOL):
            mid = math.sqrt(lo * hi)
            verdict, g = self.check(mid, ag, rs, cap, n_fixed, dense)
            if verdict == "feasible":
                hi, groups = mid, g
            else:
                lo = mid
                if verdict == "infeasible":
                    proven = max(proven, mid)
        if groups is None:
            groups = self.check(hi, ag, rs, cap, n_fixed, dense, choice=True)[1]
            assert groups is not None
        return _Solved(proven, hi, assign(self, hi, ag, rs, cap, n_fixed, groups))

    # ------------------------------------------------------------------ collectives: rho search

    def solve(self) -> tuple[Assignment, float]:
        """The best assignment and a proven lower bound on the step time (s)."""
        ag0, rs0, slope = self.comm.allgather_ms, self.comm.reduce_scatter_ms, self.comm.uneven_slope
        to_s = 1e-3
        if ag0 + rs0 == 0 or slope == 0 or self.W == 1:
            solved = self.solve_fixed(ag0, rs0, 1.0, 0.0, None)
            if solved is None:
                raise self.no_plan()
            return solved.assignment, solved.lo * to_s

        def cap_at(u: float) -> float:  # the largest share whose collectives cost u times even ones
            return min(1.0, (1.0 + (u - 1.0) / slope) / self.W)

        u_top = 1.0 + slope * (self.W - 1)
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
            solved = self.solve_fixed(ag0 * ua, rs0 * ua, cap_at(ub), lb, ceiling)
            if solved is None:
                if ceiling is None:
                    raise self.no_plan()
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

    def no_plan(self) -> PlanningError:
        if self.mode == "uniform":
            return PlanningError(
                f"no uniform plan fits every rank's memory at global batch {self.B} on {self.W} ranks "
                f"(every rank needs at least one sample and the same micro-batch count); use --mode "
                f"layered, change the global batch, or add memory")
        return PlanningError(f"no plan fits the memory of this cluster at global batch {self.B}; "
                             f"lower the global batch or add memory")


# ---------------------------------------------------------------------- input checks


def _check_inputs(cluster: Cluster, global_batch: object, mode: str, planner: str) -> int:
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
    if mode == "uniform" and B < W:
        raise PlanningError(
            f"uniform mode gives every rank at least one sample, but the global batch {B} is smaller than "
            f"the {W} ranks; raise --global-batch-size to at least {W} or use --mode layered")
    return B


def _check_memory(problem: Problem) -> None:
    """Raise with what is short, by how much, when no step time can fit the memory."""
    cluster, s = problem.cluster, problem.cluster.settings
    kinds = problem.kinds
    counts = problem.counts
    state = kinds[0].cost.state_gb
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
            f"the training state needs {memory_text(state)} ({cluster.model.state_terms}) but the {problem.W} GPUs have "
            f"only {memory_text(total0)} free {where}: short by {memory_text(state - total0)}; add GPUs or memory, or "
            "shrink the model")
    if problem.mode == "uniform":
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


def shared_host_lower_ms(problem: Problem, cluster: Cluster) -> float:
    """A lower bound on any plan's shared-host bound (:func:`.cluster_cost.shared_host_floor_ms`; 0 without
    ``settings.host_cores``): the B samples cost at least the best real per-sample compute of any kind
    (its best per-sample time over its emulated slowdown), and the state's optimizer step at least the
    cheapest kind's real rate (the shares sum to one)."""
    cores = cluster.settings.host_cores
    if not cores:
        return 0.0
    rate = min(per_sample_ms(k) / k.cost.slowdown for k in problem.kinds)
    optimizer = min(k.kappa / k.cost.slowdown for k in problem.kinds)
    return (problem.L * problem.B * (rate if math.isfinite(rate) else 0.0) + optimizer) / cores + cluster.settings.step_overhead_ms


# ---------------------------------------------------------------------- shard groups


def _check_groupings(groupings: object) -> tuple[str, ...]:
    if groupings is None:
        return GROUPINGS
    if isinstance(groupings, str) or not all(isinstance(g, str) for g in groupings) or not groupings:  # type: ignore[union-attr]
        raise PlanningError(f"groupings must be a non-empty list of names from {GROUPINGS}, got {groupings!r}; "
                            f"e.g. groupings=('full', 'per-node')")
    unknown = [g for g in groupings if g not in GROUPINGS]  # type: ignore[union-attr]
    if unknown:
        raise PlanningError(f"unknown grouping(s) {unknown}; choose from {GROUPINGS}")
    return tuple(groupings)  # type: ignore[arg-type]


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
        if "full" in names:
            best, lower_s = problem.solve()
            chosen = name
            continue
        priced = problem.for_groups(labels)  # compute alike; collectives as a calibration measured them, if it did
        grouped = GroupedProblem(priced, labels, link_prices(priced.cluster))
        if not grouped.holds:  # some group cannot hold a replica: no plan of this grouping exists
            continue
        ag_top = max(p[-1][0] for p in grouped.priced)
        rs_top = max(p[-1][1] for p in grouped.priced)
        exposed_top = problem.L * max(p[-1][2] for p in grouped.priced)
        counts: list[int | None] = [None] if problem.mode == "layered" else list(range(1, top_count + 1))
        for i, n in enumerate(counts):
            ceiling = None if best is None else best.step_s / to_s * (1 + TIE_TOL)  # only as good a plan is of use
            floor = problem.compute_floor if n is None else problem.count_floor(n, 0.0, 0.0)
            if ceiling is not None and floor > ceiling:
                lower_s = min(lower_s, ceiling * to_s)  # this and every larger count
                break
            if n is not None and i >= UNIFORM_COUNTS:
                lower_s = min(lower_s, floor * to_s)  # the rest: bounded, not solved
                break
            found, proven = grouped.solve(max(floor * (1 - 1e-9), 1e-12),
                                          priced.saturated(ag_top, rs_top, n) + exposed_top, ceiling, n)
            lower_s = min(lower_s, proven * to_s)
            # a tie goes to groups of one rank: data parallelism issues no all-gathers, one all-reduce per
            # layer, which the cost model prices like the gathers and reduce-scatters it replaces; any
            # other grouping must be faster than the best (it issues more collectives, not fewer)
            margin = 1 + TIE_TOL if name == "per-rank" else 1 - TIE_TOL
            if found is not None and (best is None or found.step_s <= best.step_s * margin):
                best, chosen = found, name
    if best is None:
        raise problem.no_plan()
    return best, min(lower_s, best.step_s), chosen


# ---------------------------------------------------------------------- public API


def _baseline_plan(cluster: Cluster, B: int, mode: str, planner: str, upper: float) -> Plan:
    """A baseline as a plan of its own (the even one has one micro-batch count, so either mode fits)."""
    if planner not in ("even", "ddp-even", "hsdp-even") and mode == "uniform":
        raise PlanningError(f"the {planner} baseline picks each rank's micro-batch count, so it has no "
                            f"uniform form; use --mode layered or --planner even")
    from cephalo_lightning.planner.peers import compute_baselines  # peers build on this module

    result = compute_baselines(cluster, B, mode, names=(planner,), with_ranks=True)[planner]
    if not result.feasible:
        raise PlanningError(f"the {planner} baseline is infeasible: {result.reason}; plan with --planner cephalo, "
                            f"which fits uneven memory, or change what the reason names")
    return Plan(B, mode, result.ranks, result.predicted_step_s, result.predicted_samples_per_s, upper,
                model_summary(cluster), planner=planner, emulated=cluster.emulated)


SHARED_HOST_REFINE_RANKS = 64  # ranks sharing one host's cores: a handful of CPU processes, never a GPU cluster


def refine_on_shared_host(problem: Problem, cluster: Cluster, best: Assignment) -> Assignment:
    """Lower the shared-host bound the solve leaves out (:func:`.cluster_cost.shared_host_floor_ms`): move one
    sample at a time between two ranks (the same groups, shares and micro-batch counts) while the
    step, priced exactly with the bound on ``cluster``, falls and every rank still fits. Where the
    bound binds, giving samples to emulated slow ranks (whose sleeps need no core) can beat the
    solved plan. ``problem`` is the solve's (priced without the bound)."""
    mode, kinds, n = problem.mode, (problem.costs, problem.of_rank), best.micro
    least = 1 if mode == "uniform" else 0

    def price(b: np.ndarray, keep: np.ndarray, on: Cluster = cluster) -> float:
        step, _, fits = evaluate_arrays(on, b, np.where(b > 0, n, 1), best.shares, ~keep, mode, kinds, best.groups)
        return float(step.max()) if fits.all() else math.inf

    def moves(b: np.ndarray, keep: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every batch with one sample moved from a rank i to a rank j (an emptied rank keeps no graph)."""
        for i in np.nonzero(b > least)[0]:
            if b[i] - 1 < n[i] and not (mode == "layered" and b[i] == 1):  # its micro-batches would run empty
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


def _without_fixed_terms(cluster: Cluster) -> Cluster:
    """The cluster without a fixed per-step overhead, a host's contention factor, a shared host's
    cores (its own or its calibration's) or passes synced across a group, which the solve leaves out
    (see :func:`plan`)."""
    cal = cluster.calibration
    return replace(cluster, settings=replace(cluster.settings, step_overhead_ms=0.0, host_contention=1.0, host_cores=None,
                                             sync_passes=False),
                   calibration=None if cal is None else replace(cal, step_overhead_ms=0.0, host_contention=1.0))


def plan(cluster: Cluster, global_batch_size: int, mode: str = "layered", planner: str = "cephalo",
         _group_kinds: bool = True, groupings: tuple[str, ...] | None = None) -> Plan:
    """Plan a cluster: shard groups, per-rank batch, micro-batches and state share minimising the step time.

    ``groupings`` names the candidate groupings to weigh (:data:`.grouped.GROUPINGS`; None: all of
    them; ``("full",)``: one group of every rank). ``planner`` names a baseline (``even``,
    ``proportional``, ``poplar``, ``reference``, ``ddp-even``, ``hsdp-even``) to return that baseline
    as a plan instead. The cephalo plan carries every baseline's figures, the upper bound and its
    certified optimality gap (against the best plan over the groupings weighed).
    """
    from cephalo_lightning.planner.peers import compute_baselines  # peers build on this module

    B = _check_inputs(cluster, global_batch_size, mode, planner)
    names = _check_groupings(groupings)
    # ``source`` keeps any calibration: each plan is priced as the calibration prices its grouping
    source, cluster = cluster, calibrated(cluster)
    upper = upper_bound_samples_per_s(cluster, B, mode)
    if planner != "cephalo":
        return _baseline_plan(source, B, mode, planner, upper)
    # a fixed per-step overhead and a host's contention factor shift and scale every plan alike:
    # solve without them, then apply both to the plan's step and the proven lower bound (the
    # certified gap only shrinks); the shared-host bound, too, is left out of the solve and enters
    # the plan's price and the lower bound (shared_host_lower_ms); so are passes synced across a group
    # (settings.sync_passes), which only raise a plan's price: the solve's bound stays a bound
    fixed_s, contention = cluster.settings.step_overhead_ms / 1e3, cluster.settings.host_contention
    problem = Problem(_without_fixed_terms(source), B, mode, group_kinds=_group_kinds)
    _check_memory(problem)
    best, lower_s, _ = solve_groupings(problem, names)
    chosen = problem.for_groups(best.groups)  # the chosen grouping's prices (a refinement keeps the groups)
    if cluster.settings.host_cores and problem.W <= SHARED_HOST_REFINE_RANKS:
        best = refine_on_shared_host(chosen, source, best)
    lower_s = max(contention * lower_s + fixed_s, shared_host_lower_ms(problem, cluster) / 1e3)
    ranks, step = rank_plans(source, best.batch, best.micro, best.shares, ~best.keep, mode,
                             kinds=(chosen.costs, chosen.of_rank), shard_groups=best.groups)
    ranks = explain(source, ranks, mode)  # a baseline's batches follow its rule, not a binding: only the plan's
    return Plan(
        global_batch_size=B,
        mode=mode,
        ranks=ranks,
        predicted_step_s=step,
        predicted_samples_per_s=B / step,
        upper_bound_samples_per_s=upper,
        model=model_summary(cluster),
        baselines=compute_baselines(source, B, mode, problem=problem if mode == "layered" and _group_kinds else None),
        planner="cephalo",
        emulated=cluster.emulated,
        optimality_gap=max(0.0, step / lower_s - 1.0) if lower_s > 0 else None,
    )
