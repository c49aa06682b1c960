"""The assignment planner: per-rank batch, micro-batches and state share minimising the step time.

Exact algorithm (for the cost model of :mod:`cephalo_lightning.planner.cost`):

1. For a fixed price of the collectives, the smallest feasible step time is found by bisection on
   the per-layer time t. At a given t every device has a short list of Pareto options (samples b,
   largest micro-batch m, state share cap r) (:mod:`.options`), and t is feasible iff one option
   per device reaches B samples with a total share >= 1: a multiple-choice knapsack solved exactly
   by a windowed dynamic program (:mod:`.knapsack`). Identical devices share option tables.
2. The chosen options are trimmed to exactly B samples (from the slowest ranks first), each rank
   takes its fastest micro-batch count, and the shares are water-filled under the memory caps
   (smallest largest share, hence the cheapest uneven collectives).
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

import numpy as np

from cephalo_lightning.planner.assemble import model_summary, rank_plans
from cephalo_lightning.planner.baselines import (
    best_rate,
    even_baseline,
    proportional_baseline,
    upper_bound_samples_per_s,
)
from cephalo_lightning.planner.cluster import Cluster
from cephalo_lightning.planner.cost import communication, evaluate, water_fill
from cephalo_lightning.planner.errors import PlanningError
from cephalo_lightning.planner.knapsack import choose, feasible
from cephalo_lightning.planner.options import DeviceModel, Options, device_kinds
from cephalo_lightning.planner.plan import PLAN_MODES, BaselineResult, Plan

STRATEGIES = ("cephalo", "even", "proportional")
BISECTION_TOL = 5e-4  # relative width of the final step-time bracket
RHO_TOL = 1e-3  # branch and bound stops when the best plan is within this of the lower bound


@dataclass(frozen=True)
class Assignment:
    batch: tuple[int, ...]
    micro: tuple[int, ...]
    shares: tuple[float, ...]
    step_s: float  # priced exactly by cost.evaluate


@dataclass(frozen=True)
class _Solved:
    lo: float  # per-layer ms proven infeasible (or a valid lower bound)
    hi: float  # per-layer ms proven feasible
    assignment: Assignment


class _Problem:
    """One planning problem: the cluster, the batch, the mode, and the per-kind device models."""

    def __init__(self, cluster: Cluster, global_batch: int, mode: str) -> None:
        self.cluster = cluster
        self.B = global_batch
        self.mode = mode
        self.W = cluster.world_size
        self.L = cluster.model.num_layers
        self.kinds, self.of_rank = device_kinds(cluster, global_batch)
        self.comm = communication(cluster)
        rate = sum(best_rate(self.kinds[k].cost, 0.0, global_batch) for k in self.of_rank)
        # no rank can beat its best rate: t >= B / (sum of rates), in per-layer ms
        self.compute_floor = global_batch / rate * 1e3 / self.L if rate > 0 else 0.0

    # ------------------------------------------------------------------ feasibility at t

    def options(self, t: float, ag: float, rs: float, cap: float, n_fixed: int | None) -> list[Options]:
        per_kind = [k.options(t, ag, rs, cap, n_fixed) for k in self.kinds]
        return [per_kind[k] for k in self.of_rank]

    def feasible(self, t: float, ag: float, rs: float, cap: float, n_fixed: int | None) -> bool:
        return feasible(self.options(t, ag, rs, cap, n_fixed), self.B)

    def saturated_t(self, ag: float, rs: float, n_fixed: int | None) -> float:
        """A per-layer time at which every device can take all B samples in any split."""
        worst = 2 * ag + rs
        for kind in self.kinds:
            n = np.arange(1, self.B + 1) if n_fixed is None else np.array([n_fixed])
            worst = max(worst, float(kind.layer_ms(np.full(len(n), self.B), n, ag, rs).max()))
        return worst * (1 + 1e-9)

    # ------------------------------------------------------------------ one price of collectives

    def solve_fixed(self, ag: float, rs: float, cap: float, lo_hint: float,
                    ceiling: float | None) -> _Solved | None:
        """Smallest feasible t for collectives priced (ag, rs) and shares capped at ``cap``.

        With a ``ceiling``, returns None when nothing at or below it is feasible.
        """
        counts: list[int | None] = [None] if self.mode == "layered" else list(self.usable_counts(ag, rs, cap))
        lo_all, best = math.inf, None
        for n_fixed in counts:
            top = ceiling if best is None else best.hi / (1 + BISECTION_TOL)
            if n_fixed is not None and top is not None and self.count_floor(n_fixed) >= top:
                lo_all = min(lo_all, top)  # this and every larger count are slower than `top`
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

    def usable_counts(self, ag: float, rs: float, cap: float) -> range:
        """Uniform mode: the micro-batch counts that fit memory at all, n_min..B // W.

        Fitting with no time limit is monotone in n: a plan for n gives one for any larger n (raise
        the ranks below n to n samples, taking them from the others; every micro-batch shrinks or
        stays), so the smallest fitting count is found by bisection.
        """
        def fits(n: int) -> bool:
            return self.feasible(self.saturated_t(ag, rs, n), ag, rs, cap, n)

        top = self.B // self.W
        if not fits(top):
            return range(0)
        lo, hi = 0, top  # lo does not fit (0: no count), hi fits
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        return range(hi, top + 1)

    def count_floor(self, n: int) -> float:
        """Every rank runs n micro-batches of at least one sample: a per-layer time floor for count n."""
        return max(n * k.g3_one + (n - 1) * k.c for k in self.kinds)

    def _solve_count(self, ag: float, rs: float, cap: float, lo_hint: float, ceiling: float | None,
                     n_fixed: int | None) -> _Solved | None:
        lo = max(lo_hint, self.compute_floor * (1 - 1e-9), (2 * ag + rs) * (1 - 1e-9), 1e-12)
        if ceiling is not None:
            if ceiling <= lo or not self.feasible(ceiling, ag, rs, cap, n_fixed):
                return None
            hi = ceiling
        else:
            limit = self.saturated_t(ag, rs, n_fixed)
            hi = lo * 1.25
            while not self.feasible(min(hi, limit), ag, rs, cap, n_fixed):
                if hi >= limit:
                    return None
                lo, hi = hi, hi * 2
            hi = min(hi, limit)
        while hi > lo * (1 + BISECTION_TOL):
            mid = math.sqrt(lo * hi)
            if self.feasible(mid, ag, rs, cap, n_fixed):
                hi = mid
            else:
                lo = mid
        return _Solved(lo, hi, self.assign(hi, ag, rs, cap, n_fixed))

    # ------------------------------------------------------------------ a plan from options

    def assign(self, t: float, ag: float, rs: float, cap: float, n_fixed: int | None) -> Assignment:
        options = self.options(t, ag, rs, cap, n_fixed)
        picks = choose(options, self.B)
        if picks is None:  # pragma: no cover - t was proven feasible with the same options
            raise RuntimeError("knapsack backtrack failed at a feasible time")
        models = [self.kinds[k] for k in self.of_rank]
        batch = [int(o.b[p]) for o, p in zip(options, picks)]
        limit = [int(o.m[p]) for o, p in zip(options, picks)]
        micro = [m.best_split(b, lim, ag, rs, n_fixed) for m, b, lim in zip(models, batch, limit)]
        self._trim(batch, micro, models, ag, rs, n_fixed)
        micro = [m.best_split(b, lim, ag, rs, n_fixed) for m, b, lim in zip(models, batch, limit)]
        caps = [float(m.share_cap[-(-b // n) if b else 0]) for m, b, n in zip(models, batch, micro)]
        shares = water_fill(caps)
        if shares is None:  # pragma: no cover - the knapsack guarantees sum of caps >= 1
            raise RuntimeError("shares do not fit after trimming")
        if n_fixed is None:  # larger micro-batches where the share leaves room: never slower
            micro = [m.split_for_share(b, r, ag, rs) for m, b, r in zip(models, batch, shares)]
            step = max(c.step_s for c in evaluate(self.cluster, batch, micro, shares))
            # then, off the critical path, the fewest micro-batches that keep within the step
            budget = step * 1e3 / self.cluster.model.num_layers
            micro = [m.fewest_within(b, r, ag, rs, budget) or n for m, b, r, n in zip(models, batch, shares, micro)]
        step = max(c.step_s for c in evaluate(self.cluster, batch, micro, shares))
        return Assignment(tuple(batch), tuple(micro), tuple(shares), step)

    def _trim(self, batch: list[int], micro: list[int], models: list[DeviceModel], ag: float, rs: float,
              n_fixed: int | None) -> None:
        """Remove surplus samples one at a time from the currently slowest rank."""
        excess = sum(batch) - self.B
        floor = 0 if n_fixed is None else n_fixed
        heap = [(-float(m.layer_ms(b, n, ag, rs)), i) for i, (m, b, n) in enumerate(zip(models, batch, micro))
                if batch[i] > floor]
        heapq.heapify(heap)
        while excess > 0:
            _, i = heapq.heappop(heap)
            batch[i] -= 1
            micro[i] = min(micro[i], batch[i]) if n_fixed is None else n_fixed
            excess -= 1
            if batch[i] > floor:
                heapq.heappush(heap, (-float(models[i].layer_ms(batch[i], max(micro[i], 1), ag, rs)), i))

    # ------------------------------------------------------------------ collectives: rho search

    def solve(self) -> tuple[Assignment, float]:
        """The best assignment and a proven lower bound on the step time (s)."""
        ag0, rs0, slope = self.comm.allgather_ms, self.comm.reduce_scatter_ms, self.comm.uneven_slope
        to_s = self.L / 1e3
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
        while heap:
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
        return PlanningError(f"no plan fits the memory of this cluster at global batch {self.B}")


# ---------------------------------------------------------------------- input checks


def _check_inputs(cluster: Cluster, global_batch: object, mode: str, strategy: str) -> int:
    if mode not in PLAN_MODES:
        raise PlanningError(f"mode must be one of {PLAN_MODES}, got {mode!r}")
    if strategy not in STRATEGIES:
        raise PlanningError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if isinstance(global_batch, bool) or not isinstance(global_batch, (int, np.integer)) or global_batch < 1:
        raise PlanningError(f"the global batch size must be a whole number >= 1, got {global_batch!r}")
    if not cluster.devices:
        raise PlanningError("the cluster has no devices; list at least one GPU under 'devices:'")
    B, W = int(global_batch), cluster.world_size
    if mode == "uniform" and B < W:
        raise PlanningError(
            f"uniform mode gives every rank at least one sample, but the global batch {B} is smaller than "
            f"the {W} ranks; raise --global-batch-size to at least {W} or use --mode layered")
    return B


def _check_memory(problem: _Problem) -> None:
    """Raise with what is short, by how much, when no step time can fit the memory."""
    cluster, s = problem.cluster, problem.cluster.settings
    models = [problem.kinds[k] for k in problem.of_rank]
    state = models[0].cost.state_gb
    where = (f"after compute memory and the {s.reserved_memory_gb:g} GiB reserve per GPU "
             f"(usable_memory_fraction {s.usable_memory_fraction:g})")
    for rank, m in enumerate(models):
        if m.share_cap[0] < 0:
            need = float(m.cost.compute_memory(0)) + s.reserved_memory_gb
            raise PlanningError(
                f"rank {rank} ({m.device.name}) cannot run at all: it needs {need:.2f} GiB (compute memory "
                f"of an empty batch plus the reserve) but has {s.usable_memory_fraction * m.device.memory_gb:.2f} "
                f"GiB usable; remove it, lower reserved_memory_gb or raise usable_memory_fraction")
    room0 = [m.share_cap[0] * state for m in models]
    room1 = [m.share_cap[1] * state if m.m_cap >= 1 else -math.inf for m in models]
    if state > sum(room0) * (1 + 1e-12):
        raise PlanningError(
            f"the training state needs {state:.1f} GiB ({cluster.model.parameters:,} parameters x "
            f"{cluster.model.state_bytes_per_param:g} bytes) but the {problem.W} GPUs have only {sum(room0):.1f} GiB "
            f"free {where}: short by {state - sum(room0):.1f} GiB; add GPUs or memory, or shrink the model")
    if problem.mode == "uniform":
        small = [r for r, m in enumerate(models) if m.m_cap < 1]
        if small:
            r = small[0]
            need = float(models[r].cost.compute_memory(1)) + s.reserved_memory_gb
            raise PlanningError(
                f"rank {r} ({models[r].device.name}) is too small for one sample even with no state: needs "
                f"{need:.2f} GiB, has {s.usable_memory_fraction * models[r].device.memory_gb:.2f} GiB usable; "
                f"uniform mode gives every rank samples, so use --mode layered (it can hold state only) or remove it")
        total = sum(room1)
        if state > total * (1 + 1e-12):
            raise PlanningError(
                f"with one sample on every rank (uniform mode) the state ({state:.1f} GiB) exceeds the "
                f"{total:.1f} GiB free {where}: short by {state - total:.1f} GiB; use --mode layered or add memory")
        return
    if all(m.m_cap < 1 for m in models):
        r = int(np.argmax([m.share_cap[0] for m in models]))
        need = float(models[r].cost.compute_memory(1)) + s.reserved_memory_gb
        raise PlanningError(
            f"no GPU fits one sample even with no state: the roomiest, rank {r} ({models[r].device.name}), "
            f"needs {need:.2f} GiB for one sample and has {s.usable_memory_fraction * models[r].device.memory_gb:.2f} "
            f"GiB usable; shorten the sequence, shrink the model or add a larger GPU")
    best = max(sum(room0) - room0[j] + room1[j] for j in range(problem.W))
    if state > best * (1 + 1e-12):
        raise PlanningError(
            f"the training state ({state:.1f} GiB) fits only while no GPU computes: with one sample on the "
            f"roomiest GPU the {problem.W} GPUs have {best:.1f} GiB free {where}, short by {state - best:.1f} GiB; "
            f"add GPUs or memory, or shrink the model")


# ---------------------------------------------------------------------- public API


def baselines(cluster: Cluster, global_batch_size: int) -> dict[str, BaselineResult]:
    """The even and proportional baselines (with their per-rank plans)."""
    return {"even": even_baseline(cluster, global_batch_size),
            "proportional": proportional_baseline(cluster, global_batch_size)}


def _baseline_plan(cluster: Cluster, B: int, mode: str, strategy: str, upper: float) -> Plan:
    """A baseline as a plan of its own (the even one has one micro-batch count, so either mode fits)."""
    if strategy == "proportional" and mode == "uniform":
        raise PlanningError("the proportional baseline picks each rank's micro-batch count, so it has no "
                            "uniform form; use --mode layered or --strategy even")
    result = baselines(cluster, B)[strategy]
    if not result.feasible:
        raise PlanningError(f"the {strategy} baseline is infeasible: {result.reason}")
    return Plan(B, mode, result.ranks, result.predicted_step_s, result.predicted_samples_per_s, upper,
                model_summary(cluster), strategy=strategy, emulated=cluster.emulated)


def plan(cluster: Cluster, global_batch_size: int, mode: str = "layered", strategy: str = "cephalo") -> Plan:
    """Plan a cluster: per-rank batch, micro-batches and state share minimising the step time.

    ``strategy="even"`` or ``"proportional"`` returns that baseline as a plan instead. The cephalo
    plan carries both baselines, the upper bound and its certified optimality gap.
    """
    B = _check_inputs(cluster, global_batch_size, mode, strategy)
    upper = upper_bound_samples_per_s(cluster, B)
    if strategy != "cephalo":
        return _baseline_plan(cluster, B, mode, strategy, upper)
    problem = _Problem(cluster, B, mode)
    _check_memory(problem)
    best, lower_s = problem.solve()
    ranks, step = rank_plans(cluster, best.batch, best.micro, best.shares)
    compared = {name: replace(b, ranks=()) for name, b in baselines(cluster, B).items()}
    return Plan(
        global_batch_size=B,
        mode=mode,
        ranks=ranks,
        predicted_step_s=step,
        predicted_samples_per_s=B / step,
        upper_bound_samples_per_s=upper,
        model=model_summary(cluster),
        baselines=compared,
        strategy="cephalo",
        emulated=cluster.emulated,
        optimality_gap=max(0.0, step / lower_s - 1.0) if lower_s > 0 else None,
    )
