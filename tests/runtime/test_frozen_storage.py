"""A frozen base stored, sharded and gathered in the compute dtype; only trainable parameters reduced.

    stored bytes on a rank  = 4 x (its trainable elements) + 2 x (its frozen elements)       (bf16-true)
    reduce-scatter bytes    = (W - 1) x 4 x trainable elements per step, summed over the ranks  (exact mode)
    all-gather bytes        = 2 x (elements gathered - own shard) for every gather of either part

A LoRA-shaped TinyLM (its big matrices frozen, biases and norms trained) under ``bf16-true`` on 2 gloo
ranks, layered and uniform, against the single-process reference (:func:`tests.reference.train_steps`)
of the same bf16-base model: fp32 masters of the trainable parameters, each cast to bf16 for the
forward (the cast's gradient is the bf16 gradient in fp32), the ranks' gradients added in rank order.
The plans give every rank one micro-batch, so the runtime accumulates nothing in bf16 and the two
compute the same maths; the bound is 10x the measured floor (the reference with the ranks' sum in
the other order). The base stays bitwise the bf16 values it started as, and a resumed run ends
bitwise where an uninterrupted one does.

Under ``bf16-mixed`` (autocast) the same holds: the frozen base is stored, gathered (2 bytes an
element) and computed from in bf16, the trainable part gathered in fp32, against the single-process
bf16-mixed model whose frozen parameters were cast to bf16.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.func import functional_call

from tests.distributed import run_distributed
from tests.helpers import fit
from tests.lightning_models import TinyLayered, TinyUniform, token_data
from tests.plans import plan_of
from tests.reference import sliced, train_steps
from tests.tiny_lm import TinyLM

STEPS = 3
LR = 0.1
DECAY = 0.1  # SGD's weight decay: a frozen parameter the optimizer were given would move even without a gradient
CLIP = 0.5
FLOOR = 10  # x the measured noise floor
FLOOR_EPS = 1e-7  # the floor of two bitwise-equal references: a bf16 weight's last place near 1 is 8e-3
PLANS = {"layered": plan_of(batches=[8, 4], micro=[1, 1], shares=[0.7, 0.3]),
         "uniform": plan_of(batches=[8, 4], micro=[1, 1], shares=[0.7, 0.3], mode="uniform")}


def frozen(name: str) -> bool:
    """The base LoRA would freeze: the embedding, the blocks' matrices and the head."""
    return name.endswith("weight") and any(k in name for k in ("embed", ".up.", ".down.", "head"))


def _freeze(module):
    for name, p in module.named_parameters():
        p.requires_grad_(not frozen(name))
    return module


class SGDMixin:
    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR, weight_decay=DECAY)


class LoraLayered(SGDMixin, TinyLayered):
    def __init__(self):
        super().__init__()
        _freeze(self)


class LoraUniform(SGDMixin, TinyUniform):
    def __init__(self):
        super().__init__()
        _freeze(self)


MODULES = {"layered": LoraLayered, "uniform": LoraUniform}
# data parallelism (groups of one rank, gradients in buckets): in bf16, and in fp32, where a rank holds
# each unit whole in one storage, master and frozen values side by side
REPLICATED = {"bf16-true": plan_of(batches=[8, 4], micro=[1, 1], shares=[1.0, 1.0], groups=[0, 1]),
              "32-true": plan_of(batches=[8, 4], micro=[1, 1], shares=[1.0, 1.0], groups=[0, 1])}
DTYPES = {"bf16-true": torch.bfloat16, "32-true": torch.float32, "bf16-mixed": torch.bfloat16}
MIXED = "bf16-mixed"  # autocast: trainable parameters gathered and computed from fp32, the frozen base in bf16


