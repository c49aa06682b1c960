"""Fault tolerance across shard groups with torchft (``cephalo_lightning.lightning.fit.fault_tolerance``).

The scenario (one run for the module, scenarios/ft_worker.py): two shard groups of one gloo rank each
(8 and 4 of the 12 samples of every global batch), a torchft lighthouse on 127.0.0.1; group 1 is
SIGKILLed in step 3 between its forward and its backward (which sums the gradients over the groups);
group 0 goes on in the same process; group 1 is started again and recovers the live state from group 0. The final parameters
of both groups are compared with single-process AdamW on the same 10 global batches in fp64.
The same scenario runs twice: each life a plain loop driving ``ReplicaGroup``, then each life a
``Trainer.fit`` under ``CephaloStrategy(fault_tolerance=True)`` (a tiny Hugging Face Llama with AdamW
on padded dict batches, the instrumented points as a callback). Groups of two ranks run once in
each way (no kill). The refusals need no processes.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cephalo_lightning import CephaloStrategy
from cephalo_lightning._common.errors import ConfigurationError, UnsupportedError
from cephalo_lightning.lightning.fit.fault_tolerance import check_fit, require_torchft, torchft_available
from cephalo_lightning.planner.replica_groups import check_groups_cut_alike, group_plan, survivors_batches
from tests.conftest import HANG_TIMEOUT_S
from tests.distributed import run_distributed
from tests.plans import plan_of
from tests.reference import make_optimizer, sliced, tiny_loss, train_steps, whole
from tests.tiny_lm import TinyLM, batches

needs_torchft = pytest.mark.skipif(not torchft_available(),
                                   reason="torchft is not installed (pip install 'cephalo-lightning[ft]'); "
                                          "these tests run on it")
# measured: max |param - replay| = 2.2e-16 for TinyLM, 2.3e-15 for the Llama under Trainer.fit (the groups'
# partial sums add in another order than the single-process batch); a step skipped, repeated or applied
# with part of its batch is off by ~1e-3 (0.057 when the returning group's step counters are not set)
TOLERANCE = 1e-12
DEADLINE_S = 600  # the whole scenario, on a loaded 2-core machine (about 15 s idle)


def replay(steps: int, global_batch: int) -> dict[str, torch.Tensor]:
    model = TinyLM().double()
    train_steps(make_optimizer(model.parameters()), tiny_loss(model), whole(batches(steps, global_batch)))
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    from scenarios.ft_worker import run_scenario

    return run_scenario(tmp_path_factory.mktemp("ft"), DEADLINE_S)


@needs_torchft
@pytest.mark.multiprocess
def test_the_surviving_group_redoes_the_interrupted_step_alone_in_the_same_process(scenario):
    from scenarios.ft_worker import GLOBAL, KILL_AT, TOTAL

    assert len(scenario.lives(0)) == 1, scenario.logs  # never restarted: one pid for group 0
    (pid,) = scenario.lives(0)
    assert scenario.exit_codes[0, pid] == 0, scenario.logs
    steps = [(e["step"], e["participants"], e["batches"], e["committed"]) for e in scenario.events[0, pid]]
    both, alone = ([0, 1], [8, 4]), ([0], [GLOBAL])
    assert steps[:KILL_AT] == [(s, *both, True) for s in range(KILL_AT)]
    assert steps[KILL_AT] == (KILL_AT, *both, False), steps  # the kill mid-step: nobody commits it
    assert steps[KILL_AT + 1] == (KILL_AT, *alone, True), steps  # redone, the whole global batch on group 0
    committed = [s for s, _, _, ok in steps if ok]
    assert committed == list(range(TOTAL)), steps  # every step once: none skipped, none repeated
    assert all(sum(b) == GLOBAL for _, _, b, _ in steps)
    assert scenario.killed["step"] == KILL_AT


@needs_torchft
@pytest.mark.multiprocess
def test_the_killed_group_comes_back_with_the_live_state_and_takes_its_part_again(scenario):
    from scenarios.ft_worker import KILL_AT, TOTAL, WAIT_AT

    first, again = scenario.lives(1)
    assert scenario.exit_codes[1, first] == -signal.SIGKILL and scenario.exit_codes[1, again] == 0, scenario.logs
    assert [e["step"] for e in scenario.events[1, first]] == list(range(KILL_AT))  # the killed step never logged
    back = scenario.events[1, again]
    # it joined at a step boundary past its own last step: the step and weights came from group 0
    assert back[0]["step"] == WAIT_AT + 1 and back[0]["participants"] == [0, 1] and back[0]["batches"] == [8, 4], back
    assert [e["step"] for e in back] == list(range(back[0]["step"], TOTAL)) and all(e["committed"] for e in back)
    (pid,) = scenario.lives(0)
    after = [e for e in scenario.events[0, pid] if e["step"] >= back[0]["step"]]
    assert all(e["participants"] == [0, 1] for e in after)  # the plan grew back for group 0 too


@needs_torchft
@pytest.mark.multiprocess
def test_both_groups_end_on_the_single_process_replay_of_the_same_global_batches(scenario):
    from scenarios.ft_worker import GLOBAL, TOTAL

    want = replay(TOTAL, GLOBAL)
    assert len(scenario.finals) == 2, scenario.logs  # group 0 and group 1's second life
    for life, got in scenario.finals.items():
        assert set(got) == set(want)
        error = max((got[k] - want[k]).abs().max().item() for k in want)
        assert error <= TOLERANCE, (life, error)


def replay_gradient(step: int, steps: int, global_batch: int) -> dict[str, torch.Tensor]:
    """The single-process gradient of global batch ``step`` at the replay's weights after ``step`` steps."""
    model = TinyLM().double()
    data = batches(steps, global_batch)
    train_steps(make_optimizer(model.parameters()), tiny_loss(model), whole(data[:step]))
    tiny_loss(model)(data[step]).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@needs_torchft
