"""Pipelined plans in the runtime (no Lightning): stages of layers over gloo ranks train like one process.

One spawn of four gloo ranks runs every scenario: Hugging Face Llama and GPT-2 (its embedding tied to
its head, so held by the first and the last stage) built from tiny configs, on right-padded batches
whose loss is a mean over the label tokens, AdamW in fp64; 2 stages x 2 pipelines with uneven
batches, micro-batch counts and state shares inside each stage, and 4 stages x 1 pipeline; GPipe and
1F1B. Each is compared with single-process training on the same global batches
(tests/reference.train_steps through tests/library_models.reference), and every point-to-point
transfer is matched with its pair.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cephalo_lightning._common.vocabulary import PipelineSchedule
from cephalo_lightning.runtime.pipelining.schedule import Pass, in_flight, simulate, stage_actions
from cephalo_lightning.runtime.pipelining.stages import PipelineLayout
from tests.distributed import run_distributed
from tests.library_models import pipeline_reference

STEPS, GLOBAL = 2, 8
GPIPE, ONE_F_ONE_B = PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B
# name: (family, stage_layers, pipelines (ranks by stage), shares (per rank), batches, micro-batches, schedule)
# Llama and GPT-2 from tests/library_models.build have 4 layers as the layered protocol sees them:
# the embedding, two blocks, the final norm with the head. Pipelines with one micro-batch count run layer
# by layer (each layer gathered, recomputed and reduced per micro-batch), the others gather each stage
# once a step.
SCENARIOS = {
    "llama-2x2": ("llama", (1, 3), ((0, 2), (1, 3)), (0.3, 0.7, 0.6, 0.4), (5, 3), (3, 2), ONE_F_ONE_B),
    "gpt2-2x2": ("gpt2", (3, 1), ((1, 3), (0, 2)), (0.55, 0.45, 0.2, 0.8), (2, 6), (2, 4), GPIPE),
    "llama-2x2-layers": ("llama", (2, 2), ((0, 2), (1, 3)), (0.3, 0.7, 0.6, 0.4), (5, 3), (2, 2), ONE_F_ONE_B),
    "gpt2-2x2-layers": ("gpt2", (3, 1), ((1, 3), (0, 2)), (0.55, 0.45, 0.2, 0.8), (3, 5), (3, 3), GPIPE),
    "llama-4": ("llama", (1, 1, 1, 1), ((0, 1, 2, 3),), (1.0, 1.0, 1.0, 1.0), (8,), (3,), ONE_F_ONE_B),
    "gpt2-4": ("gpt2", (1, 1, 1, 1), ((3, 2, 1, 0),), (1.0, 1.0, 1.0, 1.0), (8,), (4,), GPIPE),
}
CLIP = {"gpt2-2x2": 0.05, "llama-4": 0.05, "gpt2-2x2-layers": 0.05}  # global-norm clipping: over every stage, a tied weight once
# [Note: library-model bounds] as tests/lightning/test_shard_groups_fit.py: four steps of fp64's grid
# above 1, or where larger FLOOR_FACTOR x the noise floor (single-process training cut into the
# pipelines' micro-batches, each summed loss over the batch's tokens, against the whole batch).
EXACT = 4 * torch.finfo(torch.float64).eps
FLOOR_FACTOR = 2


# ----------------------------------------------------------------------------- schedules and layouts


@pytest.mark.parametrize("schedule", list(PipelineSchedule))
def test_every_schedule_runs_each_micro_batch_once_each_way_without_deadlock(schedule):
    for stages in range(1, 6):
        for m in range(1, 7):
            order = simulate(schedule, stages, m)
            for s in range(stages):
                actions = stage_actions(schedule, s, stages, m)
                assert sorted((a.kind.value, a.micro_batch) for a in actions) == sorted(
                    [("F", k) for k in range(m)] + [("B", k) for k in range(m)])
                done = [a for stage, a in order if stage == s]
                assert all(done.index(type(a)(Pass.FORWARD, a.micro_batch)) < done.index(a)
                           for a in done if a.kind is Pass.BACKWARD)
                bound = m if schedule is GPIPE else min(m, stages - s)
                assert in_flight(actions) == bound


@pytest.mark.parametrize("schedule", list(PipelineSchedule))
def test_the_planner_prices_the_turns_the_runtime_takes(schedule):
    """The planner's count of a stage's forward-to-backward and backward-to-forward turns (where the
    runtime keeps a layer gathered) is the runtime schedule's, for every stage, stage count and M."""
    from cephalo_lightning.planner.cost.pipeline_cost import turns

    for S in range(1, 6):
        for M in range(1, 8):
            for stage in range(S):
                kinds = [a.kind for a in stage_actions(schedule, stage, S, M)]
                pairs = list(zip(kinds, kinds[1:]))
                want = (pairs.count((Pass.FORWARD, Pass.BACKWARD)), pairs.count((Pass.BACKWARD, Pass.FORWARD)))
                assert turns(schedule, M, S, stage) == want, (schedule, S, M, stage)


