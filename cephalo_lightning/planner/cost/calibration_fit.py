"""Fit a :class:`~cephalo_lightning.planner.schema.calibration_terms.Calibration` to measured steps (torch-free).

What a run measures per step, on every rank, without extra instrumentation: the step's wall time
(the same on every rank, as every step ends in collectives), the rank's busy time (its compute
regions, emulated waits included; :class:`~cephalo_lightning.runtime.timing.BusyTime`) and, where
the collectives block the host (CPU), the time blocked in them on the rank blocked least (what
compute did not hide of them), which tells the collectives as run apart from a fixed per-step
cost even on one plan's steps. The
unknowns are the calibration's terms, theta = (step overhead, micro-batch overhead, a multiplier
k of the profiled collective times, the overlap, one compute scale per rank), and the model is the
cost model itself on the calibrated cluster, so what is fitted is exactly what ``plan`` predicts::

    busy_i(theta) = predicted_busy_s(calibrated cluster, plan)[i]
    wall(theta)   = max_i predicted step_i(calibrated cluster, plan)

Least squares over every observation, on relative residuals (a 10% error weighs the same on a
short and a long step), by Gauss-Newton with Levenberg damping, each term kept in its range. A
direction the observations cannot tell apart (one plan's steps fix the step overhead plus the
exposed communication, not the two apart) stays at the profile's value: a weak prior term
``PRIOR_WEIGHT * (theta - theta_0)`` is part of the objective. On data the model can produce
exactly, with the terms identifiable, the fit returns the producing terms. The fit runs twice: first
with the collectives and the overlap held near the profile's (``HELD_WEIGHT``), so that what the
data cannot tell apart from a fixed per-step cost is charged per step (it does not grow with the
micro-batch count or the mode, as a scaled collective would), then with every term free, which
moves only what the data determine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cephalo_lightning._common.vocabulary import Schedule
from cephalo_lightning.planner.cost.calibration import calibrated, with_calibration
from cephalo_lightning.planner.cost.cluster_cost import collective_ms, evaluate_arrays, predicted_busy_s
from cephalo_lightning.planner.cost.collective_prices import communication
from cephalo_lightning.planner.cost.device_cost import kind_costs
from cephalo_lightning.planner.cost.prices import Prices
from cephalo_lightning.planner.schema.calibration_terms import Calibration, same_grouping
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.plan import Plan
from cephalo_lightning.planner.schema.planning_error import PlanningError

HELD_WEIGHT = 0.1  # the first stage's pull on the collectives and the overlap (see fit_calibration)
PRIOR_WEIGHT = 1e-6  # relative pull towards the profile's terms: decides only what the data leave open
_ITERATIONS = 60
_STEP = 1e-7  # finite-difference step, relative to each term's scale


@dataclass(frozen=True)
class StepObservation:
    """One measured step (or a window's median step) of ``plan``: its wall time and every rank's busy time."""

    plan: Plan
    wall_s: float
    busy_s: tuple[float, ...]
    busy_wall_s: tuple[float, ...] | None = None  # the same regions on the wall clock (CPU: waits for a core)
    collective_s: float | None = None  # seconds blocked in collectives, the rank blocked least (None: not measured)


def _start(cluster: Cluster, observations: Sequence[StepObservation]) -> tuple[np.ndarray, np.ndarray]:
    s, world = cluster.settings, cluster.world_size
    wall = float(np.median([o.wall_s for o in observations])) * 1e3
    theta0 = np.array([0.0, s.micro_batch_overhead_ms, 1.0, s.priced_overlap, *([1.0] * world)])
    scale = np.array([max(wall / 10, 1e-3), max(s.micro_batch_overhead_ms, 1e-3), 1.0, 1.0, *([1.0] * world)])
    return theta0, scale


def host_contention(observations: Sequence[StepObservation]) -> float:
    """Wall seconds per busy second in the compute regions, the median over ranks and steps (>= 1)."""
    ratios = [w / b for o in observations if o.busy_wall_s is not None for w, b in zip(o.busy_wall_s, o.busy_s) if b > 0]
    return max(1.0, float(np.median(ratios))) if ratios else 1.0


def _calibration(cluster: Cluster, theta: np.ndarray, even: Prices, steps: int, fitted_on: str,
                 contention: float = 1.0, mode: Schedule | None = None,
                 shard_groups: tuple[int, ...] | None = None) -> Calibration:
    return Calibration(
        step_overhead_ms=float(theta[0]), micro_batch_overhead_ms=float(theta[1]), allgather_ms=float(theta[2] * even.ag),
        reduce_scatter_ms=float(theta[2] * even.rs), overlap=float(theta[3]),
        compute_scale=tuple(float(v) for v in theta[4:]), host_contention=contention, steps=steps, fitted_on=fitted_on,
        mode=mode, shard_groups=shard_groups)


def _clip(theta: np.ndarray) -> np.ndarray:
    out = theta.copy()
    out[0:3] = np.maximum(out[0:3], 0.0)
    out[3] = min(max(out[3], 0.0), 1.0)
    out[4:] = np.maximum(out[4:], 1e-3)
    return out


def predicted(cluster: Cluster, plan: Plan) -> tuple[float, list[float]]:
    """The plan's predicted step (s, the slowest rank's) and every rank's busy seconds on ``cluster``."""
    step, _, _ = evaluate_arrays(cluster, plan.batch_sizes, [r.num_micro_batches for r in plan.ranks],
                                 plan.state_shares, [r.recompute for r in plan.ranks], plan.mode,
                                 shard_groups=[r.shard_group for r in plan.ranks])
    return float(step.max()), predicted_busy_s(cluster, plan)