@pytest.mark.multiprocess
def test_the_backward_sums_every_bucket_over_the_groups_once_and_a_redo_starts_from_zero(scenario):
    """The sum runs in the backward, bucket by bucket: a bucket skipped leaves this group's part of the
    gradient (step KILL_AT - 1, both groups), a failed attempt's sum left in the gradients is added to the
    redo's (step KILL_AT, group 0 alone); each is ~1e-2 off the replay's gradient."""
    from scenarios.ft_worker import GLOBAL, KILL_AT, SUMMED_AT, TOTAL

    (pid,) = scenario.lives(0)
    events = scenario.events[0, pid]
    buckets = events[0]["buckets"]
    assert buckets > 1, events  # the units are cut into several buckets
    assert [e["sums"] for e in events] == [buckets] * len(events), events  # one all-reduce a bucket, every attempt
    assert [e["committed"] for e in events if e["step"] == KILL_AT] == [False, True], events
    assert sorted(scenario.grads) == sorted(str(s) for s in SUMMED_AT), scenario.logs
    for step in SUMMED_AT:
        want, got = replay_gradient(step, TOTAL, GLOBAL), scenario.grads[str(step)]
        assert set(got) == set(want)
        error = max((got[k].reshape(want[k].shape) - want[k]).abs().max().item() for k in want)  # local pieces: flat
        assert error <= TOLERANCE, (step, error)


# ----------------------------------------------------------------------------- groups of two ranks (HSDP)

# two groups of two ranks, each sharding the state 0.7 / 0.3 inside and taking 5 + 3 of the group's 8 samples
PLAN4 = plan_of(batches=[5, 3, 5, 3], micro=[1] * 4, shares=[0.7, 0.3, 0.7, 0.3], devices=["cpu"] * 4, groups=[0, 0, 1, 1])
HSDP_STEPS = 4


