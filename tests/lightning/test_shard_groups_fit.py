"""Shard groups through ``Trainer.fit`` on 4 gloo ranks as 2 nodes x 2: plans with a group per
node (different shares and micro-batch counts in each) and groups of one rank, a re-plan that
changes the grouping in place, and checkpoints that resume under another grouping and on another
world size, against single-process training on the same global batches; and Hugging Face models
(one a named adapter knows, one only discovered) under the per-node groups."""

from __future__ import annotations

import importlib.util
import warnings

import lightning.pytorch as pl
import pytest
import torch

from cephalo_lightning import CephaloStrategy, Plan
from tests.distributed import run_distributed
from tests.helpers import fit, max_error, reference, trainer
from tests.lightning_models import TinyLayered, TinyUniform
from tests.plans import plan_of

TOL = 1e-5  # AdamW in fp32 through Lightning, as tests/lightning/test_strategy.py (the runtime's tests hold the tighter bounds)


def _plan(mode: str, rows: list[tuple[int, int, float, int]]) -> Plan:
    """(batch size, micro-batches, share within the group, group) per rank."""
    batches, micro, shares, groups = zip(*rows)
    return plan_of(batches=batches, micro=micro, shares=shares, mode=mode, devices=[f"d{r}" for r in range(len(rows))],
                   groups=groups)


NODES = _plan("layered", [(2, 1, 0.7, 0), (5, 3, 0.3, 0), (4, 2, 0.45, 1), (1, 1, 0.55, 1)])
SINGLES = _plan("uniform", [(3, 1, 1.0, 0), (5, 1, 1.0, 1), (1, 1, 1.0, 2), (3, 1, 1.0, 3)])
SINGLES_LAYERED = _plan("layered", [(6, 2, 1.0, 0), (2, 1, 1.0, 1), (3, 3, 1.0, 2), (1, 1, 1.0, 3)])
TWO_RANKS = plan_of(batches=[9, 3], micro=[3, 1], shares=[0.25, 0.75])


# A Hugging Face family a named adapter knows (Llama: rotary tables, grouped-query attention, RMSNorm)
# and one only the structure discovers (OLMo2: q/k norms), each tiny from its config, on padded batches.
HF_CASES = (("llama", "sgd", "32-true"), ("llama", "adamw", "64-true"), ("olmo2", "sgd", "32-true"))
HF_STEPS = 3


def _hf_module(family: str, optimizer: str) -> pl.LightningModule:
    if family == "llama":
        from tests.library_models import LibraryLM

        return LibraryLM(family, optimizer)
    from tests.discovered_models import Wrapped

    return Wrapped(family)  # SGD


def _hf_data(family: str):  # noqa: ANN202 - the family's dataset
    if family == "llama":
        from tests.library_models import PaddedTokens

        return PaddedTokens(NODES.global_batch_size * HF_STEPS)
    from tests.discovered_models import Samples

    return Samples(family, NODES.global_batch_size * HF_STEPS)


def _hf_loader(family: str):  # noqa: ANN202 - a DataLoader in the dataset's order
    from torch.utils.data import DataLoader

    return DataLoader(_hf_data(family), batch_size=NODES.global_batch_size, shuffle=False)


def _states(t: pl.Trainer) -> dict[str, torch.Tensor]:
    return t.strategy.sharded.full_state_dict()


