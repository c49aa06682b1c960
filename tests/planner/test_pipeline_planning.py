"""Pipelined plans and subsets in the planner, against brute force and analytic values.

Each test fails on a plausible mistake: a wrong stage boundary (the cuts against every cut), a
mispriced bubble or in-flight stash (the closed forms), a pipelined plan chosen when slower, and a
subset ignored when faster (every subset of a small cluster planned on its own).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest

from cephalo_lightning._common.units import GIB
from cephalo_lightning._common.vocabulary import PipelineSchedule
from cephalo_lightning.planner import Plan, PlanningError, cluster_from_dict, plan
from cephalo_lightning.planner.cost.pipeline_cost import (
    PipelineCost,
    PipelineShape,
    bubble_fraction,
    exposed_hops_ms,
    in_flight,
)
from cephalo_lightning.planner.search.pipeline.cuts import best_cuts
from cephalo_lightning.planner.search.pipeline.layouts import StageLayout, stage_layouts
from cephalo_lightning.planner.search.pipeline.pipeline_search import best_for, price_cut
from cephalo_lightning.planner.search.subsets import candidate_subsets, sub_cluster
from cephalo_lightning.runtime.pipelining.schedule import Pass, stage_actions  # torch-free: the runtime's order

FWD, BWD = [4.0, 7.0, 10.0], [8.0, 15.0, 21.0]  # one layer's ms at micro-batch 1, 2, 3 (linear beyond)


def device(name: str, memory_gb: float = 16.0, scale: float = 1.0, **extra: Any) -> dict[str, Any]:
    return {"name": name, "memory_gb": memory_gb, "layer_fwd_ms": [scale * f for f in FWD],
            "layer_bwd_ms": [scale * b for b in BWD], "compute_memory_gb": [0.5, 0.6, 0.7], **extra}


def cluster(nodes: list[list[dict[str, Any]]], layers: int = 6, parameters: int = 60_000_000, **settings: Any):
    links = {} if settings.get("free_links") else {"link_bandwidth": "16 GB/s per rank",
                                                    "inter_node_bandwidth": "1 Gbit/s per link"}
    return cluster_from_dict({
        "model": {"name": "m", "num_layers": layers, "parameters": parameters, "hidden_size": 1024, "seq_len": 512},
        "settings": {**links, "reserved_memory_gb": 0.5, **settings},
        "nodes": [{"devices": node} for node in nodes]})


# ----------------------------------------------------------------------------- the cuts


@pytest.mark.parametrize("seed", range(6))
def test_the_dynamic_programme_finds_the_cut_every_cut_would(seed: int) -> None:
    import random
    rng = random.Random(seed)
    L, S = 7, 3
    table = {(s, n): (math.inf if rng.random() < 0.15 else rng.uniform(1, 10) * n) for s in range(S) for n in range(1, L)}
    found = best_cuts(L, S, lambda s, n: table[s, n])
    every = [c for c in itertools.product(range(1, L), repeat=S) if sum(c) == L]
    best = min(max(table[s, n] for s, n in enumerate(c)) for c in every)
    if math.isinf(best):
        assert found is None
    else:
        assert found is not None and found[1] == best
        assert max(table[s, n] for s, n in enumerate(found[0])) == best and sum(found[0]) == L


def test_the_chosen_cut_prices_no_slower_than_any_other_cut_of_the_same_pipelines() -> None:
    """Stage 0 on a device twice as slow: the best cut gives it fewer layers, and pricing every cut
    whole (the step, memory included) finds none faster."""
    c = cluster([[device("slow", scale=2.0)], [device("fast")]], layers=8, free_links=True)
    layout = StageLayout(((0, 1),), ())
    found = best_for(c, layout, (6,), 3)
    assert found is not None and found.stage_layers[0] < found.stage_layers[1]
    shape = found.shape
    steps = {cut: price_cut(c, shape, found.schedule, cut, layout) for cut in
             [(a, 8 - a) for a in range(1, 8)]}
    fitting = [p.step_ms for p in steps.values() if all(s.fits for s in p.stages)]
    assert found.step_ms == pytest.approx(min(fitting), rel=1e-12)


# ----------------------------------------------------------------------------- bubble and memory


def test_the_step_is_the_bubble_times_the_slowest_micro_step() -> None:
    """Two stages of 3 layers on identical devices, free links: every micro-step is
    3 (F + F + B) + c at m = 2, and the step is (M + S - 1) of them."""
    c = cluster([[device("a")], [device("a")]], free_links=True, micro_batch_overhead_ms=1.0)
    M, S, m = 4, 2, 2
    cost = PipelineCost(c, PipelineShape(((0, 1),), (M * m,), M), PipelineSchedule.ONE_F_ONE_B)
    stages = [cost.stage(0, 3), cost.stage(1, 3)]
    micro = 3 * (FWD[m - 1] + FWD[m - 1] + BWD[m - 1]) + 1.0
    assert stages[0].micro_step_ms[0] == pytest.approx(micro)
    assert cost.step_ms(stages) == pytest.approx((M + S - 1) * micro)
    assert bubble_fraction(M, S) == pytest.approx(1 / 5)


def test_in_flight_activations_follow_the_schedule() -> None:
    """GPipe holds all M micro-batches' stash, 1F1B min(M, S - s) on stage s."""
    c = cluster([[device("a", 40.0)], [device("a", 40.0)], [device("a", 40.0)]], layers=6, free_links=True)
    M, m, layers = 5, 2, 2
    shape = PipelineShape(((0, 1, 2),), (M * m,), M)
    act = 512 * 1024 * 2  # seq_len x hidden x 2 bytes
    assert [in_flight(PipelineSchedule.ONE_F_ONE_B, M, 3, s) for s in range(3)] == [3, 2, 1]
    gpipe = PipelineCost(c, shape, PipelineSchedule.GPIPE)
    ofob = PipelineCost(c, shape, PipelineSchedule.ONE_F_ONE_B)
    for s, held in enumerate((3, 2, 1)):
        difference = gpipe.stage(s, layers).memory_gb[0] - ofob.stage(s, layers).memory_gb[0]
        assert difference == pytest.approx((M - held) * m * layers * act / GIB)
    # the absolute figure: compute memory, the stash, the reserve and the stage's whole state (one rank)
    state = (16 * 60_000_000 * layers / 6 + 2 * 10_000_000 * 4) / GIB
    expected = 0.6 + 3 * m * layers * act / GIB + 0.5 + state
    assert ofob.stage(0, layers).memory_gb[0] == pytest.approx(expected)


