"""Why each rank gets what it gets: what binds it, in the cost model's own figures.

With S the plan's step, s_i rank i's step, and the rank's next sample priced by the cost model
(:class:`~.device_cost.DeviceCost`, its share and collectives unchanged; layered: the best micro-batch
count for b_i + 1 samples, uniform: the plan's count)::

    memory       b_i + 1 samples fit at no micro-batch count:
                 compute_memory(1) + stash + reserved + share_gb * r_i > usable memory
    compute      s_i = S (within TOLERANCE) and the rank's compute C_i >= its collectives A_i
    link         s_i = S and A_i > C_i; or s_i < S but the slowest rank is link-bound: taking
                 samples away from it would not shorten the step
    granularity  s_i < S, but one sample more would take the rank to S or past it (samples are whole);
                 or several ranks set S, so one sample moved here from one of them would not shorten it

where, per step, C_i = L (F + B) + optimizer and A_i = L (all-gather + reduce-scatter + the exposed
all-reduce) for the rank's assignment. A rank with no samples gets a one-line reason with the
figures ("stores 12% of the state; computing one sample would need 19.5 GiB of 18 GiB usable").
Only the planner's own plans are explained: a baseline's batches follow its rule, not a binding.
The shared host's bound (``settings.host_cores``) binds as compute: the ranks' real compute over
the host's cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from cephalo_lightning._common.units import memory_text
from cephalo_lightning._common.vocabulary import Schedule
from cephalo_lightning.planner.cost.calibration import calibrated
from cephalo_lightning.planner.cost.cluster_cost import collective_ms
from cephalo_lightning.planner.cost.device_cost import DeviceCost, kind_costs, step_ms
from cephalo_lightning.planner.cost.prices import Prices
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.plan import Binding, RankPlan

TOLERANCE = 1e-3  # a rank within this fraction of the plan's step sets it


@dataclass(frozen=True)
class _Figures:
    """One rank's step split into compute and collectives, and its step alone (s), as the cost model prices them."""

    compute_s: float
    collectives_s: float
    alone_s: float  # without the shared host's bound or a group's synced passes


def _figures(cost: DeviceCost, r: RankPlan, prices: Prices, exposed: float) -> _Figures:
    b, n, keep = np.array([r.batch_size]), np.array([r.num_micro_batches]), not r.recompute
    fwd, bwd = cost.compute_parts(b, n, keep)
    a1, a2 = cost.collectives(n, prices)
    optimizer = float(cost.optimizer_ms(r.state_share))
    compute = step_ms(cost.settings, cost.num_layers * float(fwd[0] + bwd[0]) + optimizer)
    alone = step_ms(cost.settings, cost.num_layers * (float(cost.layer_ms(b, n, prices, keep)[0]) + exposed) + optimizer)
    return _Figures(compute / 1e3, cost.num_layers * float(a1[0] + a2[0] + exposed) / 1e3, alone / 1e3)


