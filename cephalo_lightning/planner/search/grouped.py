"""Shard groups in the solver: the candidate groupings, and the search over one grouping of several groups.

A *grouping* splits the ranks into shard groups; the ranks of a group hold one replica of the state
between them (their shares sum to 1), groups replicate each other. The candidates
(:func:`candidate_groupings`): one group of every rank (today's full shard, solved by
:func:`.solver.solve`), one group per node (HSDP), one group per rank (data parallelism),
and the splits the nodes make natural (halves and pairs of every node of four or more ranks).

For one grouping of G > 1 groups at a step time S the groups are independent but for the samples
they take: group g can take at most beta_g(S) samples while its shares still sum to 1, and S is
feasible iff sum_g beta_g(S) >= B. Groups with the same kinds, counts and link class (a *type*)
have the same beta, so the work grows with the types, not the groups (identical nodes repeat).
A group's collectives depend on its largest share rho (:class:`.collective_prices.LinkPrices`), so rho's range
[1/k, 1] is cut into intervals: an interval [rho_a, rho_b] priced at rho_a with shares capped at
rho_b bounds every plan whose largest share lies in it. Per type and interval:

* the bound: the linear relaxation over the type's kinds (moving devices along the upper hulls of
  their (b, r) tables, cheapest share per sample first, until the share left is 1) on the outer
  tables: no plan of the grouping takes more samples, so sum_t copies_t max_interval bound_t < B
  proves S infeasible;
* the choice: the same walk on the inner tables with whole devices (the straddled step moves the
  devices the share allows), priced at the interval's top: a feasible choice.

The smallest S where the bound reaches B is a proven lower bound for the grouping; the smallest S
where the choices reach B gives the plan (trimmed to B samples, shares water-filled inside every
group, priced exactly). The certified gap of the plan is against the least lower bound over the
groupings considered: it certifies the best plan over THESE groupings, not over all groupings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cephalo_lightning._common.vocabulary import Grouping
from cephalo_lightning.planner.cost.cluster_cost import evaluate_arrays
from cephalo_lightning.planner.cost.collective_prices import LinkPrices, far_fraction
from cephalo_lightning.planner.cost.prices import FREE, Prices
from cephalo_lightning.planner.search.assignment import Assignment, share_cap, split, trim
from cephalo_lightning.planner.search.knapsack import SHARE_TOL, Group, hull_steps, upper_hull
from cephalo_lightning.planner.search.option_tables import Options, pareto
from cephalo_lightning.planner.search.problem import BISECTION_TOL, Problem

RHO_FRACTIONS = (0.0, 1 / 16, 1 / 4, 1.0)  # interval ends within [1/k, 1]
FINE_FRACTIONS = (0.0, 1 / 64, 1 / 32, *(i / 16 for i in range(1, 17)))  # where the exact program is affordable
EXACT_WORK = 200_000  # devices x options x samples of one group's exact program
RANKS = 6  # rows: [kind, count, b, m cap, n, keep, ranks, (prices, exposed), cap]


def canonical(labels: np.ndarray) -> np.ndarray:
    """Group labels renumbered 0, 1, ... in the order of each group's first rank (as plans number them)."""
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    renumber = np.empty(len(first), np.int64)
    renumber[np.argsort(first, kind="stable")] = np.arange(len(first))
    return renumber[inverse.ravel()]