def _two_groups_of_two(rank: int, world: int, lighthouse: str):
    import torch.distributed as dist
    from torch.distributed import TCPStore

    from cephalo_lightning.lightning.fit.fault_tolerance import ReplicaGroup, Settings
    from cephalo_lightning.planner.replica_groups import rank_slice
    from cephalo_lightning.runtime.distributed import broadcast_object
    from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

    group, local = divmod(rank, 2)
    subgroups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # each group's own ranks: its in-group collectives
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if local == 0 else None
    port = broadcast_object(store.port if store is not None else None, group=subgroups[group])
    model = TinyLM().double()
    sharded = ShardedModel(model, [0.7, 0.3], group=subgroups[group])
    parameters = list(sharded.parameters())
    ft = ReplicaGroup(parameters, make_optimizer(parameters), PLAN4, group,
                      Settings(lighthouse=lighthouse, store_addr="127.0.0.1", store_port=port, hostname="127.0.0.1"),
                      sharded=sharded, rank=local, world_size=2)
    dist.barrier()  # both groups heartbeat before the first quorum
    data, seen = batches(HSDP_STEPS, PLAN4.global_batch_size), []
    while ft.step < HSDP_STEPS:
        part = ft.start_step()
        start, size = rank_slice(part, [5, 3], local)
        x, y = data[part.step]
        loss = model.loss(model(x[start:start + size]), y[start:start + size]) * (size / PLAN4.global_batch_size)
        sharded.backward(loss)  # each unit's shard summed over the groups after its in-group reduce-scatter
        ft.finish_sums()
        assert ft.commit()
        seen.append((part.participants, start, size))
    state = {k: v.clone() for k, v in sharded.full_state_dict().items()}
    ft.shutdown()
    return {"state": state, "seen": seen, "local_numel": sum(p.numel() for p in parameters)}


@needs_torchft
@pytest.mark.multiprocess
def test_groups_of_two_ranks_shard_inside_and_sum_rank_by_rank_across_to_the_replay():
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    try:
        results = run_distributed(_two_groups_of_two, 4, lighthouse.address())
    finally:
        lighthouse.shutdown()
    want = replay(HSDP_STEPS, PLAN4.global_batch_size)
    total = sum(v.numel() for v in want.values())
    for rank, result in enumerate(results):
        assert result["seen"] == [((0, 1), *((0, 5), (5, 3), (8, 5), (13, 3))[rank])] * HSDP_STEPS
        assert 0 < result["local_numel"] < total  # the state is sharded inside the group
        error = max((result["state"][k] - want[k]).abs().max().item() for k in want)
        assert error <= TOLERANCE, (rank, error)


# ----------------------------------------------------------------------------- the survivors' re-plan (no processes)

def test_the_survivors_take_the_global_batch_by_the_cluster_files_profiles_or_the_plans_figures():
    from cephalo_lightning.planner import cluster_from_dict, plan
    from tests.elastic_cluster import BIG, BIG_AND_SMALL, CLUSTER3, MID, SMALL

    three = plan_of(batches=[6, 4, 2], micro=[1, 1, 1], shares=[1.0, 1.0, 1.0], devices=[BIG, MID, SMALL], groups=[0, 1, 2])
    batches, how = survivors_batches(three, (0, 2), cluster_from_dict(CLUSTER3))
    # independently: the planner on a file that lists only the two devices left
    want = plan(cluster_from_dict(BIG_AND_SMALL), 12, "layered")
    assert batches == tuple(want.batch_sizes) and sum(batches) == 12
    assert how == f"from the cluster file's profiles, predicted step {want.predicted_step_s:.3f} s"
    assert batches != survivors_batches(three, (0, 2))[0]  # the profiles decided, not the plan's 6 : 2
    assert survivors_batches(three, (0, 2)) == ((9, 3), "from the plan's own per-group figures")
    assert survivors_batches(three, (2,), cluster_from_dict(CLUSTER3))[0] == (12,)
    # groups of two ranks: each group takes the sum of its ranks' batches
    assert survivors_batches(HSDP, (1, 0)) == ((8, 8), "from the plan's own per-group figures")


# ----------------------------------------------------------------------------- refusals (no processes)

HSDP = plan_of(batches=[4, 4, 4, 4], micro=[1, 1, 1, 1], shares=[0.5, 0.5, 0.5, 0.5], devices=["a100"] * 4, groups=[0, 0, 1, 1])
UNEVEN = plan_of(batches=[6, 2, 4, 4], micro=[1, 1, 1, 1], shares=[0.6, 0.4, 0.5, 0.5], devices=["a100", "v100", "a100", "a100"],
                 groups=[0, 0, 1, 1])


