"""The pruned pipeline and subset searches against their unpruned selves on random small clusters.

Pruning skips a candidate only where a lower bound on its step is above the best step found, so
the pruned search must return the very candidate the unpruned one does (the same layout, batches,
micro-batches, cut and step; the same subset), ties included. Each test fails on a plausible
mistake: a bound above some candidate's step (a term counted that the cost model may not charge),
a candidate skipped as unfit that fits, and a tie broken in the pruned order instead of the order
listed.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest

from cephalo_lightning._common.vocabulary import Grouping, Schedule
from cephalo_lightning.planner import Plan, PlanningError, cluster_from_dict
from cephalo_lightning.planner.choice import best_subset, subset_bound_s
from cephalo_lightning.planner.cost.calibration import calibrated
from cephalo_lightning.planner.planning import solved_plan, without_fixed_terms
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.search.pipeline.layouts import stage_layouts
from cephalo_lightning.planner.search.pipeline.pipeline_search import (
    PipelineCandidate,
    best_for,
    micro_batch_counts,
    near_equal,
    search_pipelines,
)
from cephalo_lightning.planner.search.pipeline.step_bound import step_bounds
from cephalo_lightning.planner.search.problem import Problem
from cephalo_lightning.planner.search.subsets import candidate_subsets, sub_cluster

SEEDS = range(14)


def random_device(rng: random.Random) -> dict[str, Any]:
    """A device from a pool of four (so equal devices, and equal candidates, occur), its memory at random."""
    kind = rng.randrange(4)
    scale = (1.0, 1.7, 3.0, 0.6)[kind]
    fwd = [scale * f for f in (4.0, 7.0, 10.0)]
    return {"name": f"d{kind}", "memory_gb": rng.choice([1.5, 2.5, 4.0, 16.0]), "layer_fwd_ms": fwd,
            "layer_bwd_ms": [2 * f for f in fwd], "compute_memory_gb": [0.3, 0.5, 0.8]}


def random_cluster(seed: int) -> tuple[Cluster, int]:
    """Two to four ranks on one or two nodes, random settings (overlap, overheads, contention, free links)."""
    rng = random.Random(seed)
    ranks = rng.randint(2, 4)
    devices = [random_device(rng) for _ in range(ranks)]
    split = rng.randint(1, ranks - 1) if rng.random() < 0.5 else ranks
    nodes = [devices[:split], devices[split:]] if split < ranks else [devices]
    settings: dict[str, Any] = {"reserved_memory_gb": 0.2, "micro_batch_overhead_ms": rng.choice([0.0, 0.5, 3.0]),
                                "step_overhead_ms": rng.choice([0.0, 20.0]), "host_contention": rng.choice([1.0, 1.3])}
    if rng.random() < 0.25:
        settings["free_links"] = True
    else:
        settings.update(link_bandwidth="16 GB/s per rank", inter_node_bandwidth="1 Gbit/s per link",
                        inter_node_latency_ms=0.2)
    if rng.random() < 0.5:
        settings["overlap"] = rng.choice([0.0, 0.5, 1.0])
    c = cluster_from_dict({
        "model": {"name": "m", "num_layers": rng.randint(3, 8), "parameters": rng.choice([30_000_000, 300_000_000]),
                  "hidden_size": 1024, "seq_len": 512},
        "settings": settings,
        "nodes": [{"devices": node} for node in nodes]})
    return c, rng.randint(2, 40)


def same_candidate(a: PipelineCandidate | None, b: PipelineCandidate | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.layout, a.shape, a.stage_layers, a.step_ms) == (b.layout, b.shape, b.stage_layers, b.step_ms)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_step_bound_is_below_every_candidates_step_and_skips_only_what_cannot_fit(seed: int) -> None:
    c, B = random_cluster(seed)
    c = calibrated(c)
    for layout in stage_layouts(c):
        if B < layout.num_pipelines:
            continue
        batches = near_equal(B, layout.num_pipelines)
        counts = micro_batch_counts(batches)
        bound, may_fit = step_bounds(c, layout, batches, counts)
        for M, low, fits in zip(counts, bound, may_fit):
            found = best_for(c, layout, batches, M)
            if not fits:
                assert found is None, (layout, M)
            elif found is not None:
                assert low <= found.step_ms * (1 + 1e-12), (layout, M, low, found.step_ms)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_pruned_pipeline_search_keeps_the_unpruned_choice(seed: int) -> None:
    c, B = random_cluster(seed)
    c = calibrated(c)
    assert same_candidate(search_pipelines(c, B), search_pipelines(c, B, prune=False))


def test_the_pruned_pipeline_search_keeps_the_first_of_equal_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four equal ranks on one node: a chain and its reverse price alike, and the one listed first is
    kept, even where the bounds (weaker ones, still valid) put the later one first."""
    from cephalo_lightning.planner.search.pipeline import pipeline_search

    c = cluster_from_dict({"model": {"name": "m", "num_layers": 8, "parameters": 30_000_000, "hidden_size": 1024,
                                     "seq_len": 512},
                           "settings": {"link_bandwidth": "16 GB/s per rank", "micro_batch_overhead_ms": 0.0},
                           "devices": [{**random_device(random.Random(1)), "memory_gb": 16.0, "count": 4}]})
    unpruned = search_pipelines(c, 16, prune=False)
    assert unpruned is not None
    priced = [best_for(c, layout, near_equal(16, layout.num_pipelines), unpruned.shape.num_micro_batches)
              for layout in stage_layouts(c)]
    equal = [p.layout for p in priced if p is not None and p.step_ms == unpruned.step_ms]
    assert len(equal) >= 2 and unpruned.layout == equal[0]  # the case holds a tie
    assert same_candidate(search_pipelines(c, 16), unpruned)
    reversed_order = iter(range(10**6))  # every candidate bounded by a smaller negative number than the last

    def weaker(*args: Any, **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
        bound, fits = step_bounds(*args, **kwargs)
        return -1.0 - np.array([next(reversed_order) for _ in bound], dtype=float), fits

    monkeypatch.setattr(pipeline_search, "step_bounds", weaker)
    assert same_candidate(search_pipelines(c, 16), unpruned)


def subset_solve(B: int) -> Any:
    """The plan over a subset as :func:`.planning.plan` makes it, each subset planned once (the
    searches and the bounds' check ask the same subsets again: the tests' time, not the planner's)."""
    planned: dict[tuple, Plan | PlanningError] = {}

    def solve(over: Cluster) -> Plan:
        if over.devices not in planned:
            try:
                planned[over.devices] = solved_plan(over, Problem(without_fixed_terms(over), B, Schedule.LAYERED),
                                                    tuple(Grouping), baselines=False)
            except PlanningError as error:
                planned[over.devices] = error
        found = planned[over.devices]
        if isinstance(found, PlanningError):
            raise found
        return found
    return solve


@pytest.mark.parametrize("seed", SEEDS)
def test_the_pruned_subset_search_keeps_the_unpruned_choice_and_its_bound_holds(seed: int) -> None:
    c, B = random_cluster(seed)
    solve = subset_solve(B)
    pruned, kept = best_subset(c, solve, B)
    unpruned, kept_unpruned = best_subset(c, solve, B, prune=False)
    assert kept == kept_unpruned
    assert (pruned is None) == (unpruned is None)
    if pruned is not None and unpruned is not None:
        assert pruned.predicted_step_s == unpruned.predicted_step_s and pruned.ranks == unpruned.ranks
    for subset in candidate_subsets(c):
        sub = sub_cluster(calibrated(c), subset)
        try:
            step = solve(sub).predicted_step_s
        except PlanningError:
            continue
        low = subset_bound_s(sub, B)
        assert math.isfinite(low) and low <= step * (1 + 1e-9), (subset, low, step)