def _plan(stage_layers, rows):
    ranks = [SimpleNamespace(rank=i, stage=s, pipeline=d, batch_size=b, num_micro_batches=m, state_share=sh,
                             shard_group=s, idle=False) for i, (s, d, b, m, sh) in enumerate(rows)]
    return SimpleNamespace(stage_layers=stage_layers, ranks=ranks, pipeline_schedule=GPIPE)


def _plan_file(idle: bool = False):
    """A plan file's plan (format 5): two pipelines of two stages, stage 0 on ranks 0, 1, stage 1 on 2, 3."""
    from cephalo_lightning.planner import ModelSummary, Plan, RankPlan

    rows = [(5, 2, 0.4, 0, 0), (3, 1, 0.6, 0, 1), (5, 2, 1.0 / 3, 1, 0), (3, 1, 2.0 / 3, 1, 1)]
    ranks = [RankPlan(i, "a100-40gb", b, m, -(-b // m), share, stage=stage, pipeline=d, shard_group=stage)
             for i, (b, m, share, stage, d) in enumerate(rows)]
    if idle:
        ranks.append(RankPlan(4, "rtx3090", 0, 1, 0, 0.0, idle=True))
    return Plan(8, "layered", tuple(ranks), stage_layers=(2, 3), pipeline_schedule=GPIPE,
                model=ModelSummary(num_layers=5))


def test_a_layout_from_a_plan_puts_every_rank_and_layer_where_the_plan_says():
    layout = PipelineLayout.of(_plan_file(), 5)
    assert layout.pipelines == ((0, 2), (1, 3)) and layout.batch_sizes == (5, 3) and layout.micro_batches == (2, 1)
    assert list(layout.layer_range(0)) == [0, 1] and list(layout.layer_range(1)) == [2, 3, 4]
    assert layout.stage_ranks(1) == (2, 3) and layout.samples(1) == range(5, 8)
    assert layout.neighbours(2) == (0, None) and layout.micro_batch_sizes(0) == [3, 2]
    assert layout.schedule is GPIPE


def test_every_rank_of_a_pipeline_samples_its_pipelines_part_of_the_global_batch():
    """What the planned sampler cuts for each rank (Plan.samples_of) is the layout's pipeline's range."""
    plan = _plan_file()
    layout = PipelineLayout.of(plan, 5)
    for rank in range(4):
        rows = layout.samples(layout.pipeline_of(rank))
        assert plan.samples_of(rank) == (rows.start, len(rows))
    assert sum(plan.samples_of(chain[0])[1] for chain in plan.pipelines) == plan.global_batch_size


def test_a_plan_with_idle_ranks_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"ranks \[4\] are idle.*launch only the plan's busy ranks"):
        PipelineLayout.of(_plan_file(idle=True), 5)


@pytest.mark.parametrize(("rows", "layers", "problem"), [
    ([(0, 0, 4, 2, 1.0), (1, 0, 4, 1, 1.0)], 5, "a pipeline's ranks share its batch"),
    ([(0, 0, 4, 2, 1.0), (1, 0, 4, 2, 1.0)], 6, "re-plan for this model"),
    ([(0, 0, 4, 2, 1.0), (0, 0, 4, 2, 1.0)], 5, "one rank per stage"),
    ([(0, 0, 4, 2, 0.5), (1, 0, 4, 2, 1.0)], 5, "make them sum to 1"),
])
def test_a_plan_this_runtime_cannot_run_is_refused_with_the_fix(rows, layers, problem):
    with pytest.raises(ValueError, match=problem):
        PipelineLayout.of(_plan((2, 3), rows), layers)


# ----------------------------------------------------------------------------- on the ranks


def _train(rank: int, name: str) -> dict:
    from cephalo_lightning.models.hf import adapt
    from cephalo_lightning.runtime.batching import micro_batches
    from cephalo_lightning.runtime.pipelining.runner import PipelineRunner
    from tests.library_models import PaddedTokens, build
    from tests.reference import make_optimizer

    family, stage_layers, pipelines, shares, batches, micro, schedule = SCENARIOS[name]
    layout = PipelineLayout(stage_layers, pipelines, shares, batches, micro, schedule)
    lm = build(family).to(torch.float64)
    initial = {n: p.detach().clone() for n, p in lm.named_parameters()}
    layered, why = adapt(lm)
    assert layered is not None, why
    weighting = layered.weighting
    runner = PipelineRunner(lm, layered.layers, layout, prepare=layered.prepare, loss=weighting.share,
                            items=weighting.count, record_collectives=True)
    optimizer = make_optimizer(runner.parameters())
    data = PaddedTokens(GLOBAL * STEPS)
    d = layout.pipeline_of(rank)
    rows = layout.samples(d)
    parts = [micro_batches(data.batch(step * GLOBAL + rows.start, step * GLOBAL + rows.stop),
                           layout.micro_batch_sizes(d)) for step in range(STEPS)]
    evaluated = runner.evaluate(parts[0]).item()
    losses = []
    for step in range(STEPS):
        losses.append(runner.train_step(parts[step]).item())
        if name in CLIP:
            runner.clip_grad_norm_(CLIP[name])
        optimizer.step()
        optimizer.zero_grad()
    ties = {tie.name: [p.detach().clone() for n, p in runner.named_parameters() if n == tie.name][0]
            for tie in runner.ties}
    mine = {id(p) for p in runner.sharded.module.parameters()}
    first = {id(p) for m in layered.layers[0].modules for p in m.parameters()}
    foreign = [n for n, p in lm.named_parameters(remove_duplicate=False)
               if not p.is_meta and id(p) not in mine and (runner.stage == 0 or id(p) not in first)]
    collectives = list(runner.sharded.comm.log)
    trained = runner.model_state_dict()
    runner.load_model_state_dict(initial)
    reloaded = runner.model_state_dict()
    return {"states": trained, "log": runner.transfers.log, "losses": losses, "stage": runner.stage,
            "ties": ties, "foreign": foreign, "evaluated": evaluated, "collectives": collectives,
            "reloaded": set(reloaded) == set(initial) and all(torch.equal(reloaded[k], v) for k, v in initial.items())}


def _scenarios(rank: int, world: int) -> dict:
    return {name: _train(rank, name) for name in SCENARIOS}


@pytest.fixture(scope="module")
def runs():
    pytest.importorskip("transformers")
    return run_distributed(_scenarios, 4)


# ----------------------------------------------------------------------------- the checks


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_pipelined_layout_trains_like_one_process(runs, name):
    family, _, pipelines, _, batches, micro, _ = SCENARIOS[name]
    layout = PipelineLayout(*SCENARIOS[name][1:])
    clip = CLIP.get(name)
    want = pipeline_reference(family, STEPS, GLOBAL, clip=clip)
    cut = pipeline_reference(family, STEPS, GLOBAL, tuple(n for d in range(len(pipelines)) for n in layout.micro_batch_sizes(d)),
                             clip)
    floor = max((cut[k] - v).abs().max().item() for k, v in want.items())
    bound = max(EXACT, FLOOR_FACTOR * floor)
    got = runs[0][name]["states"]
    for rank, result in enumerate(runs):  # the whole model on every rank, the same bits
        assert all(torch.equal(result[name]["states"][k], v) for k, v in got.items()), f"{name}: rank {rank} differs"
    # every parameter once, under its name and shape in the model (GPT-2's head weight is its embedding's)
    assert {k: tuple(v.shape) for k, v in got.items()} == {k: tuple(v.shape) for k, v in want.items()}
    err = max((got[k] - v).abs().max().item() for k, v in want.items())
    print(f"{name}: largest difference {err:.3e} (noise floor {floor:.3e}, bound {bound:.3e})")
    assert err <= bound, f"{name}: parameters differ from one process's by {err:.2e} > {bound:.2e} (floor {floor:.2e})"
    losses = {tuple(r[name]["losses"]) for r in runs}
    assert len(losses) == 1, f"{name}: every rank returns the same global loss, got {losses}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_transfer_is_received_once_by_its_neighbour(runs, name):
    layout = PipelineLayout(*SCENARIOS[name][1:])
    for rank, result in enumerate(runs):
        before, after = layout.neighbours(rank)
        log = result[name]["log"]
        m = layout.micro_batches[layout.pipeline_of(rank)]
        count = {Pass.FORWARD: m * (STEPS + 1), Pass.BACKWARD: m * STEPS}  # one evaluation, then the steps
        expected = []
        for peer, kind, sent in ((after, Pass.FORWARD, True), (after, Pass.BACKWARD, False),
                                 (before, Pass.FORWARD, False), (before, Pass.BACKWARD, True)):
            if peer is not None:
                expected += [(sent, peer, kind)] * count[kind]
        assert sorted(((t.sent, t.peer, t.kind.value) for t in log)) == sorted((s, p, k.value) for s, p, k in expected)
        for t in log:  # its pair on the peer: the same micro-batch and shape, the other way
            pair = [u for u in runs[t.peer][name]["log"] if u.peer == rank and u.kind is t.kind
                    and u.micro_batch == t.micro_batch and u.sent is not t.sent]
            assert pair and all(u.shape == t.shape for u in pair), f"{name}: rank {rank}'s {t} has no pair"


@pytest.mark.multiprocess
def test_a_weight_tied_across_the_first_and_last_stages_is_held_by_both_alike(runs):
    for name in ("gpt2-2x2", "gpt2-2x2-layers", "gpt2-4"):
        held = {r[name]["stage"]: list(r[name]["ties"]) for r in runs if r[name]["ties"]}
        layout = PipelineLayout(*SCENARIOS[name][1:])
        assert set(held) == {0, layout.num_stages - 1}, f"{name}: the tie is held by stages {sorted(held)}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_rank_stores_no_other_stages_parameters(runs, name):
    """Another stage's layers are meta on this rank (the first layer aside, which prepare may run)."""
    for rank, result in enumerate(runs):
        assert not result[name]["foreign"], f"{name}: rank {rank} holds {result[name]['foreign'][:3]}"


def test_a_parameter_outside_every_layer_is_refused_by_name():
    from torch import nn

    from cephalo_lightning.runtime.pipelining.runner import PipelineRunner

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model.scale = nn.Parameter(torch.ones(1))
    layout = PipelineLayout((1, 1), ((0, 1),), (1.0, 1.0), (2,), (1,))
    with pytest.raises(ValueError, match=r"outside every layer \(\['scale'\]\).*put the modules"):
        PipelineRunner(model, list(model), layout, prepare=None, loss=None, items=None)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_stage_loads_a_whole_model_state_and_the_pipeline_validates_like_one_process(runs, name):
    """A non-pipelined run's parameters load into the stages (and come back the same bits); the
    pipeline's forward alone gives every rank the global batch's loss under the initial parameters."""
    from tests.library_models import LibraryLM, PaddedTokens

    assert all(result[name]["reloaded"] for result in runs)
    module = LibraryLM(SCENARIOS[name][0], "adamw").to(torch.float64)
    with torch.no_grad():
        want = module.training_step(PaddedTokens(GLOBAL * STEPS).batch(0, GLOBAL), 0).item()
    for rank, result in enumerate(runs):  # Hugging Face's loss runs in fp32 whatever the model's dtype
        assert result[name]["evaluated"] == pytest.approx(want, rel=1e-6), f"{name}: rank {rank}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_ranks_of_a_stage_issue_the_same_collectives_in_the_same_order(runs, name):
    """Whatever their batches, micro-batch counts and shares (a stage of one rank gathers nothing)."""
    layout = PipelineLayout(*SCENARIOS[name][1:])
    for stage in range(layout.num_stages):
        ranks = layout.stage_ranks(stage)
        logs = [runs[r][name]["collectives"] for r in ranks]
        assert all(log == logs[0] for log in logs), f"{name}: stage {stage}'s ranks {ranks} differ"
        gathers = sum(1 for entry in logs[0] if entry[0] == "all_gather")
        assert (gathers > 0) == (len(ranks) > 1), f"{name}: stage {stage} logged {gathers} all-gathers"
        # each layer's gradient reduced once a step, or once a micro-batch where the stage runs layer by layer
        per_step = layout.micro_batches[0] if len(set(layout.micro_batches)) == 1 and len(ranks) > 1 else 1
        reductions = sum(1 for entry in logs[0] if entry[0] == "reduce_scatter")
        assert reductions == STEPS * per_step * layout.stage_layers[stage], f"{name}: stage {stage}: {reductions}"
        if len(ranks) > 1:  # an evaluation and STEPS training steps
            assert gathers == _gathers(layout, stage, per_step > 1), f"{name}: stage {stage} logged {gathers} all-gathers"


def _gathers(layout: PipelineLayout, stage: int, layer_by_layer: bool) -> int:
    """All-gathers of a stage's layers in one evaluation and STEPS training steps: once a step gathered
    once; layer by layer, each layer twice a micro-batch (once forward only) less one at every turn of the
    schedule between a forward and a backward ([Note: a layer kept over a turn])."""
    layers, M = layout.stage_layers[stage], layout.micro_batches[0]
    if not layer_by_layer:
        return (1 + STEPS) * layers
    actions = stage_actions(layout.schedule, stage, layout.num_stages, M)
    turns = sum(1 for a, b in zip(actions, actions[1:]) if a.kind is not b.kind)
    return layers * M + STEPS * (2 * layers * M - turns)