def test_point_to_point_sends_cross_the_slow_link_at_its_price() -> None:
    c = cluster([[device("a")], [device("a")]], inter_node_latency_ms=0.5)
    M, m = 2, 3
    cost = PipelineCost(c, PipelineShape(((0, 1),), (M * m,), M), PipelineSchedule.ONE_F_ONE_B)
    act = 512 * 1024 * 2
    per_rank = 1 / 8  # GB/s: 1 Gbit/s per link, one rank a node
    one_way = m * act / (per_rank * 1e9) * 1e3 + 0.5
    assert cost.sends_ms(0)[0] == pytest.approx(one_way)  # activations forward
    assert cost.sends_ms(1)[0] == pytest.approx(one_way)  # their gradients back
    assert cost.cross_node_bytes() == 2 * M * m * act


def timed_schedule(schedule: PipelineSchedule, M: int, f: list[float], b: list[float], hops: list[float]) -> float:
    """The step of the runtime's action order (``stage_actions``) run event by event: stage s computes a
    forward in f[s] and a backward in b[s], one at a time in its order; a forward waits for the stage
    before's output and a backward for the stage after's gradient, each arriving hops[j] after it was
    sent across cut j; sends do not wait."""
    S = len(f)
    plans = [stage_actions(schedule, s, S, M) for s in range(S)]
    at, clock, done = [0] * S, [0.0] * S, {}
    while any(at[s] < len(plans[s]) for s in range(S)):
        moved = False
        for s in range(S):
            if at[s] == len(plans[s]):
                continue
            action = plans[s][at[s]]
            forward = action.kind is Pass.FORWARD
            source = s - 1 if forward else s + 1
            if 0 <= source < S:
                sent = done.get((source, action.kind, action.micro_batch))
                if sent is None:
                    continue
                ready = sent + hops[min(s, source)]
            else:
                ready = 0.0
            clock[s] = max(clock[s], ready) + (f[s] if forward else b[s])
            done[(s, action.kind, action.micro_batch)] = clock[s]
            at[s] += 1
            moved = True
        assert moved, "the schedule deadlocked"
    return max(clock)