def candidate_groupings(nodes: tuple[int, ...] | np.ndarray) -> list[tuple[tuple[Grouping, ...], np.ndarray]]:
    """The groupings the planner weighs (:class:`.Grouping`), each as its names and every rank's group:
    ``full`` (one group) first; names that give the same grouping share one entry (one node:
    ``per-node`` is ``full``); a split no node allows is left out."""
    nodes = np.asarray(nodes, dtype=np.int64)
    W = len(nodes)
    out: list[tuple[tuple[Grouping, ...], np.ndarray]] = []
    seen: dict[bytes, int] = {}

    def add(name: Grouping, labels: np.ndarray) -> None:
        labels = canonical(labels)
        key = labels.tobytes()
        if key in seen:
            names, same = out[seen[key]]
            out[seen[key]] = ((*names, name), same)
        else:
            seen[key] = len(out)
            out.append(((name,), labels))

    add(Grouping.FULL, np.zeros(W, np.int64))
    add(Grouping.PER_NODE, nodes)
    position = np.zeros(W, np.int64)  # each rank's position within its node, in rank order
    size = np.zeros(W, np.int64)
    for node in np.unique(nodes):
        at = np.nonzero(nodes == node)[0]
        position[at] = np.arange(len(at))
        size[at] = len(at)
    splittable = (size >= 4) & (size % 2 == 0)
    if splittable.any():
        half = np.where(splittable, position // np.maximum(size // 2, 1), 0)
        add(Grouping.NODE_HALVES, nodes * 2 + half)
        pair = np.where(splittable, position // 2, 0)
        add(Grouping.NODE_PAIRS, nodes * W + pair)
    add(Grouping.PER_RANK, np.arange(W))
    return out


@dataclass(frozen=True)
class GroupType:
    """``copies`` identical groups: ``per_group[j]`` ranks of kind ``kinds[j]`` each, on one link class."""

    kinds: tuple[int, ...]
    per_group: tuple[int, ...]
    copies: int
    crosses: bool  # the group spans nodes
    ranks: tuple[np.ndarray, ...]  # per kind: (copies, per_group) ranks, one row per group

    @property
    def size(self) -> int:
        return sum(self.per_group)


def group_types(groups: np.ndarray, of_rank: np.ndarray, nodes: np.ndarray, num_kinds: int) -> list[GroupType]:
    """The grouping's groups, folded into types (vectorised: no loop over groups)."""
    G = int(groups.max()) + 1
    counts = np.zeros((G, num_kinds), np.int64)
    np.add.at(counts, (groups, of_rank), 1)
    low, high = np.full(G, np.iinfo(np.int64).max), np.full(G, -1)
    np.minimum.at(low, groups, nodes)
    np.maximum.at(high, groups, nodes)
    signature = np.column_stack([counts, (low != high).astype(np.int64)])
    rows, type_of = np.unique(signature, axis=0, return_inverse=True)
    type_of = type_of.ravel()
    order = np.lexsort((np.arange(len(groups)), groups, of_rank, type_of[groups]))  # by type, kind, group, rank
    by_rank_type = type_of[groups][order]
    by_rank_kind = of_rank[order]
    out = []
    for t, row in enumerate(rows):
        copies = int(np.count_nonzero(type_of == t))
        kinds = tuple(int(k) for k in np.nonzero(row[:num_kinds])[0])
        per_group = tuple(int(row[k]) for k in kinds)
        ranks = []
        for k, c in zip(kinds, per_group):
            at = order[(by_rank_type == t) & (by_rank_kind == k)]
            ranks.append(at.reshape(copies, c))
        out.append(GroupType(kinds, per_group, copies, bool(row[-1]), tuple(ranks)))
    return out


def most_samples(tables: list[Options], counts: tuple[int, ...]) -> tuple[float, float, list[Group]]:
    """Most samples the devices (``counts[j]`` of table j) take while their shares still sum to 1:
    the linear relaxation's figure, and a whole-device choice's figure and choice (see module)."""
    if any(len(t) == 0 for t in tables):
        return -math.inf, -math.inf, []
    hulls = [upper_hull(t) for t in tables]
    share = sum(c * float(t.r[h[0]]) for t, h, c in zip(tables, hulls, counts))
    samples = sum(c * int(t.b[h[0]]) for t, h, c in zip(tables, hulls, counts))
    budget = share - 1.0
    if budget < -SHARE_TOL:
        return -math.inf, -math.inf, []
    at = [0] * len(tables)
    kind_of, step_b, step_r = hull_steps(tables, hulls)
    relaxed = whole = float(samples)
    moved, straddle = 0, -1
    if len(kind_of):
        c = np.asarray(counts, dtype=float)[kind_of]
        loss = np.cumsum(c * step_r)
        full = int(np.searchsorted(loss, max(budget, 0.0), side="right"))  # steps every device of the kind takes
        gained = float((c[:full] * step_b[:full]).sum())
        relaxed = whole = samples + gained
        for j in kind_of[:full].tolist():
            at[j] += 1
        if full < len(loss):
            left = max(budget, 0.0) - (float(loss[full - 1]) if full else 0.0)
            relaxed += left / float(step_r[full]) * float(step_b[full])
            straddle = int(kind_of[full])
            moved = min(int(counts[straddle]) - 1, int(math.floor(left / float(step_r[full]) * (1 - 1e-12))))
            whole += moved * float(step_b[full])
    groups: list[Group] = []
    for j, (h, c) in enumerate(zip(hulls, counts)):
        here = int(h[at[j]])
        if j == straddle and moved > 0:
            groups.append(Group(j, c - moved, here))
            groups.append(Group(j, moved, int(h[at[j] + 1])))
        else:
            groups.append(Group(j, c, here))
    return relaxed, whole, groups


def exact_most_samples(tables: list[Options], counts: tuple[int, ...]) -> tuple[float, list[Group]]:
    """Most samples one option per device reaches with shares summing to 1, exactly (a dynamic
    program over the group's devices: dp[j] = the largest share total at exactly j samples), and
    that choice."""
    if any(len(t) == 0 for t in tables):
        return -math.inf, []
    devices = [j for j, c in enumerate(counts) for _ in range(c)]
    top = sum(tables[j].max_b for j in devices)
    dp = np.full(top + 1, -np.inf)
    dp[0] = 0.0
    picks: list[np.ndarray] = []
    for j in devices:
        t = tables[j]
        new = np.full(top + 1, -np.inf)
        arg = np.zeros(top + 1, np.int64)
        for o, (b, r) in enumerate(zip(t.b.tolist(), t.r.tolist())):
            cand = np.full(top + 1, -np.inf)
            cand[b:] = dp[: top + 1 - b] + r
            better = cand > new
            new[better], arg[better] = cand[better], o
        picks.append(arg)
        dp = new
    ok = np.nonzero(dp >= 1.0 - SHARE_TOL)[0]
    if not len(ok):
        return -math.inf, []
    at = int(ok[-1])
    chosen: dict[tuple[int, int], int] = {}
    for j, arg in zip(devices[::-1], picks[::-1]):
        o = int(arg[at])
        chosen[(j, o)] = chosen.get((j, o), 0) + 1
        at -= int(tables[j].b[o])
    return float(ok[-1]), [Group(j, c, o) for (j, o), c in sorted(chosen.items())]


class GroupedProblem:
    """One grouping of more than one group, on a :class:`.problem.Problem`'s kinds (see module)."""

    def __init__(self, problem: Problem, groups: np.ndarray, links: LinkPrices) -> None:
        self.problem = problem
        self.groups = groups
        self.G = int(groups.max()) + 1
        nodes = np.asarray(problem.cluster.nodes, dtype=np.int64)
        # can every group hold a whole replica even with no samples? (else no step time fits)
        room = np.array([min(1.0, float(max(k.room.max(), k.room_keep.max()))) for k in problem.kinds])
        self.holds = bool((np.bincount(groups, room[problem.of_rank], minlength=self.G) >= 1.0 - SHARE_TOL).all())
        self.types = group_types(groups, problem.of_rank, nodes, len(problem.kinds)) if self.holds else []
        far = far_fraction(groups, nodes)
        # per type: interval ends in rho and the collectives' price at each
        self.rho: list[np.ndarray] = []
        self.priced: list[list[tuple[Prices, float]]] = []  # (prices, exposed): LinkPrices.group
        # small groups at a small batch: the exact program decides (else the hull walk and its rounding)
        self.exact = [t.size ** 2 * min(problem.B, 64) * problem.B <= EXACT_WORK for t in self.types]
        for t, exact in zip(self.types, self.exact):
            k = t.size
            fractions = FINE_FRACTIONS if exact else RHO_FRACTIONS
            ends = np.array([1.0]) if k == 1 else 1.0 / k + (1.0 - 1.0 / k) * np.array(fractions)
            self.rho.append(ends)
            self.priced.append([links.group(k, t.crosses, float(r), self.G, far) for r in ends])

    def _priced_tables(self, t: int, S: float, price: int, n_fixed: int | None, cache: dict) -> tuple:
        """The type's kinds' (inner, outer) tables at price point ``price``, shares uncapped; types with the
        same kind and price share them (``cache`` lives for one step time)."""
        prices, exposed = self.priced[t][price]
        out = []
        for k in self.types[t].kinds:
            key = (k, prices, exposed)
            if key not in cache:  # the exposed part adds to every layer: a budget that much smaller
                cache[key] = self.problem.kinds[k].options(S - self.problem.L * exposed, prices, 1.0, n_fixed)
            out.append(cache[key])
        return out

    def _tables(self, t: int, S: float, price: int, cap: float, n_fixed: int | None, inner: bool,
                cache: dict | None = None) -> list[Options]:
        """Tables at a price point with shares capped at ``cap``: an inner table capped stays achievable,
        an outer one capped still dominates every achievable option within the cap."""
        tables = self._priced_tables(t, S, price, n_fixed, {} if cache is None else cache)
        return [capped(pair[0 if inner else 1], cap) for pair in tables]

    def _most(self, t: int, tables: list[Options]) -> tuple[float, float, list[Group]]:
        """(bound, whole-device samples, choice) of one group of type t on these tables."""
        if self.exact[t]:
            samples, groups = exact_most_samples(tables, self.types[t].per_group)
            return samples, samples, groups
        return most_samples(tables, self.types[t].per_group)

    def bound(self, S: float, n_fixed: int | None) -> float:
        """An upper bound on the samples any plan of this grouping takes at step S."""
        total, cache = 0.0, {}
        for t, gt in enumerate(self.types):
            ends = self.rho[t]
            if len(ends) == 1:
                best = self._most(t, self._tables(t, S, 0, 1.0, n_fixed, False, cache))[0]
            else:
                best = max(self._most(t, self._tables(t, S, j, float(ends[j + 1]), n_fixed, False, cache))[0]
                           for j in range(len(ends) - 1))
            if best == -math.inf:
                return -math.inf
            total += gt.copies * min(best, self.problem.B)  # every type must hold its replicas: no early exit
        return total

    def choose(self, S: float, n_fixed: int | None, pick: bool = False):
        """Samples a whole-device choice takes at step S (and, with ``pick``, per type its choice)."""
        total, picks, cache = 0.0, [], {}
        for t, gt in enumerate(self.types):
            best, best_at = -math.inf, None
            for j, rho in enumerate(self.rho[t]):
                _, whole, groups = self._most(t, self._tables(t, S, j, float(rho), n_fixed, True, cache))
                if whole > best:
                    best, best_at = whole, (j, groups)
            if best == -math.inf:
                return (-math.inf, []) if pick else -math.inf
            total += gt.copies * best
            picks.append(best_at)
        return (total, picks) if pick else total

    def solve(self, lo: float, limit: float, ceiling: float | None, n_fixed: int | None
              ) -> tuple[Assignment | None, float]:
        """The grouping's best assignment found and its proven lower bound on the per-step ms
        (None and the bound when nothing at or below ``ceiling`` is feasible)."""
        B = self.problem.B
        if not self.holds:
            return None, math.inf
        top = limit if ceiling is None else min(limit, ceiling)
        if top <= lo or self.bound(top, n_fixed) < B:
            return None, (math.inf if ceiling is None or top >= limit else top)
        hi = top
        while hi > lo * (1 + BISECTION_TOL / 4):
            mid = math.sqrt(lo * hi)
            lo, hi = (lo, mid) if self.bound(mid, n_fixed) >= B else (mid, hi)
        proven = lo
        S, step = hi, BISECTION_TOL
        while self.choose(S, n_fixed) < B:
            lo = S
            if S >= top:
                return None, proven
            S = min(top, hi * (1 + step))
            step *= 2
        hi = S  # choose(hi) >= B, choose(lo) < B: the bisection keeps both (hi is what is assigned)
        while hi > lo * (1 + BISECTION_TOL):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if self.choose(mid, n_fixed) < B else (lo, mid)
        return self.assign(hi, n_fixed), proven

    def assign(self, S: float, n_fixed: int | None) -> Assignment:
        problem = self.problem
        _, picks = self.choose(S, n_fixed, pick=True)
        rows = []
        for t, (gt, (j, groups)) in enumerate(zip(self.types, picks)):
            rho = float(self.rho[t][j])
            prices, exposed = self.priced[t][j]
            tables = self._tables(t, S, j, rho, n_fixed, True)
            position = [0] * len(gt.kinds)
            for g in groups:
                table, kind = tables[g.kind], gt.kinds[g.kind]
                p = position[g.kind]
                ranks = gt.ranks[g.kind][:, p: p + g.count].T.ravel()  # position-major: each group's share intact
                position[g.kind] += g.count
                b, m, keep = int(table.b[g.option]), int(table.m[g.option]), bool(table.keep[g.option])
                n = split(problem, kind, b, m, prices, n_fixed, keep)
                rows.append([kind, len(ranks), b, m, n, keep, ranks, (prices, exposed), rho])
        trim(problem, rows, FREE, n_fixed)
        W = problem.W
        batch, micro = np.zeros(W, np.int64), np.ones(W, np.int64)
        keep, caps = np.zeros(W, bool), np.zeros(W)
        for row in rows:
            prices, exposed = row[7]
            row[4] = split(problem, row[0], row[2], row[3], prices, n_fixed, row[5])
            at = row[RANKS]
            batch[at], micro[at], keep[at] = row[2], row[4], row[5]
            caps[at] = share_cap(problem, row, S - problem.L * exposed, prices, row[8])
        shares = water_fill_groups(caps, self.groups, self.G)
        step, _, _ = evaluate_arrays(problem.cluster, batch, micro, shares, ~keep, problem.mode,
                                     kinds=(problem.costs, problem.of_rank), shard_groups=self.groups)
        return Assignment(batch, micro, shares, keep, float(step.max()), self.groups)


def capped(table: Options, cap: float) -> Options:
    """A table with its shares capped (the Pareto front again: capped options may tie)."""
    if cap >= 1.0 or not len(table) or table.max_r <= cap:
        return table
    return pareto(table.b, table.m, np.minimum(table.r, cap), table.keep)


def water_fill_groups(caps: np.ndarray, groups: np.ndarray, G: int) -> np.ndarray:
    """Within every group, shares <= caps summing to 1 with the smallest largest share (as
    :func:`.device_cost.water_fill`, vectorised over the groups)."""
    caps = np.maximum(caps, 0.0)
    if (np.bincount(groups, caps, minlength=G) < 1.0 - 1e-9).any():  # pragma: no cover - the choice holds 1
        raise RuntimeError("a shard group's shares do not fit after trimming")
    lo, hi = np.zeros(G), np.ones(G)
    for _ in range(60):
        level = (lo + hi) / 2
        enough = np.bincount(groups, np.minimum(caps, level[groups]), minlength=G) >= 1.0
        hi, lo = np.where(enough, level, hi), np.where(enough, lo, level)
    shares = np.minimum(caps, hi[groups])
    return shares / np.bincount(groups, shares, minlength=G)[groups]