def reference(plan, reverse_ranks: bool = False, precision: str = "bf16-true") -> dict[str, torch.Tensor]:
    """Single-process SGD of the bf16-base model (``precision`` 32-true: the fp32 model) on the plan's
    global batches, each rank's piece weighted by its share of the samples (see the module docstring).
    ``bf16-mixed``: the fp32 model with its frozen parameters cast to bf16, its trainable ones fp32, the
    forward and the loss under CPU autocast to bf16."""
    dtype, mixed = DTYPES[precision], precision == MIXED
    base = TinyLM() if mixed else TinyLM().to(dtype)
    masters = {n: p.detach().float().clone().requires_grad_() for n, p in base.named_parameters() if not frozen(n)}
    fixed = {n: p.detach().to(dtype) for n, p in base.named_parameters() if frozen(n)}

    def loss_of(batch):
        params = {**fixed, **{n: m if mixed else m.to(dtype) for n, m in masters.items()}}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            return base.loss(functional_call(base, params, (batch[0],)), batch[1])

    steps = []
    for x, y in sliced(token_data(48), STEPS, plan.global_batch_size):
        starts = [sum(r.batch_size for r in plan.ranks[:k]) for k in range(len(plan.ranks))]
        ranks = [[((x[s : s + r.batch_size], y[s : s + r.batch_size]), r.batch_size / plan.global_batch_size)]
                 for s, r in zip(starts, plan.ranks)]
        steps.append(ranks[::-1] if reverse_ranks else ranks)
    train_steps(torch.optim.SGD(masters.values(), lr=LR, weight_decay=DECAY), loss_of, steps, clip=CLIP, per_rank=True)
    return {**{f"model.{n}": m.detach() for n, m in masters.items()}, **{f"model.{n}": v.float() for n, v in fixed.items()}}


class GatherCheck(pl.Callback):
    """Over the fit's steps: the elements every all-gather brought from the peers (the unit's or the
    part's size less this rank's shard of it, from the collectives' log) and the bytes this rank sent
    in all-gathers."""

    def on_train_start(self, trainer, pl_module):
        comm = trainer.strategy.sharded.comm
        comm.record, comm.log, self.before = True, [], comm.sent_bytes.get("all_gather", 0)

    def on_train_end(self, trainer, pl_module):
        sharded = trainer.strategy.sharded
        own = {(u.name, part.numel): part.shard_sizes[u.rank] for u in sharded.units
               for part in (u.layout, u.trainable_layout, u.frozen.layout if u.frozen else u.layout)}
        frozen_parts = {(u.name, u.frozen.layout.numel) for u in sharded.units if u.frozen is not None}
        gathers = [(name, numel) for op, name, numel in sharded.comm.log if op == "all_gather"]
        moved = sum(key[1] - own[key] for key in gathers)
        moved_frozen = sum(key[1] - own[key] for key in gathers if key in frozen_parts)
        self.figures = (moved, sharded.comm.sent_bytes.get("all_gather", 0) - self.before, moved_frozen)