@pytest.mark.parametrize("schedule", list(PipelineSchedule))
def test_the_messages_on_the_critical_path_are_the_timed_schedules(schedule: PipelineSchedule) -> None:
    """Equal stages and cuts: (M + S - 1)(f + b) + H is the timed run of the runtime's order, exactly
    (a message hidden behind compute, or one counted per micro-step, would miss it); unequal cuts:
    never below it (the prediction never flatters) and within 15% of it."""
    for S, M in itertools.product(range(2, 6), range(1, 11)):
        for f, b, h in ((1.0, 2.0, 0.3), (1.0, 1.0, 0.9), (2.0, 5.0, 0.05)):
            step = timed_schedule(schedule, M, [f] * S, [b] * S, [h] * (S - 1))
            assert (M + S - 1) * (f + b) + exposed_hops_ms(schedule, M, [h] * (S - 1)) == pytest.approx(step), (S, M)
    import random
    rng = random.Random(0)
    for _ in range(300):
        S, M = rng.randint(2, 6), rng.randint(1, 12)
        hops = [rng.uniform(0.0, 0.6) for _ in range(S - 1)]
        step = timed_schedule(schedule, M, [1.0] * S, [2.5] * S, hops)
        priced = (M + S - 1) * 3.5 + exposed_hops_ms(schedule, M, hops)
        assert step * (1 - 1e-12) <= priced <= 1.15 * step, (S, M, hops)


def test_the_step_prices_the_messages_between_stages_once_on_its_critical_path() -> None:
    """Two stages across the slow link, 1F1B, M = 4: (M + S - 1) t + 2 h + 2 floor(3 / 2) h, h one
    micro-batch's activation over the link's share plus its latency (the sends priced beside each
    micro-step, or not at all, miss it)."""
    c = cluster([[device("a")], [device("a")]], inter_node_latency_ms=0.5)
    M, S, m = 4, 2, 3
    cost = PipelineCost(c, PipelineShape(((0, 1),), (M * m,), M), PipelineSchedule.ONE_F_ONE_B)
    stages = [cost.stage(0, 3), cost.stage(1, 3)]
    h = m * 512 * 1024 * 2 / (1 / 8 * 1e9) * 1e3 + 0.5
    t = max(float(p.micro_step_ms.max()) for p in stages)
    assert t == pytest.approx(float(stages[0].compute_ms[0]))
    assert cost.hops_ms() == pytest.approx([h])
    assert cost.step_ms(stages) == pytest.approx((M + S - 1) * t + 4 * h + max(float(p.optimizer_ms.max()) for p in stages))
    gpipe = PipelineCost(c, cost.shape, PipelineSchedule.GPIPE)
    assert gpipe.step_ms([gpipe.stage(0, 3), gpipe.stage(1, 3)]) == pytest.approx(
        (M + S - 1) * max(t, h) + 2 * h + max(float(p.optimizer_ms.max()) for p in stages))


# ----------------------------------------------------------------------------- the choice