def _next_sample(cost: DeviceCost, r: RankPlan, reserved: float, prices: Prices, exposed: float
                 ) -> tuple[float, float]:
    """(the least memory b + 1 samples need, in GiB; the least step they take where they fit, s,
    inf where they fit nowhere)."""
    b = r.batch_size + 1
    counts = np.array([r.num_micro_batches]) if cost.mode == Schedule.UNIFORM else np.arange(1, b + 1)
    keeps = np.zeros(len(counts), bool)
    if cost.can_keep:  # one micro-batch may keep its graph instead of recomputing
        counts, keeps = np.append(counts, 1), np.append(keeps, True)
    batch = np.full(len(counts), b)
    m = -(-batch // counts)
    memory = cost.compute_memory(m) + cost.extra_memory_gb(m, counts, keeps, batch) + reserved \
        + cost.share_gb * r.state_share
    fits = memory <= r.memory_limit_gb * (1 + 1e-9) if r.memory_limit_gb is not None else np.ones(len(counts), bool)
    layer = cost.layer_ms(batch, counts, prices, keeps) + exposed
    step = step_ms(cost.settings, cost.num_layers * layer + float(cost.optimizer_ms(r.state_share))) / 1e3
    return float(memory.min()), float(step[fits].min()) if fits.any() else math.inf


def _gib(value: float | None) -> str:
    return "?" if value is None else memory_text(value)


def _s(value: float) -> str:
    return f"{value:.3g} s"


@dataclass(frozen=True)
class _Step:
    """What sets the plan's step: its length, the slowest rank and its figures, how many ranks reach
    it, and the host's cores where their shared bound sets it."""

    seconds: float
    slowest: int
    slowest_figures: _Figures
    setters: int
    host_cores: int | None


def explain(cluster: Cluster, ranks: tuple[RankPlan, ...], mode: Schedule) -> tuple[RankPlan, ...]:
    """``ranks`` with ``binding`` and ``why`` filled in (see the module docstring). Ranks alike (kind,
    assignment, collectives, step) are priced once: a cluster of thousands has a handful of kinds."""
    groups = np.array([r.shard_group for r in ranks], dtype=np.int64)
    single = bool((groups == 0).all())
    shares = np.array([r.state_share for r in ranks])
    per_rank, exposed = collective_ms(cluster, shares, None if single else groups)
    costs, of_rank = kind_costs(calibrated(cluster, groups), mode)
    reserved = cluster.settings.reserved_memory_gb
    steps = [r.predicted_step_s or 0.0 for r in ranks]
    S = max(steps)
    prices = [per_rank.at(i) for i in range(len(ranks))]
    keys = [(int(of_rank[i]), r.batch_size, r.num_micro_batches, r.state_share, r.recompute, prices[i],
             float(exposed[i]), steps[i]) for i, r in enumerate(ranks)]
    figures: dict[tuple, _Figures] = {}
    for i, key in enumerate(keys):
        if key not in figures:
            figures[key] = _figures(costs[key[0]], ranks[i], prices[i], float(exposed[i]))
    slowest = max(range(len(ranks)), key=lambda i: steps[i])
    cores = cluster.settings.host_cores
    host_bound = bool(cores) and S > max(f.alone_s for f in figures.values()) * (1 + TOLERANCE)
    step = _Step(S, slowest, figures[keys[slowest]], sum(s >= S * (1 - TOLERANCE) for s in steps),
                 cores if host_bound else None)
    reasons: dict[tuple, tuple[Binding, str]] = {}
    out = []
    for i, (r, key) in enumerate(zip(ranks, keys)):
        if key not in reasons:
            reasons[key] = _reason(costs[key[0]], r, figures[key], steps[i], step, reserved, prices[i],
                                   float(exposed[i]))
        binding, why = reasons[key]
        out.append(replace(r, binding=binding, why=why))
    return tuple(out)


def _reason(cost: DeviceCost, r: RankPlan, fig: _Figures, s_i: float, step: _Step, reserved: float,
            prices: Prices, exposed: float) -> tuple[Binding, str]:
    S, b = step.seconds, r.batch_size
    need, t_next = _next_sample(cost, r, reserved, prices, exposed)
    state = f"stores {100 * r.state_share:.3g}% of the state"
    if not math.isfinite(t_next):
        if b == 0:
            return Binding.MEMORY, f"{state}; computing one sample would need {_gib(need)} of {_gib(r.memory_limit_gb)} usable"
        return Binding.MEMORY, f"one sample more would need {_gib(need)} of {_gib(r.memory_limit_gb)} usable ({state})"
    if step.host_cores is not None:
        return Binding.COMPUTE, (f"the ranks' real compute shared over the host's {step.host_cores} cores sets the "
                                 f"step of {_s(S)}")
    if s_i >= S * (1 - TOLERANCE):
        if fig.collectives_s > fig.compute_s:
            if b == 0 and t_next <= S * (1 + TOLERANCE):
                return Binding.LINK, (f"its collectives alone take the whole step of {_s(S)}: the link sets the step "
                                      f"whatever the batch split, and the samples went to other ranks")
            if b == 0:
                return Binding.LINK, (f"its collectives alone take the whole step of {_s(S)}; one sample would take "
                                      f"it to {_s(t_next)}")
            return Binding.LINK, (f"its collectives take {_s(fig.collectives_s)} of the {_s(S)} step, more than its "
                                  f"compute ({_s(fig.compute_s)})")
        return Binding.COMPUTE, (f"its compute ({_s(fig.compute_s)}) sets the step of {_s(S)}; its collectives take "
                                 f"{_s(fig.collectives_s)}")
    one = "one sample" if b == 0 else "one sample more"
    if t_next >= S * (1 - TOLERANCE):
        return Binding.GRANULARITY, f"{one} would take it from {_s(s_i)} to {_s(t_next)}, at or past the step of {_s(S)}"
    slow = step.slowest_figures
    if slow.collectives_s > slow.compute_s:
        return Binding.LINK, (f"the step of {_s(S)} is held by the collectives of rank {step.slowest} "
                              f"({_s(slow.collectives_s)}), which fewer samples there would not shorten; {one} here "
                              f"would take {_s(t_next)}")
    setters = f"rank {step.slowest}" if step.setters == 1 else f"{step.setters} ranks"
    return Binding.GRANULARITY, (f"the step of {_s(S)} is set by {setters}; {one} moved here ({_s(t_next)}) would "
                                 "not shorten it (samples are whole)")