def test_groups_that_cut_the_units_differently_are_refused_with_their_shares():
    check_groups_cut_alike(HSDP)
    with pytest.raises(ConfigurationError, match=r"cut the units alike.*\[\[0, 1\], \[2, 3\]\].*\(0\.6, 0\.4\)"):
        check_groups_cut_alike(UNEVEN)
    sizes = plan_of(batches=[6, 3, 3], micro=[1, 1, 1], shares=[1.0, 0.5, 0.5], devices=["a100"] * 3, groups=[0, 1, 1])
    with pytest.raises(ConfigurationError, match=r"equal groups"):
        check_groups_cut_alike(sizes)
    assert group_plan(UNEVEN).batch_sizes == [8, 8] and group_plan(UNEVEN).shard_groups == ((0,), (1,))


def test_the_strategy_refuses_fault_tolerance_where_it_cannot_run():
    with pytest.raises(ConfigurationError, match=r"fault_tolerance=True.*mode='uniform'"):
        CephaloStrategy(fault_tolerance=True, mode="uniform")
    with pytest.raises(ConfigurationError, match=r"fault_tolerance=True.*cut the units alike"):
        CephaloStrategy(fault_tolerance=True, plan=UNEVEN)
    with pytest.raises(ConfigurationError, match=r"fault_tolerance.*True or False"):
        CephaloStrategy(fault_tolerance="yes")
    with pytest.raises(ConfigurationError, match=r"replica_group=1\).*add fault_tolerance=True"):
        CephaloStrategy(replica_group=1)
    with pytest.raises(ConfigurationError, match=r"replica_group=-1\) must be an integer >= 0"):
        CephaloStrategy(fault_tolerance=True, replica_group=-1)


def test_fabric_refuses_fault_tolerance_by_name():
    from cephalo_lightning.lightning.strategy.fabric import CephaloFabricStrategy

    with pytest.raises(UnsupportedError, match=r"CephaloFabricStrategy\(fault_tolerance=True\).*one process group per shard"):
        CephaloFabricStrategy(fault_tolerance=True)
    assert CephaloFabricStrategy(fault_tolerance=False).plan is None


def test_without_torchft_the_refusal_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # an import of torchft now raises ImportError
    assert not torchft_available()
    with pytest.raises(UnsupportedError, match=r"pip install 'cephalo-lightning\[ft\]'.*torchft==0\.2\.0"):
        require_torchft()
    with pytest.raises(UnsupportedError, match=r"fault_tolerance=True.*pip install 'cephalo-lightning\[ft\]'"):
        CephaloStrategy(fault_tolerance=True, plan=HSDP)


def test_trainer_fit_under_fault_tolerance_is_refused_at_setup_without_the_whole_plan_or_the_group(monkeypatch):
    from cephalo_lightning.lightning.fit.fault_tolerant_fit import FitReplica
    from scenarios.ft_worker import FIT_PLAN
    from tests import helpers
    from tests.lightning_models import TinyLayered, token_data

    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    with pytest.raises(ConfigurationError, match=r"cut the units alike"):
        check_fit(UNEVEN, 0)
    with pytest.raises(ConfigurationError, match=r"replica_group=2\).*0 to 1 of the plan's 2"):
        check_fit(FIT_PLAN, 2)
    with pytest.raises(ConfigurationError, match=r"REPLICA_GROUP_ID='x' is not a group index"):
        FitReplica.for_plan(FIT_PLAN, None, {"REPLICA_GROUP_ID": "x"})
    assert FitReplica.for_plan(FIT_PLAN, None, {"REPLICA_GROUP_ID": "1"}).group == 1
    with pytest.raises(ConfigurationError, match=r"shuffles, but no data seed.*seed="):
        FitReplica.check_data_seed(None, shuffle=True)
    FitReplica.check_data_seed(None, shuffle=False)
    with pytest.raises(UnsupportedError, match=r"accumulate_grad_batches=2\).*raise the global batch"):
        FitReplica(FIT_PLAN, 0).join([], accumulate=2, rank=0, world_size=1, sharded=None)
    with pytest.raises(UnsupportedError, match=r"returned 2 optimizers.*return one"):
        FitReplica(FIT_PLAN, 0).join([None, None], accumulate=1, rank=0, world_size=1, sharded=None)
    with pytest.raises(ConfigurationError, match=r"uniform mode.*layered protocol"):
        FitReplica.check_schedule("uniform")
    for strategy, match in ((CephaloStrategy(fault_tolerance=True, mode="layered"), r"needs plan= naming every group"),
                            (CephaloStrategy(fault_tolerance=True, plan=FIT_PLAN, check_devices=False),
                             r"replica_group=None\).*REPLICA_GROUP_ID")):
        trainer = helpers.trainer(strategy, 1, 2)
        with pytest.raises(ConfigurationError, match=match):
            trainer.fit(TinyLayered(), torch.utils.data.DataLoader(token_data(24), batch_size=12))
        assert trainer.global_step == 0