def _fit_four(rank: int, world: int, ckpt_dir: str):
    warnings.simplefilter("ignore")
    from lightning.pytorch.callbacks import ModelCheckpoint

    out = {}
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    t = fit(TinyLayered(), NODES, world, 3, options={"callbacks": [saver], "enable_checkpointing": True})
    out["nodes"] = (_states(t), t.strategy.sharded.shard_groups)
    t = fit(TinyUniform(), SINGLES, world, 2, options={"gradient_clip_val": 0.05})
    out["singles"] = (_states(t), t.strategy.sharded.comm.log)
    switches = []

    class Regroup(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1:
                switches.append(trainer.strategy.schedule_plan(SINGLES_LAYERED))

    t = fit(TinyLayered(), NODES, world, 3, options={"callbacks": [Regroup()]})
    out["regrouped"] = (_states(t), t.strategy.sharded.shard_groups)
    # resume the per-node run's step-2 checkpoint under groups of one rank
    t = fit(TinyLayered(seed=7), SINGLES_LAYERED, world, 3, ckpt_path=f"{ckpt_dir}/step=2.ckpt")
    out["resumed"] = (_states(t), t.global_step)
    # library models, built from configs, under the per-node groups (fp32 SGD and fp64 AdamW)
    for family, optimizer, precision in HF_CASES if importlib.util.find_spec("transformers") else ():
        t = trainer(CephaloStrategy(plan=NODES), world, HF_STEPS, precision=precision)
        t.fit(_hf_module(family, optimizer), _hf_loader(family))
        out[(family, optimizer)] = (_states(t), t.strategy.fit_runtime.schedule, t.strategy.sharded.shard_groups)
    if importlib.util.find_spec("transformers"):  # and under groups of one rank (the replicated-gradient step)
        t = trainer(CephaloStrategy(plan=SINGLES_LAYERED), world, HF_STEPS)
        t.fit(_hf_module("llama", "sgd"), _hf_loader("llama"))
        out[("llama", "sgd", "singles")] = (_states(t), t.strategy.fit_runtime.schedule, t.strategy.sharded.shard_groups)
    return out


def _resume_two(rank: int, world: int, ckpt: str):
    warnings.simplefilter("ignore")
    t = fit(TinyLayered(seed=7), TWO_RANKS, world, 3, ckpt_path=ckpt)
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


def _hf_reference(family: str, optimizer: str, dtype: torch.dtype, cuts: tuple[int, ...] | None = None):
    """Single-process training on the same global batches (the whole batch at once, or cut into
    ``cuts`` with each piece's loss weighted by its share of the batch's label tokens)."""
    if family == "llama":
        from tests.library_models import reference

        return reference(family, optimizer, HF_STEPS, NODES.global_batch_size, _hf_data(family), dtype,
                         micro_batches=cuts, items_in_batch=dtype == torch.float64)
    from tests.discovered_models import reference

    return reference(family, HF_STEPS, NODES.global_batch_size, _hf_data(family), cuts)


# [Note: library-model bounds] As tests/models/test_discovery.py: 1e-7 for SGD in fp32 and four steps of
# fp64's grid above 1 for AdamW in fp64, or where larger FLOOR_FACTOR x the noise floor: how far
# single-process training lands from the whole-batch run when it cuts each batch as the plan does
# (rank by rank, micro-batch by micro-batch: the same training, its sums re-associated). Measured
# (3 steps): Llama SGD 1.49e-8 from the whole batch (floor 1.49e-8); Llama AdamW fp64 2.96e-16
# (floor 2.94e-16: the fp64 cut divides each piece's summed loss by the batch's tokens as the fit
# does, since Hugging Face's loss runs in fp32 and a weight applied after it costs 1.01e-7); OLMo2
# SGD 2.16e-7 (floor 6.54e-7: its embedding, drawn from N(0, 1), moves by ulps of 1.19e-7 as soon
# as a sum is re-associated).
HF_EXACT = {torch.float32: 1e-7, torch.float64: 4 * torch.finfo(torch.float64).eps}
FLOOR_FACTOR = 2


@pytest.mark.multiprocess
@pytest.mark.parametrize(("family", "optimizer", "precision"), HF_CASES, ids=[f"{f}-{o}" for f, o, _ in HF_CASES])
def test_a_library_model_under_a_group_per_node_fits_like_one_process(four, family, optimizer, precision):
    pytest.importorskip("transformers")
    dtype = torch.float64 if precision == "64-true" else torch.float32
    _check_library_fit(four[0], (family, optimizer), NODES, ((0, 1), (2, 3)), family, optimizer, dtype)


@pytest.mark.multiprocess
def test_a_library_model_under_groups_of_one_rank_fits_like_one_process(four):
    """Llama from its config on padded batches, data parallel: the step's all-reduce goes out before
    the backward and every rank checks the replicated gradient itself."""
    pytest.importorskip("transformers")
    _check_library_fit(four[0], ("llama", "sgd", "singles"), SINGLES_LAYERED, ((0,), (1,), (2,), (3,)),
                       "llama", "sgd", torch.float32)


def _check_library_fit(results, key, plan: Plan, shard_groups, family: str, optimizer: str, dtype: torch.dtype) -> None:
    states, schedule, groups = results[0][key]
    assert schedule == "layered" and groups == shard_groups
    _assert_replicas_identical(results, key)
    want = {n: v for n, v in _hf_reference(family, optimizer, dtype).items() if not n.endswith(("exp_avg", "exp_avg_sq"))}
    assert set(want) == set(states), "the fit's parameters are the reference's"
    err = max((states[name].to(dtype) - value).abs().max().item() for name, value in want.items())
    cut = _hf_reference(family, optimizer, dtype, tuple(n for r in plan.ranks for n in r.micro_batch_sizes))
    floor = max((cut[name] - value).abs().max().item() for name, value in want.items())
    bound = max(HF_EXACT[dtype], FLOOR_FACTOR * floor)
    print(f"{family} {optimizer}: largest difference {err:.3e} (noise floor {floor:.3e}, bound {bound:.3e})")
    assert err <= bound, f"{family} {optimizer}: parameters differ by {err:.2e} > {bound:.2e}"
