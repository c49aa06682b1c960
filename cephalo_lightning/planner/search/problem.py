"""One planning problem and its feasibility check at a step time S.

The ranks are folded into device *kinds* (same profile and memory: one option table and a count).
At a step time S and a price of the collectives every kind has a Pareto table of options
(:mod:`.options`), and S is feasible iff one option per device reaches B samples with a total
share >= 1: a multiple-choice knapsack (:mod:`.knapsack`). Its linear relaxation over kinds proves
S infeasible; the exact dynamic program decides S where its work is affordable, else the
relaxation's choice rounded to whole devices and repaired finds a feasible choice or misses
(:attr:`.Verdict.UNKNOWN`). The searches over S (:mod:`.solver`, :mod:`.peers`) build on this.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from cephalo_lightning._common.vocabulary import Schedule, Verdict
from cephalo_lightning.planner.cost.calibration import calibrated
from cephalo_lightning.planner.cost.collective_prices import communication
from cephalo_lightning.planner.cost.device_cost import DeviceCost, kind_costs
from cephalo_lightning.planner.cost.prices import Prices
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.planning_error import PlanningError
from cephalo_lightning.planner.search.baselines import per_sample_ms
from cephalo_lightning.planner.search.knapsack import (
    SHARE_TOL,
    Group,
    choose,
    dense_work,
    feasible,
    groups_of,
    relaxation,
    round_and_repair,
)
from cephalo_lightning.planner.search.option_tables import DeviceModel, Options

BISECTION_TOL = 5e-4  # relative width of the final step-time bracket of every search over S
DENSE_WORK_LIMIT = 3e7  # element operations of one exact knapsack check
DENSE_CALL_LIMIT = 20_000  # options summed over devices (one vector operation each)


class Problem:
    """One planning problem: the cluster, the batch, the mode, and the per-kind device models."""

    def __init__(self, cluster: Cluster, global_batch: int, mode: Schedule, group_kinds: bool = True,
                 shard_groups: Sequence[int] | np.ndarray | None = None,
                 dense_work_limit: float = DENSE_WORK_LIMIT) -> None:
        # a calibration is folded in as it prices shard_groups (None: one group of all)
        self.source, self.group_kinds = cluster, group_kinds
        self.dense_work_limit = dense_work_limit  # below 0: the relaxation's rounding and repair decide every S
        self._for_groups: dict[tuple[int, ...], Problem] = {}
        cluster = calibrated(cluster, np.zeros(cluster.world_size, np.int64) if shard_groups is None
                             else shard_groups)
        self.cluster = cluster
        self.B = global_batch
        self.mode = Schedule(mode)  # its string is taken too
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
            self._for_groups[key] = Problem(self.source, self.B, self.mode, self.group_kinds, labels,
                                            self.dense_work_limit)
        return self._for_groups[key]

    # ------------------------------------------------------------------ feasibility at S

    def tables(self, S: float, prices: Prices, cap: float, n_fixed: int | None
               ) -> tuple[list[Options], list[Options]]:
        """Every kind's (inner, outer) option tables at S, shares capped at ``cap``."""
        pairs = [k.options(S, prices, cap, n_fixed) for k in self.kinds]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def relaxed_ok(self, S: float, prices: Prices, cap: float, n_fixed: int | None) -> bool:
        """Whether the linear relaxation over kinds reaches a total share of 1 at S (False: a proof)."""
        return relaxation(self.tables(S, prices, cap, n_fixed)[1], self.counts, self.B).value >= 1.0 - SHARE_TOL

    def dense_affordable(self, S: float, prices: Prices, cap: float, n_fixed: int | None) -> bool:
        """Whether the exact dynamic program over every device is within its work limits at S."""
        inner, _ = self.tables(S, prices, cap, n_fixed)
        per_device = [inner[k] for k in self.device_kind]
        calls = sum(len(inner[k]) * int(c) for k, c in enumerate(self.counts))
        return calls <= DENSE_CALL_LIMIT and dense_work(per_device, self.B) <= self.dense_work_limit

    def check(self, S: float, prices: Prices, cap: float, n_fixed: int | None, dense: bool,
              choice: bool = False) -> tuple[Verdict, list[Group] | None]:
        """(FEASIBLE, groups) | (INFEASIBLE, None): a proof | (UNKNOWN, None): the repair missed.

        The exact program backtracks its choice only when asked (``choice``); the repair always has one.
        """
        inner, outer = self.tables(S, prices, cap, n_fixed)
        bound = relaxation(outer, self.counts, self.B)
        if bound.value < 1.0 - SHARE_TOL:
            return Verdict.INFEASIBLE, None
        if dense:
            per_device = [inner[k] for k in self.device_kind]
            if not feasible(per_device, self.B):
                return Verdict.INFEASIBLE, None
            if not choice:
                return Verdict.FEASIBLE, None
            picks = choose(per_device, self.B)
            if picks is None:  # pragma: no cover - feasible() said yes on the same tables
                raise RuntimeError("knapsack backtrack failed at a feasible time")
            return Verdict.FEASIBLE, groups_of(picks, self.device_kind)
        relaxed = bound if all(i is o for i, o in zip(inner, outer)) else relaxation(inner, self.counts, self.B)
        groups = round_and_repair(inner, self.counts, self.B, relaxed)
        return (Verdict.FEASIBLE, groups) if groups is not None else (Verdict.UNKNOWN, None)

    def saturated(self, prices: Prices, n_fixed: int | None) -> float:
        """A per-step time at which every device can take all B samples in any split and the whole state."""
        # memory-wise the best split of any b is b micro-batches of one sample, no slower than B of them
        worst = 0.0
        for kind in self.kinds:
            n = np.array([1, self.B]) if n_fixed is None else np.array([n_fixed])
            layer = float(kind.layer_ms(np.full(len(n), self.B), n, prices).max())
            worst = max(worst, self.L * max(layer, kind.idle_ms(prices, n_fixed or 1)) + kind.kappa)
        return worst * (1 + 1e-9)

    def count_floor(self, n: int, prices: Prices) -> float:
        """A per-step floor for count n, non-decreasing in n: every rank runs n micro-batches of at
        least one sample, and the B samples cost at least each kind's best per-sample time plus the
        n - 1 micro-batch overheads."""
        throughput = (n - 1) * min(k.c for k in self.kinds) + (self.B / self.rate if self.rate > 0 else 0.0)
        return self.L * max(max(max(n * k.unit_ms + (n - 1) * k.c, k.idle_ms(prices, n)) for k in self.kinds),
                            throughput)

    def no_plan(self) -> PlanningError:
        """The error when no step time fits: what is short, and what to change."""
        if self.mode == Schedule.UNIFORM:
            return PlanningError(
                f"no uniform plan fits every rank's memory at global batch {self.B} on {self.W} ranks "
                f"(every rank needs at least one sample and the same micro-batch count); use --mode "
                f"layered, change the global batch, or add memory")
        return PlanningError(f"no plan fits the memory of this cluster at global batch {self.B}; "
                             f"lower the global batch or add memory")