def lab(model: dict[str, Any], **settings: Any):
    return cluster_from_dict({
        "model": model, "settings": {"link_bandwidth": "16 GB/s per rank", "inter_node_bandwidth": "10 Gbit/s per link",
                                     **settings},
        "nodes": [{"devices": [{"name": "a100-40gb", "count": 4}]}, {"devices": [{"name": "rtx3090", "count": 4}]}]})


LLAMA_8B = {"name": "llama-8b", "num_layers": 32, "parameters": 8_030_261_248, "hidden_size": 4096, "seq_len": 2048}
LLAMA_1B = {"name": "llama-1b", "num_layers": 16, "parameters": 1_235_814_400, "hidden_size": 2048, "seq_len": 2048}


def test_the_lab_case_pipelines_across_the_ethernet_and_beats_every_shard_grouping() -> None:
    c = lab(LLAMA_8B)
    chosen = plan(c, 64, pipelines=True, subsets=True)
    shards = plan(c, 64)
    assert chosen.pipelined and chosen.predicted_step_s < shards.predicted_step_s
    assert chosen.baselines["no pipeline"].predicted_step_s == pytest.approx(shards.predicted_step_s)
    # every stage inside one node: the cut between the nodes is a stage boundary
    nodes = c.nodes
    for group in chosen.shard_groups:
        assert len({nodes[r] for r in group}) == 1
    assert Plan.from_dict(chosen.to_dict()) == chosen
    from cephalo_lightning.planner.report import next_line

    said = next_line(chosen, c, "p.json")  # how the Trainer runs it, and what it cannot run yet
    assert said.startswith('next: train with Trainer(strategy=CephaloStrategy(plan="p.json"), devices=4, num_nodes=2) '
                           "and a DataLoader of batch_size=64") and f"between its {len(chosen.pipelines)} pipelines" in said
    assert "--no-pipelines" in said


def test_a_pipelined_plan_is_not_chosen_when_slower() -> None:
    """The 1B model at batch 512 with the collectives hidden: the plan over every rank is the fastest,
    and the pipelined candidate, priced slower, stays a baseline."""
    c = lab(LLAMA_1B, overlap=1.0)
    chosen = plan(c, 512, pipelines=True, subsets=True)
    piped = chosen.baselines["pipelined"]
    assert piped.feasible and piped.predicted_step_s > chosen.predicted_step_s
    assert not chosen.pipelined and not chosen.idle_ranks
    assert chosen.predicted_step_s == pytest.approx(plan(c, 512).predicted_step_s)


@pytest.mark.parametrize("batch", [8, 24])
def test_a_subset_is_chosen_exactly_when_some_subset_planned_alone_is_faster(batch: int) -> None:
    """Brute force: every subset of a three-rank, two-node cluster planned on its own."""
    c = cluster([[device("a"), device("a", scale=1.5)], [device("b", scale=3.0)]], layers=6)
    chosen = plan(c, batch, subsets=True)
    everyone = plan(c, batch)
    alone = []
    for k in range(1, 3):
        for kept in itertools.combinations(range(3), k):
            try:
                alone.append((plan(sub_cluster(c, kept), batch).predicted_step_s, kept))
            except PlanningError:
                pass
    best_step, best_kept = min(alone)
    if best_step < everyone.predicted_step_s:
        assert chosen.predicted_step_s == pytest.approx(best_step)
        assert tuple(r.rank for r in chosen.active_ranks) == best_kept
    else:
        assert chosen.predicted_step_s == pytest.approx(everyone.predicted_step_s) and not chosen.idle_ranks
    assert chosen.baselines["best subset"].predicted_step_s == pytest.approx(best_step)


