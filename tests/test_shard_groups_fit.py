"""Shard groups through ``Trainer.fit`` on 4 gloo ranks as 2 nodes x 2: plans with a group per
node (different shares and micro-batch counts in each) and groups of one rank, a re-plan that
changes the grouping in place, and checkpoints that resume under another grouping and on another
world size, against single-process training on the same global batches."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch

from cephalo_lightning import CephaloStrategy, Plan
from cephalo_lightning.planner import RankPlan
from tests.distributed import run_distributed
from tests.helpers import NUM_SAMPLES, max_error, reference, trainer
from tests.lightning_models import TinyLayered, TinyUniform, loader, token_data

TOL = 1e-5  # AdamW in fp32 through Lightning, as tests/test_strategy.py (the runtime's tests hold the tighter bounds)


def _plan(mode: str, rows: list[tuple[int, int, float, int]]) -> Plan:
    """(batch size, micro-batches, share within the group, group) per rank."""
    return Plan(12, mode, tuple(RankPlan(r, f"d{r}", b, n, -(-b // n) if b else 0, share, shard_group=g)
                                for r, (b, n, share, g) in enumerate(rows)))


NODES = _plan("layered", [(2, 1, 0.7, 0), (5, 3, 0.3, 0), (4, 2, 0.45, 1), (1, 1, 0.55, 1)])
SINGLES = _plan("uniform", [(3, 1, 1.0, 0), (5, 1, 1.0, 1), (1, 1, 1.0, 2), (3, 1, 1.0, 3)])
SINGLES_LAYERED = _plan("layered", [(6, 2, 1.0, 0), (2, 1, 1.0, 1), (3, 3, 1.0, 2), (1, 1, 1.0, 3)])
TWO_RANKS = Plan(12, "layered", (RankPlan(0, "a", 9, 3, 3, 0.25), RankPlan(1, "b", 3, 1, 3, 0.75)))


def _states(t: pl.Trainer) -> dict[str, torch.Tensor]:
    return t.strategy.sharded.full_state_dict()


def _fit_four(rank: int, world: int, ckpt_dir: str):
    warnings.simplefilter("ignore")
    from lightning.pytorch.callbacks import ModelCheckpoint

    out = {}
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    t = trainer(CephaloStrategy(plan=NODES), world, 3, callbacks=[saver], enable_checkpointing=True)
    t.fit(TinyLayered(), loader(token_data(NUM_SAMPLES), 12))
    out["nodes"] = (_states(t), t.strategy.sharded.shard_groups)
    t = trainer(CephaloStrategy(plan=SINGLES), world, 2, gradient_clip_val=0.05)
    t.fit(TinyUniform(), loader(token_data(NUM_SAMPLES), 12))
    out["singles"] = (_states(t), t.strategy.sharded.comm.log)
    switches = []

    class Regroup(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1:
                switches.append(trainer.strategy.schedule_plan(SINGLES_LAYERED))

    t = trainer(CephaloStrategy(plan=NODES), world, 3, callbacks=[Regroup()])
    t.fit(TinyLayered(), loader(token_data(NUM_SAMPLES), 12))
    out["regrouped"] = (_states(t), t.strategy.sharded.shard_groups)
    # resume the per-node run's step-2 checkpoint under groups of one rank
    t = trainer(CephaloStrategy(plan=SINGLES_LAYERED), world, 3)
    t.fit(TinyLayered(seed=7), loader(token_data(NUM_SAMPLES), 12), ckpt_path=f"{ckpt_dir}/step=2.ckpt")
    out["resumed"] = (_states(t), t.global_step)
    return out


def _resume_two(rank: int, world: int, ckpt: str):
    warnings.simplefilter("ignore")
    t = trainer(CephaloStrategy(plan=TWO_RANKS), world, 3)
    t.fit(TinyLayered(seed=7), loader(token_data(NUM_SAMPLES), 12), ckpt_path=ckpt)
    return _states(t), t.global_step


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpts")
    return run_distributed(_fit_four, 4, str(ckpt)), ckpt


def _assert_replicas_identical(results, key: str) -> None:
    for rank, result in enumerate(results[1:], start=1):
        for name, value in results[0][key][0].items():
            assert torch.equal(result[key][0][name], value), f"{key}: rank {rank}'s {name} differs from rank 0's"


@pytest.mark.multiprocess
def test_a_group_per_node_fits_like_one_process(four):
    results, _ = four
    want, _ = reference(3, 12)
    assert results[0]["nodes"][1] == ((0, 1), (2, 3))
    assert max_error(results[0]["nodes"][0], want) <= TOL
    _assert_replicas_identical(results, "nodes")


@pytest.mark.multiprocess
def test_groups_of_one_rank_fit_like_one_process_with_clipping_and_gather_nothing(four):
    results, _ = four
    want, _ = reference(2, 12, clip=0.05)
    assert max_error(results[0]["singles"][0], want) <= TOL
    _assert_replicas_identical(results, "singles")
    assert not [op for op in results[0]["singles"][1] if op[0] == "all_gather"]


@pytest.mark.multiprocess
def test_a_replan_changes_the_grouping_in_place_and_continues_exactly(four):
    results, _ = four
    want, _ = reference(3, 12)
    states, groups = results[0]["regrouped"]
    assert groups == ((0,), (1,), (2,), (3,))
    assert max_error(states, want) <= TOL
    _assert_replicas_identical(results, "regrouped")


@pytest.mark.multiprocess
def test_a_checkpoint_of_one_grouping_resumes_under_another(four):
    results, _ = four
    want, _ = reference(3, 12)
    states, step = results[0]["resumed"]
    assert step == 3
    assert max_error(states, want) <= TOL
    _assert_replicas_identical(results, "resumed")


@pytest.mark.multiprocess
def test_a_checkpoint_of_one_grouping_resumes_on_another_world_size(four):
    _, ckpt = four
    resumed = run_distributed(_resume_two, 2, str(ckpt / "step=2.ckpt"))
    want, _ = reference(3, 12)
    for states, step in resumed:
        assert step == 3
        assert max_error(states, want) <= TOL
