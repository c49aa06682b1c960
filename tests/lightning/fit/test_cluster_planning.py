"""``CephaloStrategy(cluster=...)`` plans as ``python -m cephalo_lightning plan`` does, pipelines weighed,
wherever the fit can run the plan it picks (single process: the planning, the reasons, the predict loader).

Each test fails on a plausible mistake: the strategy planning without pipelines where the CLI weighs
them (the lab's 190 s plan instead of its pipelined one), a pipelined plan picked for a fit an option
rules them out of (refused later by the runtime, or silently downgraded without a word), a plan that
leaves ranks idle (which the runtime refuses), an obstacle the runtime refuses that the planning does
not know, and a predict batch that leaves a pipeline without a sample (its stage's ranks would hang).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSamplerWrapper
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from cephalo_lightning._common.errors import ConfigurationError, UnsupportedError
from cephalo_lightning._common.vocabulary import AUTO, Handback, Schedule
from cephalo_lightning.lightning.fit.fit_runtime import pipeline_obstacle, refuse_pipelined_options
from cephalo_lightning.lightning.fit.plan_resolution import from_cluster
from cephalo_lightning.lightning.strategy_config import StrategyConfig
from cephalo_lightning.planner import cluster_from_dict, plan
from cephalo_lightning.runtime.sampler import pipelined_evaluation_loader
from tests.plans import setup_lines, slow_link_cluster


def planned(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("Cephalo: planned from the cluster file")]


def test_the_strategy_weighs_pipelines_as_the_cli_does_and_says_what_it_chose() -> None:
    cluster = slow_link_cluster()
    with setup_lines() as lines:
        got = from_cluster(cluster, 8, Schedule.LAYERED, AUTO, None)
    want = plan(cluster, 8, pipelines=True)  # the CLI's: subsets leave ranks idle, which it may pick, the strategy not
    assert got.pipelined and got == want
    flat = plan(cluster, 8)
    assert got.predicted_step_s < flat.predicted_step_s / 2
    [line] = planned(lines)
    assert "with pipelines weighed" in line and "2 pipeline(s) x 2 stages" in line, line
    assert f"against {flat.predicted_step_s:.3g} s without a pipeline" in line, line


def test_the_lab_cluster_gets_from_the_strategy_the_pipelined_plan_the_cli_prints() -> None:
    """The 8B model on 4 A100 + 4 RTX 3090 over 10 GbE (docs/pipelining.md's lab case): the strategy's
    plan is the pipelined one, several times faster than the shard grouping it planned before."""
    lab = cluster_from_dict({
        "model": {"name": "llama-8b", "num_layers": 34, "parameters": 8_030_261_248, "hidden_size": 4096,
                  "seq_len": 2048},
        "settings": {"link_bandwidth": "16 GB/s per rank", "inter_node_bandwidth": "10 Gbit/s per link"},
        "nodes": [{"devices": [{"name": "a100-40gb", "count": 4}]}, {"devices": [{"name": "rtx3090", "count": 4}]}]})
    with setup_lines() as lines:
        got = from_cluster(lab, 64, Schedule.LAYERED, AUTO, None)
    flat = plan(lab, 64)  # what the strategy planned before it weighed pipelines
    assert got.pipelined and not got.idle_ranks and got == plan(lab, 64, pipelines=True)
    assert got.predicted_step_s < flat.predicted_step_s / 4
    [line] = planned(lines)
    assert f"against {flat.predicted_step_s:.3g} s without a pipeline" in line, line


@pytest.mark.parametrize(("pipelines", "obstacle", "said"), [
    (AUTO, "elastic=True (an elastic restart re-plans)", "elastic=True"),
    (False, None, "pipelines=False"),
])
def test_planning_without_pipelines_gives_the_flat_plan_and_says_why(pipelines, obstacle, said) -> None:
    cluster = slow_link_cluster()
    with setup_lines() as lines:
        got = from_cluster(cluster, 8, Schedule.LAYERED, pipelines, obstacle)
    assert not got.pipelined and got == plan(cluster, 8)
    [line] = planned(lines)
    assert "without weighing pipelines" in line and said in line, line


def test_pipelines_true_refuses_what_rules_them_out_naming_it() -> None:
    with pytest.raises(ConfigurationError, match=r"pipelines=True.*accumulate_grad_batches=2"):
        from_cluster(slow_link_cluster(), 8, Schedule.LAYERED, True, "accumulate_grad_batches=2 (...)")


def test_a_pipelined_plan_that_leaves_ranks_idle_gives_way_to_the_plan_over_every_rank() -> None:
    """Nodes of 2 and 1 ranks: the best pipelined plan leaves a rank of the larger node idle, which the
    runtime refuses; the strategy takes the plan over every rank and says so."""
    cluster = slow_link_cluster((2, 1))
    assert plan(cluster, 8, pipelines=True).idle_ranks == (1,)  # what the CLI would pick
    with setup_lines() as lines:
        got = from_cluster(cluster, 8, Schedule.LAYERED, AUTO, None)
    assert not got.idle_ranks and got == plan(cluster, 8)
    [line] = planned(lines)
    assert "leaves ranks 1 idle" in line, line


def _layered(discovered: bool = False) -> Any:
    return SimpleNamespace(name="M", discovery=object() if discovered else None)


def _trainer(accumulate: int = 1) -> Any:
    return SimpleNamespace(accumulate_grad_batches=accumulate)


CONFLICTS = {"fault_tolerance": True, "elastic": True, "async_checkpoint": True, "state_dict_type": "full",
             "gather_on_teardown": Handback.ALL}


@pytest.mark.parametrize("option", list(CONFLICTS))
def test_every_option_the_runtime_refuses_under_a_pipeline_rules_pipelines_out_of_the_planning(option) -> None:
    config = StrategyConfig(**{option: CONFLICTS[option]})
    reason = pipeline_obstacle(config, _layered(), _trainer(), callback=False)
    assert reason is not None and option in reason
    with pytest.raises(UnsupportedError, match=option):  # the same option the runtime would refuse
        refuse_pipelined_options(config)


def test_what_else_rules_pipelines_out_is_named_and_a_plain_fit_has_no_obstacle() -> None:
    plain = StrategyConfig()
    assert pipeline_obstacle(plain, _layered(), _trainer(), callback=False) is None
    reasons = {
        "uniform mode": pipeline_obstacle(plain, None, _trainer(), callback=False),
        "discovered": pipeline_obstacle(plain, _layered(discovered=True), _trainer(), callback=False),
        "accumulate_grad_batches=2": pipeline_obstacle(plain, _layered(), _trainer(2), callback=False),
        "CephaloCallback": pipeline_obstacle(plain, _layered(), _trainer(), callback=True),
        "manual optimization": pipeline_obstacle(plain, None, _trainer(), callback=False, manual=True),
        "pretrained=": pipeline_obstacle(StrategyConfig(pretrained=Path("base")), _layered(), _trainer(), callback=False),
    }
    for words, reason in reasons.items():
        assert reason is not None and words in reason, (words, reason)


def test_the_pipelines_option_takes_true_false_or_auto() -> None:
    assert StrategyConfig.build(pipelines=False).pipelines is False
    with pytest.raises(ConfigurationError, match=r"pipelines='yes'.*True, False or 'auto'"):
        StrategyConfig.build(pipelines="yes")


def _dealt(samples: int, batch: int, pipelines: int, pipeline: int, batched: bool = False) -> list[list[int]]:
    """The predict batches pipeline ``pipeline`` gets from Lightning's predict sampler (on rank 2 of 4);
    ``batched``: as Lightning's predict loader has it, a batch sampler over it (which records the indices)."""
    data = list(range(samples))
    sampler = UnrepeatedDistributedSamplerWrapper(SequentialSampler(data), num_replicas=4, rank=2, shuffle=False)
    loader = (DataLoader(data, batch_sampler=BatchSampler(sampler, batch, drop_last=False)) if batched
              else DataLoader(data, batch_size=batch, sampler=sampler))
    dealt = pipelined_evaluation_loader(loader, pipelines, pipeline, predicting=True)
    return [b.tolist() for b in dealt]


@pytest.mark.parametrize("batched", [False, True], ids=["sampler", "batch-sampler"])
def test_predict_deals_every_sample_once_to_the_pipelines_in_as_many_steps(batched) -> None:
    got = [_dealt(10, 4, 2, d, batched) for d in range(2)]
    assert len(got[0]) == len(got[1]) == 3  # every pipeline's ranks take the same steps
    assert all(batch for batches in got for batch in batches)
    assert sorted(i for batches in got for batch in batches for i in batch) == list(range(10))
    assert [b for steps in zip(*got) for batch in steps for b in batch] == list(range(10))  # the order kept


def test_a_predict_batch_that_leaves_a_pipeline_without_a_sample_is_refused_naming_the_fix() -> None:
    with pytest.raises(UnsupportedError, match=r"3 pipelines.*batch of 1 sample.*batch_size of at least 3"):
        _dealt(9, 4, 3, 0)
    assert torch.equal(torch.tensor(_dealt(9, 3, 3, 1)), torch.tensor([[1], [4], [7]]))