def test_the_slow_link_makes_the_lone_node_faster_and_the_plan_says_what_the_rest_would_cost() -> None:
    c = lab(LLAMA_1B)
    chosen = plan(c, 64, pipelines=True, subsets=True)
    assert chosen.idle_ranks == (4, 5, 6, 7)
    assert chosen.predicted_step_s <= plan(sub_cluster(c, (0, 1, 2, 3)), 64).predicted_step_s * (1 + 1e-9)
    idle = chosen.ranks[4]
    assert idle.batch_size == 0 and idle.state_share == 0 and "predicts" in idle.why


def test_the_layouts_cut_at_the_node_boundary() -> None:
    c = lab(LLAMA_8B)
    for layout in stage_layouts(c):
        stage_nodes = [{c.nodes[chain[s]] for chain in layout.chains} for s in range(layout.num_stages)]
        assert all(len(n) == 1 for n in stage_nodes)  # a stage's group on one node
        changes = sum(a != b for a, b in zip(stage_nodes, stage_nodes[1:]))
        assert changes == 1  # the nodes are crossed once: at the slow link


def test_the_subsets_of_a_large_cluster_are_its_nodes_and_kinds() -> None:
    c = lab(LLAMA_1B)
    assert candidate_subsets(c) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    small = cluster([[device("a"), device("a")], [device("b")]])
    assert candidate_subsets(small) == [(0,), (2,), (0, 1), (0, 2)]  # the two lone A's are one subset


def test_pipelines_and_subsets_are_refused_in_the_uniform_mode() -> None:
    with pytest.raises(PlanningError, match="layered mode only"):
        plan(lab(LLAMA_1B), 64, mode="uniform", subsets=True)


def test_a_pipelined_plan_predicts_each_rank_its_stage_compute_and_refuses_calibration() -> None:
    from cephalo_lightning.planner.cost.calibration_fit import StepObservation, fit_calibration
    from cephalo_lightning.planner.cost.cluster_cost import predicted_busy_s

    c = lab(LLAMA_8B)
    piped = plan(c, 64, pipelines=True)
    busy = predicted_busy_s(c, piped)
    # each rank's compute is its stage's: every A100 stage's layers on an A100, every RTX 3090 stage's on a 3090
    layers = {r.rank: piped.stage_layers[r.stage] for r in piped.ranks}
    assert min(layers[r] for r in range(4)) > max(layers[r] for r in range(4, 8))  # the faster GPUs, more layers
    by_layers: dict[tuple[str, int], set[float]] = {}
    for r in piped.ranks:
        by_layers.setdefault((r.device, layers[r.rank]), set()).add(round(busy[r.rank], 9))
    assert all(len(values) == 1 for values in by_layers.values())
    assert all(b > 0 for b in busy) and max(busy) < piped.predicted_step_s
    with pytest.raises(PlanningError, match="cannot calibrate it: calibrate on a plan without pipelines"):
        fit_calibration(c, [StepObservation(piped, piped.predicted_step_s, tuple(busy))])


def test_the_pipeline_search_finds_what_brute_force_over_its_space_finds() -> None:
    """Every layout, every micro-batch count and every cut of a small two-node cluster priced whole."""
    from cephalo_lightning.planner.search.pipeline.pipeline_search import near_equal, search_pipelines

    c = cluster([[device("a"), device("a")], [device("b", scale=2.0), device("b", scale=2.0)]], layers=5,
                inter_node_latency_ms=0.2)
    B = 12
    found = search_pipelines(c, B)
    best = math.inf
    for layout in stage_layouts(c):
        batches = near_equal(B, layout.num_pipelines)
        for M in range(1, min(batches) + 1):
            shape = PipelineShape(layout.chains, batches, M)
            for cut in itertools.product(range(1, 6), repeat=layout.num_stages):
                if sum(cut) != 5:
                    continue
                priced = price_cut(c, shape, PipelineSchedule.ONE_F_ONE_B, cut, layout)
                if all(s.fits for s in priced.stages):
                    best = min(best, priced.step_ms)
    assert found is not None and found.step_ms == pytest.approx(best, rel=1e-9)
