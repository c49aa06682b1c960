"""The public entry: :func:`plan` takes a cluster and a global batch B to a :class:`.Plan`.

The plan minimises the predicted step over the shard groupings weighed (:mod:`.best_grouping`),
then refined where ranks share a host's cores (:mod:`.shared_host`), and carries every baseline's
figures, the upper bound on samples/s and the certified optimality gap step / lower_bound - 1. A
fixed per-step overhead and a host's contention factor (step = contention * solve + overhead)
shift and scale every plan alike, so the solve runs without them and both are applied to the
plan's step and to the proven lower bound (the certified gap only shrinks). Passes synced across a
group (``settings.sync_passes``) only raise a plan's price, so they too are left out of the solve.
"""

from __future__ import annotations

from dataclasses import replace

from cephalo_lightning._common.vocabulary import Planner, Schedule
from cephalo_lightning.planner.choice import choose
from cephalo_lightning.planner.cost.calibration import calibrated
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.plan import Plan
from cephalo_lightning.planner.schema.planning_error import PlanningError
from cephalo_lightning.planner.search.assemble import model_summary, rank_plans
from cephalo_lightning.planner.search.baselines import upper_bound_samples_per_s
from cephalo_lightning.planner.search.best_grouping import solve_groupings
from cephalo_lightning.planner.search.input_checks import check_groupings, check_inputs, check_memory
from cephalo_lightning.planner.search.peers import compute_baselines
from cephalo_lightning.planner.search.problem import Problem
from cephalo_lightning.planner.search.shared_host import SHARED_HOST_REFINE_RANKS, refine_on_shared_host, shared_host_lower_ms
from cephalo_lightning.planner.search.symmetry import symmetrised
from cephalo_lightning.planner.why import explain


def plan(cluster: Cluster, global_batch_size: int, mode: Schedule = Schedule.LAYERED,
         planner: Planner = Planner.CEPHALO,
         groupings: tuple[str, ...] | None = None, pipelines: bool = False, subsets: bool = False) -> Plan:
    """Plan a cluster: shard groups, per-rank batch, micro-batches and state share minimising the step time.

    ``groupings`` names the candidate groupings to weigh (members of
    :class:`~cephalo_lightning._common.vocabulary.Grouping`; None: all of them; ``("full",)``: one
    group of every rank). ``planner`` names a baseline (``even``, ``proportional``, ``poplar``,
    ``reference``, ``ddp-even``, ``hsdp-even``) to return that baseline as a plan instead. The cephalo plan carries every baseline's figures, the upper bound and its
    certified optimality gap (against the best plan over the groupings weighed).

    ``pipelines`` weighs pipelined plans too, ``subsets`` plans that leave ranks idle (layered mode,
    the cephalo planner): the plan is the fastest of those and the plan over every rank, and lists
    each as a baseline (:mod:`.choice`).
    """
    B = check_inputs(cluster, global_batch_size, mode, planner)
    mode, planner = Schedule(mode), Planner(planner)  # their strings are taken too
    names = check_groupings(groupings)
    if planner != Planner.CEPHALO:
        return baseline_plan(cluster, B, mode, planner)
    if (pipelines or subsets) and mode != Schedule.LAYERED:
        raise PlanningError(f"pipelined plans and subsets are weighed in the layered mode only, not {mode}; plan with "
                            "mode layered, or without pipelines and subsets")

    def solve(over: Cluster, baselines: bool = True) -> Plan:
        return solved_plan(over, Problem(without_fixed_terms(over), B, mode), names, baselines=baselines)

    base = solve(cluster)
    if not (pipelines or subsets):
        return base
    return choose(cluster, base, lambda over: solve(over, baselines=False), pipelines, subsets)


def solved_plan(source: Cluster, problem: Problem, groupings: tuple[str, ...], *, baselines: bool = True) -> Plan:
    """The searched plan of ``source`` over the ``groupings`` named, from ``problem``: the problem of
    :func:`without_fixed_terms` of ``source`` (:func:`plan` folds its ranks into kinds), its batch
    and its mode. ``source`` keeps any calibration: each plan is priced as the calibration prices
    its grouping. ``baselines=False`` leaves the baselines out (a subset's plan, whose are not read)."""
    B, mode, cluster = problem.B, problem.mode, calibrated(source)
    upper = upper_bound_samples_per_s(cluster, B, mode)
    fixed_s, contention = cluster.settings.step_overhead_ms / 1e3, cluster.settings.host_contention
    check_memory(problem)
    best, lower_s, _ = solve_groupings(problem, groupings)
    chosen = problem.for_groups(best.groups)  # the chosen grouping's prices (a refinement keeps the groups)
    if cluster.settings.host_cores and problem.W <= SHARED_HOST_REFINE_RANKS:
        best = refine_on_shared_host(chosen, source, best)
    best = symmetrised(chosen, source, best)  # identical ranks, identical work, where no slower
    # the shared-host bound is left out of the solve: it enters the plan's price and the lower bound
    lower_s = max(contention * lower_s + fixed_s, shared_host_lower_ms(problem, cluster) / 1e3)
    ranks, step = rank_plans(source, best.batch, best.micro, best.shares, ~best.keep, mode,
                             kinds=(chosen.costs, chosen.of_rank), shard_groups=best.groups)
    ranks = explain(source, ranks, mode)  # a baseline's batches follow its rule, not a binding: only the plan's
    by_kinds = problem if mode == Schedule.LAYERED and problem.group_kinds else None
    return Plan(
        global_batch_size=B,
        mode=mode,
        ranks=ranks,
        predicted_step_s=step,
        predicted_samples_per_s=B / step,
        upper_bound_samples_per_s=upper,
        model=model_summary(cluster),
        baselines=compute_baselines(source, B, mode, problem=by_kinds) if baselines else {},
        planner=Planner.CEPHALO,
        emulated=cluster.emulated,
        optimality_gap=max(0.0, step / lower_s - 1.0) if lower_s > 0 else None,
    )


def baseline_plan(cluster: Cluster, B: int, mode: Schedule, planner: Planner) -> Plan:
    """A baseline as a plan of its own (the even ones have one micro-batch count, so either mode fits)."""
    if planner not in (Planner.EVEN, Planner.DDP_EVEN, Planner.HSDP_EVEN) and mode == Schedule.UNIFORM:
        raise PlanningError(f"the {planner} baseline picks each rank's micro-batch count, so it has no "
                            f"uniform form; use --mode layered or --planner even")
    result = compute_baselines(cluster, B, mode, names=(planner,), with_ranks=True)[planner]
    if not result.feasible:
        raise PlanningError(f"the {planner} baseline is infeasible: {result.reason}; plan with --planner cephalo, "
                            f"which fits uneven memory, or change what the reason names")
    return Plan(B, mode, result.ranks, result.predicted_step_s, result.predicted_samples_per_s,
                upper_bound_samples_per_s(calibrated(cluster), B, mode), model_summary(cluster),
                planner=planner, emulated=cluster.emulated)


def without_fixed_terms(cluster: Cluster) -> Cluster:
    """The cluster without a fixed per-step overhead, a host's contention factor, a shared host's
    cores (its own or its calibration's) or passes synced across a group, which the solve leaves out."""
    cal = cluster.calibration
    return replace(cluster, settings=replace(cluster.settings, step_overhead_ms=0.0, host_contention=1.0, host_cores=None,
                                             sync_passes=False),
                   calibration=None if cal is None else replace(cal, step_overhead_ms=0.0, host_contention=1.0))