def test_a_non_finite_sum_over_the_groups_is_skipped_by_every_groups_guard():
    from types import SimpleNamespace

    from cephalo_lightning.lightning.fit.fault_tolerant_fit import FitReplica
    from cephalo_lightning.lightning.fit.nonfinite import NonFiniteGuard
    from scenarios.ft_worker import FIT_PLAN

    fit = FitReplica(FIT_PLAN, 1)
    weight = torch.nn.Parameter(torch.zeros(3))
    fit.replica = SimpleNamespace(parameters=[weight, torch.nn.Parameter(torch.zeros(2))])  # one without a gradient
    weight.grad = torch.ones(3)
    assert fit.summed_gradient_report(rank=0) is None
    weight.grad[1] = float("nan")  # another group's loss went bad: the sum every group holds is NaN
    report = fit.summed_gradient_report(rank=0)
    assert report.nonfinite == (0,) and report.what == "gradient summed over the replica groups"
    guard = NonFiniteGuard(5)
    guard.record(report)  # what the strategy does before its optimizer step
    with pytest.warns(UserWarning, match=r"non-finite gradient summed over the replica groups on rank\(s\) \[0\]"):
        assert guard.should_skip(4)


# ----------------------------------------------------------------------------- Trainer.fit (the same scenario)

@pytest.fixture(scope="module")
def fit_scenario(tmp_path_factory):
    from scenarios.ft_worker import run_scenario

    return run_scenario(tmp_path_factory.mktemp("ft-fit"), DEADLINE_S, fit=True)


def fit_replay(steps: int, global_batch: int) -> dict[str, torch.Tensor]:
    """The same Llama trained alone in fp64 on the planned loader's global batches (unshuffled)."""
    from scenarios.ft_worker import FIT_MODEL
    from tests.library_models import PaddedTokens, reference

    state = reference(*FIT_MODEL, steps, global_batch, PaddedTokens(steps * global_batch), dtype=torch.float64)
    return {name: value for name, value in state.items() if not name.endswith(("exp_avg", "exp_avg_sq"))}


@needs_torchft
@pytest.mark.multiprocess
def test_under_trainer_fit_the_survivor_redoes_the_step_in_its_process_and_the_killed_group_rejoins(fit_scenario):
    from scenarios.ft_worker import GLOBAL, KILL_AT, TOTAL, WAIT_AT

    scenario = fit_scenario
    (pid,) = scenario.lives(0)  # group 0 never restarted
    first, again = scenario.lives(1)
    assert scenario.exit_codes[0, pid] == 0 and scenario.exit_codes[1, again] == 0, scenario.logs
    assert scenario.exit_codes[1, first] == -signal.SIGKILL and scenario.killed["step"] == KILL_AT
    steps = [(e["step"], e["participants"], e["batches"], e["committed"]) for e in scenario.events[0, pid]]
    both, alone = ([0, 1], [8, 4]), ([0], [GLOBAL])
    assert steps[:KILL_AT + 2] == [*((s, *both, True) for s in range(KILL_AT)), (KILL_AT, *both, False),
                                   (KILL_AT, *alone, True)], steps  # redone on the same global batch, alone
    committed = [s for s, _, _, ok in steps if ok]
    assert committed == list(range(TOTAL)), steps  # every global batch trained once: none skipped or repeated
    assert all(sum(b) == GLOBAL for _, _, b, _ in steps)
    assert [e["step"] for e in scenario.events[1, first]] == list(range(KILL_AT))
    back = scenario.events[1, again]  # the return: the step, weights and optimizer state from group 0
    assert WAIT_AT < back[0]["step"] < TOTAL, back
    assert [(e["step"], e["participants"], e["batches"], e["committed"]) for e in back] == [
        (s, *both, True) for s in range(back[0]["step"], TOTAL)]
    assert steps[-(TOTAL - back[0]["step"]):] == [(s, *both, True) for s in range(back[0]["step"], TOTAL)]