def _ranks(rank: int, world: int, root: str):
    warnings.simplefilter("ignore")
    out = {}
    options = {"precision": "bf16-true", "gradient_clip_val": CLIP}
    for mode, plan in PLANS.items():
        gathers = GatherCheck()
        trainer = fit(MODULES[mode](), plan, world, STEPS, token_data(48), {**options, "callbacks": [gathers]},
                      gather_on_teardown="none", mode=mode)
        sharded = trainer.strategy.sharded
        units = sharded.units
        out[mode] = {
            "driven": str(trainer.strategy.fit_mode),
            "params": sharded.full_state_dict(),
            "frozen_dtypes": {str(p.dtype) for u in units for p, rg in zip(u.local_params, u.requires_grad) if not rg},
            "trainable_dtypes": {str(p.dtype) for u in units for p, rg in zip(u.local_params, u.requires_grad) if rg},
            "stored": sharded.local_state_bytes(),
            "local": [(sum(p.numel() for p, rg in zip(u.local_params, u.requires_grad) if rg),
                       sum(p.numel() for p, rg in zip(u.local_params, u.requires_grad) if not rg)) for u in units],
            "reduce_scatter_bytes": sharded.comm.sent_bytes.get("reduce_scatter", 0),
            "all_gather": gathers.figures,
        }
    for mode, plan in PLANS.items():  # bf16-mixed: the base in bf16, trainable parameters gathered in fp32
        gathers = GatherCheck()
        trainer = fit(MODULES[mode](), plan, world, STEPS, token_data(48),
                      {**options, "precision": MIXED, "callbacks": [gathers]}, gather_on_teardown="none", mode=mode)
        sharded = trainer.strategy.sharded
        out[f"{MIXED} {mode}"] = {
            "params": sharded.full_state_dict(),
            "frozen_dtypes": {str(p.dtype) for u in sharded.units for p in u.full_params if not p.requires_grad}
            | {str(p.dtype) for u in sharded.units for p, rg in zip(u.local_params, u.requires_grad) if not rg},
            "trainable_dtypes": {str(p.dtype) for u in sharded.units for p in u.full_params if p.requires_grad},
            "stored": sharded.local_state_bytes(),
            "local": [(sum(p.numel() for p, rg in zip(u.local_params, u.requires_grad) if rg),
                       sum(p.numel() for p, rg in zip(u.local_params, u.requires_grad) if not rg))
                      for u in sharded.units],
            "frozen_bytes_per_param": trainer.strategy.frozen_bytes_per_param(),
            "all_gather": gathers.figures,
        }
    for precision, plan in REPLICATED.items():
        trainer = fit(LoraLayered(), plan, world, STEPS, token_data(48), {**options, "precision": precision},
                      gather_on_teardown="none")
        units = trainer.strategy.sharded.units
        out[f"replicated {precision}"] = {
            "params": trainer.strategy.sharded.full_state_dict(),
            "resident": [u.resident for u in units if u.frozen is not None and u.trainable]}
    # resume: 2 steps, a checkpoint, 1 more step from it, against the 3 uninterrupted steps above
    first = fit(LoraLayered(), PLANS["layered"], world, 2, token_data(48), options, gather_on_teardown="none")
    path = f"{root}/step2.ckpt"
    first.save_checkpoint(path)
    resumed = fit(LoraLayered(), PLANS["layered"], world, STEPS, token_data(48), options, ckpt_path=path,
                  gather_on_teardown="none")
    out["resumed"] = resumed.strategy.sharded.full_state_dict()
    mixed = {**options, "precision": MIXED}
    first = fit(LoraLayered(), PLANS["layered"], world, 2, token_data(48), mixed, gather_on_teardown="none")
    first.save_checkpoint(f"{root}/mixed-step2.ckpt")
    resumed = fit(LoraLayered(), PLANS["layered"], world, STEPS, token_data(48), mixed,
                  ckpt_path=f"{root}/mixed-step2.ckpt", gather_on_teardown="none")
    out[f"resumed {MIXED}"] = resumed.strategy.sharded.full_state_dict()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_ranks, 2, str(tmp_path_factory.mktemp("frozen")))


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", list(PLANS))
def test_lora_with_a_bf16_base_trains_like_single_process_on_the_global_batch(runs, mode):
    plan = PLANS[mode]
    want, other = reference(plan), reference(plan, reverse_ranks=True)
    floor = max((want[k] - other[k]).abs().max().item() for k in want)
    bound = FLOOR * max(floor, FLOOR_EPS)
    for r in runs:
        got = r[mode]["params"]
        err = max((got[k].float() - v).abs().max().item() for k, v in want.items() if not frozen(k[len("model."):]))
        print(f"{mode}: largest difference {err:.2e}, floor {floor:.2e}, bound {bound:.2e}")
        assert err <= bound, (mode, err, bound)
        base = TinyLM().to(torch.bfloat16)
        for name, value in base.named_parameters():  # the base stays bitwise its bf16 values
            if frozen(name):
                assert torch.equal(got[f"model.{name}"], value.detach().float()), name


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", list(PLANS))
def test_the_frozen_base_is_stored_in_bf16_and_only_trainable_state_in_fp32(runs, mode):
    for r in runs:
        got = r[mode]
        assert got["driven"] == mode
        assert got["frozen_dtypes"] == {"torch.bfloat16"}
        assert got["trainable_dtypes"] == {"torch.float32"}
        trainable, frozen_ = (sum(t for t, _ in got["local"]), sum(f for _, f in got["local"]))
        assert frozen_ > 0
        assert got["stored"] == (4 * trainable, 2 * frozen_)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", list(PLANS))