def predicted_collective_s(cluster: Cluster, plan: Plan) -> float:
    """Seconds per step the cost model spends blocked in collectives (beyond the compute they
    overlap), on the rank blocked least: what :attr:`StepObservation.collective_s` measures."""
    groups = [r.shard_group for r in plan.ranks]
    cluster = calibrated(cluster, groups)
    prices, exposed = collective_ms(cluster, plan.state_shares, groups)
    costs, of_rank = kind_costs(cluster, plan.mode)
    b = np.array(plan.batch_sizes)
    n = np.array([max(r.num_micro_batches, 1) for r in plan.ranks])
    keep = np.array([not r.recompute for r in plan.ranks])
    least = min(float(costs[of_rank[i]].blocked_ms(b[i:i + 1], n[i:i + 1], prices.at(i), keep[i:i + 1])[0])
                + exposed[i] for i in range(len(plan.ranks)))
    return cluster.settings.host_contention * cluster.model.num_layers * least / 1e3


def fit_calibration(cluster: Cluster, observations: Sequence[StepObservation], fitted_on: str = "") -> Calibration:
    """The calibration whose cost model best predicts ``observations`` (least squares, see the module)."""
    if not observations:
        raise PlanningError("calibration needs at least one measured step; run some steps first")
    world = cluster.world_size
    for o in observations:
        if len(o.busy_s) != world or len(o.plan.ranks) != world:
            raise PlanningError(f"a measured step has {len(o.busy_s)} ranks' busy times for a cluster of {world}; "
                                "measure every rank")
        if o.plan.pipelined:
            raise PlanningError("a calibration fits the cost model of plans without pipelines; a measured step of a "
                                "pipelined plan cannot calibrate it: calibrate on a plan without pipelines "
                                "(plan with pipelines=False, or --no-pipelines)")
    base = with_calibration(cluster, None)
    comm = communication(base)
    even = Prices(comm.allgather_ms, comm.reduce_scatter_ms)  # the fitted factor scales both
    theta0, scale = _start(base, observations)
    plans = list({id(o.plan): o.plan for o in observations}.values())
    # the collectives fitted are those of the plans' schedule: their mode and grouping (None: several)
    modes = {p.mode for p in plans}
    mode = modes.pop() if len(modes) == 1 else None
    groups = [tuple(r.shard_group for r in p.ranks) for p in plans]
    grouping = groups[0] if all(same_grouping(g, groups[0]) for g in groups) else None
    index = {id(p): i for i, p in enumerate(plans)}
    walls = np.array([o.wall_s for o in observations])
    busys = np.array([o.busy_s for o in observations], dtype=float)
    which = np.array([index[id(o.plan)] for o in observations])
    steps = len(observations)
    contention = host_contention(observations)
    collective = np.array([np.nan if o.collective_s is None else o.collective_s for o in observations])
    measured_comm = np.isfinite(collective) & (collective > 0)
    base_weight = np.sqrt(steps * (world + 1))
    weight = PRIOR_WEIGHT * base_weight  # the prior's pull per term, set per stage below
    anchor = theta0  # and where it pulls to

    def residuals(theta: np.ndarray) -> np.ndarray:
        model = with_calibration(base, _calibration(base, theta, even, 0, "", contention, mode, grouping))
        priced = [predicted(model, p) for p in plans]
        step = np.array([priced[k][0] for k in which])
        busy = np.array([priced[k][1] for k in which])
        r_wall = (step - walls) / np.maximum(walls, 1e-12)
        r_busy = (busy - busys) / np.maximum(busys, 1e-12)
        r_busy = np.where(busys > 0, r_busy, 0.0)  # a rank with nothing to compute says nothing of its speed
        parts = [r_wall, r_busy.ravel()]
        if measured_comm.any():
            comm = np.array([predicted_collective_s(model, p) for p in plans])[which]
            parts.append(np.where(measured_comm, (comm - collective) / np.where(measured_comm, collective, 1.0), 0.0))
        return np.concatenate([*parts, weight * (theta - anchor) / scale])

    # stage 1 holds the collectives and the overlap near the profile's (what one plan's steps cannot
    # tell from the fixed overhead goes to the overhead); stage 2 frees them where the data decide
    # (measured collective spans fix the collectives themselves: only the overlap is held then)
    theta = theta0.copy()
    held_collectives = PRIOR_WEIGHT if measured_comm.any() else HELD_WEIGHT
    for weights in (np.array([PRIOR_WEIGHT, PRIOR_WEIGHT, held_collectives, HELD_WEIGHT, *[PRIOR_WEIGHT] * world]),
                    np.full(len(theta0), PRIOR_WEIGHT)):
        weight = weights * base_weight
        anchor = theta.copy()  # stage 2 is pulled towards stage 1's terms: it moves what the data decide
        theta = _least_squares(residuals, theta, scale)
    return _calibration(base, theta, even, steps, fitted_on, contention, mode, grouping)