@needs_torchft
@pytest.mark.multiprocess
def test_under_trainer_fit_both_groups_end_on_the_single_process_replay(fit_scenario):
    from scenarios.ft_worker import GLOBAL, TOTAL

    want = fit_replay(TOTAL, GLOBAL)
    assert len(fit_scenario.finals) == 2, fit_scenario.logs
    for life, got in fit_scenario.finals.items():
        assert set(got) == set(want)
        error = max((got[k] - want[k]).abs().max().item() for k in want)
        assert error <= TOLERANCE, (life, error)


def tiny_replay(steps: int, global_batch: int) -> dict[str, torch.Tensor]:
    """TinyLayered's model trained alone in fp64 on the planned loader's global batches (unshuffled)."""
    from tests.lightning_models import token_data

    model = TinyLM().double()
    train_steps(make_optimizer(model.parameters()), tiny_loss(model), whole(sliced(token_data(steps * global_batch), steps, global_batch)))
    return {f"model.{name}": p.detach() for name, p in model.named_parameters()}


@needs_torchft
@pytest.mark.multiprocess
def test_under_trainer_fit_groups_of_two_ranks_shard_inside_and_end_on_the_replay(tmp_path):
    from scenarios.ft_worker import HSDP_PLAN, HSDP_STEPS, run_ranks

    finals = run_ranks(tmp_path, DEADLINE_S)
    want = tiny_replay(HSDP_STEPS, HSDP_PLAN.global_batch_size)
    for (group, rank), final in finals.items():
        # the groups split the 16 samples 8 + 8 (same devices); rank_slice cuts a group's 8 as 5 + 3 inside
        assert final["parts"] == [((0, 1), 8 * group, 8, True)] * HSDP_STEPS, final["parts"]
        error = max((final["state"][k] - want[k]).abs().max().item() for k in want)
        assert error <= TOLERANCE, (group, rank, error)


# ----------------------------------------------------------------------------- docs/fault-tolerance.md's blocks

PAGE = Path(__file__).resolve().parents[3] / "docs" / "fault-tolerance.md"