def test_only_trainable_gradients_are_reduced(runs, mode):
    """Exact reduce-scatters on gloo: a rank sends every peer its range of each trainable part, so the
    ranks together send (W - 1) x 4 bytes per trainable element per step; a frozen element would add its own."""
    world = len(runs)
    trainable = sum(p.numel() for name, p in TinyLM().named_parameters() if not frozen(name))
    total = sum(r[mode]["reduce_scatter_bytes"] for r in runs)
    assert total == STEPS * (world - 1) * 4 * trainable


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", list(PLANS))
def test_every_all_gather_moves_bf16(runs, mode):
    """Exact all-gathers: a rank's shard to each peer; received = sent over the ranks, 2 bytes an element."""
    moved = sum(r[mode]["all_gather"][0] for r in runs)
    sent = sum(r[mode]["all_gather"][1] for r in runs)
    assert moved > 0
    assert sent == 2 * moved


@pytest.mark.multiprocess
def test_a_bf16_base_lora_run_resumes_exactly(runs):
    for r in runs:
        want, got = r["layered"]["params"], r["resumed"]
        for name, value in want.items():
            assert torch.equal(got[name], value), name


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision", list(REPLICATED))
def test_data_parallel_lora_trains_like_single_process(runs, precision):
    """Groups of one rank: the trainable parts' gradients all-reduced in buckets; in fp32 every unit of
    frozen and trainable parameters is held whole in one storage and computes from it (resident)."""
    plan = REPLICATED[precision]
    want, other = reference(plan, precision=precision), reference(plan, True, precision)
    floor = max((want[k] - other[k]).abs().max().item() for k in want)
    bound = FLOOR * max(floor, FLOOR_EPS)
    for r in runs:
        got = r[f"replicated {precision}"]
        assert got["resident"] and set(got["resident"]) == {precision == "32-true"}
        err = max((got["params"][k].float() - v).abs().max().item() for k, v in want.items())
        print(f"{precision}: largest difference {err:.2e}, floor {floor:.2e}, bound {bound:.2e}")
        assert err <= bound, (precision, err, bound)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", list(PLANS))
def test_bf16_mixed_stores_the_base_in_bf16_and_trains_like_single_process(runs, mode):
    """Under autocast the frozen base is stored, gathered and computed from in bf16 and the trainable
    parameters in fp32: the same maths as the single-process bf16-mixed model whose frozen parameters
    were cast to bf16, within 10x the floor; the base stays bitwise its bf16 values."""
    plan = PLANS[mode]
    want, other = reference(plan, precision=MIXED), reference(plan, True, MIXED)
    floor = max((want[k] - other[k]).abs().max().item() for k in want)
    bound = FLOOR * max(floor, FLOOR_EPS)
    for r in runs:
        got = r[f"{MIXED} {mode}"]
        assert got["frozen_dtypes"] == {"torch.bfloat16"}
        assert got["trainable_dtypes"] == {"torch.float32"}
        trainable, frozen_ = (sum(t for t, _ in got["local"]), sum(f for _, f in got["local"]))
        assert frozen_ > 0 and got["stored"] == (4 * trainable, 2 * frozen_)
        assert got["frozen_bytes_per_param"] == 2.0  # what the memory model is given
        err = max((got["params"][k].float() - v).abs().max().item() for k, v in want.items()
                  if not frozen(k[len("model."):]))
        print(f"{MIXED} {mode}: largest difference {err:.2e}, floor {floor:.2e}, bound {bound:.2e}")
        assert err <= bound, (mode, err, bound)
        for name, value in want.items():
            if frozen(name[len("model."):]):
                assert torch.equal(got["params"][name], value), name


@pytest.mark.multiprocess
def test_a_bf16_mixed_lora_run_resumes_exactly(runs):
    for r in runs:
        want, got = r[f"{MIXED} layered"]["params"], r[f"resumed {MIXED}"]
        for name, value in want.items():
            assert torch.equal(got[name], value), name


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", list(PLANS))
def test_bf16_mixed_gathers_the_base_in_bf16_and_the_trainable_part_in_fp32(runs, mode):
    moved = sum(r[f"{MIXED} {mode}"]["all_gather"][0] for r in runs)
    sent = sum(r[f"{MIXED} {mode}"]["all_gather"][1] for r in runs)
    moved_frozen = sum(r[f"{MIXED} {mode}"]["all_gather"][2] for r in runs)
    assert 0 < moved_frozen < moved
    assert sent == 2 * moved_frozen + 4 * (moved - moved_frozen)