def _least_squares(residuals: Any, theta: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Gauss-Newton with Levenberg-Marquardt damping, each term kept in its range (see :func:`_clip`)."""
    damping = 1e-3
    r = residuals(theta)
    cost = float(r @ r)
    for _ in range(_ITERATIONS):
        jac = np.empty((len(r), len(theta)))
        for j in range(len(theta)):
            h = _STEP * scale[j]
            bumped = theta.copy()
            bumped[j] += h
            if j == 3 and bumped[j] > 1.0:  # overlap: difference inwards at its bound
                bumped[j], h = theta[j] - h, -h
            jac[:, j] = (residuals(bumped) - r) / h
        gram, grad = jac.T @ jac, jac.T @ r
        improved = False
        while damping < 1e12:
            delta = np.linalg.solve(gram + damping * np.diag(np.diag(gram) + 1e-18), -grad)
            trial = _clip(theta + delta)
            r_trial = residuals(trial)
            c_trial = float(r_trial @ r_trial)
            if c_trial < cost:
                improved = cost - c_trial > 1e-15 * max(cost, 1e-30)
                theta, r, cost, damping = trial, r_trial, c_trial, max(damping / 10, 1e-12)
                break
            damping *= 10
        if not improved:
            break
    return theta


def plan_label(plan: Plan) -> str:
    """A short name of a plan, for the calibration's ``fitted_on`` and logs."""
    micro = [r.num_micro_batches for r in plan.ranks]
    return f"B={plan.global_batch_size} {plan.mode} b={list(plan.batch_sizes)} n={micro}"