def page_blocks() -> list[tuple[str, str, str]]:
    """(language, marker, code) of every fenced block; the marker is the docs-test comment on the
    line before the fence ("" when none)."""
    blocks, lines = [], PAGE.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```") and len(lines[i]) > 3:
            language = lines[i][3:].split()[0]
            marker = lines[i - 1] if i and lines[i - 1].startswith("<!-- docs-test:") else ""
            end = lines.index("```", i + 1)
            blocks.append((language, marker, "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return blocks


def test_the_pages_parse_only_and_output_blocks_are_marked_and_parse():
    blocks = page_blocks()
    assert [language for language, _, _ in blocks] == ["python", "python", "python", "bash", "bash"]
    for language, marker, code in blocks:
        if "parse-only" in marker and language == "bash":
            subprocess.run(["bash", "-n"], input=code, text=True, check=True)
        elif language == "python":
            ast.parse(code)
        else:
            assert "docs-test: illustration" in marker, (language, marker)  # measured: shown, not compared


@needs_torchft
@pytest.mark.multiprocess
def test_the_pages_python_blocks_run(tmp_path):
    loop, fit = [code for language, marker, code in page_blocks() if language == "python" and not marker]
    env = {**os.environ, "PYTHONPATH": str(PAGE.parents[1]), "WANDB_MODE": "offline", "RUST_LOG": "warn"}
    for name, code, printed in (("loop", loop, "committed steps: 3 participants: (0,)"),
                                ("fit", fit, "committed steps: 3")):  # the ReplicaGroup loop; Trainer.fit
        (tmp_path / name).mkdir()
        script = tmp_path / name / "block.py"
        script.write_text(code)
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path / name, env=env, capture_output=True,
                              text=True, timeout=HANG_TIMEOUT_S)
        assert done.returncode == 0, (name, done.stderr[-3000:])
        assert printed in done.stdout, (name, done.stdout[-2000:])
    # the coordinator the page starts, with the flags it gives (tests/test_lighthouse.py runs it)
    from cephalo_lightning.lighthouse import parser

    parser().parse_args(["--min-replicas", "1", "--bind", "[::]:29510", "--heartbeat-timeout-ms", "5000"])


# ----------------------------------------------------------------------------- the logged loss, the data order

LOSS_TOLERANCE = 1e-5  # the logged value passes through float32 (relative 6e-8 of a loss near 3); a group's part is off by > 0.5


def fit_replay_losses(steps: int, global_batch: int) -> list[float]:
    """Each step's loss of :func:`fit_replay`'s single-process run (the whole global batch's mean)."""
    from scenarios.ft_worker import FIT_MODEL
    from tests.library_models import LibraryLM, PaddedTokens, steps_of, target_tokens

    module = LibraryLM(*FIT_MODEL).to(torch.float64)
    data = PaddedTokens(steps * global_batch)
    return train_steps(module.configure_optimizers(), lambda batch: module.training_step(batch, 0),
                       steps_of(data.batch, steps, global_batch, None, target_tokens))


@needs_torchft
@pytest.mark.multiprocess
def test_under_trainer_fit_the_logged_loss_is_the_steps_and_the_failed_attempt_is_not_averaged_in(fit_scenario):
    from scenarios.ft_worker import GLOBAL, TOTAL, steps_and_epochs

    want = fit_replay_losses(TOTAL, GLOBAL)
    (pid,) = fit_scenario.lives(0)  # the survivor: it redid step KILL_AT alone
    steps, epochs = steps_and_epochs(fit_scenario.metrics[0, pid])
    assert len(steps) == TOTAL, steps  # one value per committed step: the failed attempt logged nothing
    assert max(abs(a - b) for a, b in zip(steps, want)) <= LOSS_TOLERANCE, (steps, want)
    (epoch, since), = epochs
    assert abs(epoch - sum(want) / TOTAL) <= LOSS_TOLERANCE and len(since) == TOTAL
    _, again = fit_scenario.lives(1)  # the returned group logs the same values for the steps it trains
    back, _ = steps_and_epochs(fit_scenario.metrics[1, again])
    assert back and max(abs(a - b) for a, b in zip(back, want[-len(back):])) <= LOSS_TOLERANCE


# ----------------------------------------------------------------------------- the gaps' refusals (no processes)

ONE_GROUP = plan_of(batches=[12], micro=[1], shares=[1.0], devices=["cpu"], groups=[0])


def test_groups_drawing_other_samples_are_refused_naming_them():
    from cephalo_lightning.lightning.fit.fault_tolerance import check_one_order

    check_one_order(3, (0, 1), [77, 77], [4, 4])
    check_one_order(3, (0, 1), [77, -1], [4, -1])  # a group that gave none (the plain loop) is not compared
    with pytest.raises(ConfigurationError, match=r"at step 3 the groups draw different samples.*\{1: 5, 0: 9\}, "
                                                 r"data seeds \{1: 2, 0: 3\}.*seed="):
        check_one_order(3, (1, 0), [5, 9], [2, 3])


def test_a_group_returning_with_another_number_of_ranks_is_refused_before_it_joins():
    from cephalo_lightning.lightning.fit.fault_tolerant_fit import FitReplica
    from tests import helpers
    from tests.lightning_models import TinyLayered, loader, token_data

    with pytest.raises(ConfigurationError, match=r"replica group 1 started with 3 ranks, but the plan gives it 2"):
        FitReplica.for_plan(HSDP, 1, {}, world_size=3)
    assert FitReplica.for_plan(HSDP, 1, {}, world_size=2).group == 1
    # under Trainer.fit: the group of two started on one rank is refused at setup, before any step or quorum
    trainer = helpers.trainer(CephaloStrategy(plan=HSDP, fault_tolerance=True, replica_group=1, check_devices=False), 1, 2)
    with pytest.raises(ConfigurationError, match=r"replica group 1 started with 1 ranks, but the plan gives it 2"):
        trainer.fit(TinyLayered(), loader(token_data(32), 16))
    assert trainer.global_step == 0


def test_a_returning_group_given_another_seed_is_told_the_live_one_and_keeps_its_own_for_the_quorum(caplog):
    from cephalo_lightning.lightning.fit.fault_tolerant_fit import FitReplica
    from cephalo_lightning.runtime.plan_state import PlanState
    from cephalo_lightning.runtime.sampler import PlannedBatchSampler
    from scenarios.ft_worker import FIT_PLAN

    live, back = FitReplica(FIT_PLAN, 0), FitReplica(FIT_PLAN, 1)
    for fit, seed in ((live, 7), (back, 8)):
        fit._sampler = PlannedBatchSampler(24, PlanState(fit.local), 0, seed=seed, whole=True)
    back._load_sampler_state(live._sampler_state())  # what torchft's recovery sends with the weights
    assert back.live_seed == 7 and "group 1 was given data seed 8, but the live groups draw with seed 7" in caplog.text
    assert back._sampler.seed == 8  # not adopted: the quorum compares the orders and stops the run
    assert back._sampler.fingerprint(5) != live._sampler.fingerprint(5)


def test_the_degraded_phase_is_logged_beside_the_replans_prediction():
    from dataclasses import replace

    from cephalo_lightning.lightning.fit.fault_tolerance import phase_line, predicted_step_s
    from cephalo_lightning.planner import cluster_from_dict, plan
    from tests.elastic_cluster import BIG, BIG_AND_SMALL, CLUSTER3, MID, SMALL

    three = plan_of(batches=[6, 4, 2], micro=[1, 1, 1], shares=[1.0, 1.0, 1.0], devices=[BIG, MID, SMALL], groups=[0, 1, 2])
    # from the cluster file: the planner's step for the devices left, computed independently
    assert predicted_step_s(three, (0, 2), cluster_from_dict(CLUSTER3)) == plan(cluster_from_dict(BIG_AND_SMALL), 12,
                                                                                "layered").predicted_step_s
    assert predicted_step_s(three, (0, 2), None) is None  # the plan predicts no step time
    timed = replace(three, predicted_step_s=0.3)
    assert predicted_step_s(timed, (0, 2), None) == pytest.approx(0.3 * 12 / 8)  # groups 0 and 2 planned 8 of 12
    line = phase_line((0, 2), 3, 4, 5, 0.5, 0.45, 12)
    assert line == ("steps 4-8 over groups [0, 2] (degraded, 2 of 3 groups): measured 0.5000 s per step (24.0 samples/s), "
                    "predicted 0.4500 s by the re-plan")


@needs_torchft
def test_a_shuffling_loader_without_a_seed_is_refused_under_trainer_fit(monkeypatch):
    from torchft._torchft import LighthouseServer

    from tests import helpers
    from tests.lightning_models import TinyLayered, loader, token_data

    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse.address())
    try:
        strategy = CephaloStrategy(plan=ONE_GROUP, fault_tolerance=True, replica_group=0, check_devices=False)
        trainer = helpers.trainer(strategy, 1, 2, use_distributed_sampler=True)  # Lightning's default
        with pytest.raises(ConfigurationError, match=r"shuffles, but no data seed"):
            # shuffle=False, but Lightning's distributed sampler shuffles every training loader
            trainer.fit(TinyLayered(), loader(token_data(24), 12))
        assert trainer.global_step == 0
    finally:
        lighthouse.shutdown()


@needs_torchft
@pytest.mark.multiprocess
def test_two_of_three_groups_lost_in_one_step_the_last_redoes_it_alone_and_ends_on_the_replay(tmp_path):
    from scenarios.ft_worker import GLOBAL, KILL_AT, TOTAL, run_lost_together

    scenario = run_lost_together(tmp_path, DEADLINE_S)
    (pid,) = scenario.lives(0)
    assert scenario.exit_codes[0, pid] == 0, scenario.logs
    for group in (1, 2):
        (lost,) = scenario.lives(group)
        assert scenario.exit_codes[group, lost] == -signal.SIGKILL, scenario.logs
    steps = [(e["step"], e["participants"], e["batches"], e["committed"]) for e in scenario.events[0, pid]]
    three = ([0, 1, 2], [4, 4, 4])
    assert steps[:KILL_AT + 1] == [*((s, *three, True) for s in range(KILL_AT)), (KILL_AT, *three, False)], steps
    assert steps[KILL_AT + 1:] == [(s, [0], [GLOBAL], True) for s in range(KILL_AT, TOTAL)], steps  # one redo
    got, want = scenario.finals[0, pid], replay(TOTAL, GLOBAL)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= TOLERANCE
