"""Trainer(precision=...) under the Cephalo strategy: 16-bit compute with fp32 masters on gloo ranks."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from cephalo_lightning import Plan
from tests.distributed import run_distributed
from tests.helpers import fit
from tests.lightning_models import TinyLayered, token_data
from tests.plans import plan_of
from tests.reference import sliced, tiny_loss, train_steps, whole
from tests.tiny_lm import TinyLM

PLAN = plan_of(batches=[8, 4], micro=[2, 1], shares=[0.7, 0.3])
STEPS = 3
LR = 0.1
FLOOR = 10  # x the measured noise floor, as tests/models/test_models.py ([Note: tolerances from the noise floor])
FLOOR_EPS = 1e-12


class SGDLayered(TinyLayered):
    """SGD: an update is lr x gradient, so 16-bit rounding stays small (Adam's sign-like first
    steps would turn it into lr-sized differences)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def reference() -> dict[str, torch.Tensor]:
    model = TinyLM()
    train_steps(torch.optim.SGD(model.parameters(), lr=LR), tiny_loss(model), whole(sliced(token_data(48), STEPS, 12)), clip=0.5)
    return {f"model.{k}": v.detach() for k, v in model.state_dict().items()}


def same_precision_reference(precision: str, plan: Plan = PLAN, drop: int | None = None,
                             weights: tuple[float, ...] | None = None, skip: int | None = None,
                             resummed: bool = False) -> dict[str, torch.Tensor]:
    """Single-process SGD in ``precision`` on the plan's own micro-batches, as the runtime computes:
    fp32 master weights; bf16-mixed: fp32 parameters under bf16 autocast; bf16-true: the masters
    start as the bf16-cast module's values (Lightning casts the module before it is sharded), a
    bf16 copy of them computes, each rank's micro-batch gradients accumulate in bf16 and the ranks'
    sums are added in fp32. Each micro-batch's mean loss is weighted by its share of the samples;
    the gradient norm for clipping is summed in fp64.

    The mistakes a bound must catch: ``drop`` (a global sample index left out), ``weights`` (each
    rank's samples weighted by this instead of 1 / 12), ``skip`` (a step whose update is lost). ``resummed``: the
    same maths summed otherwise, each micro-batch's gradient added to the fp32 total alone, the last
    first; how far that lands is the precision's noise floor."""
    data = token_data(48)
    model = TinyLM()
    if precision == "bf16-true":
        model = model.to(torch.bfloat16).float()
    for step in range(STEPS):
        x, y = data[step * 12 : (step + 1) * 12]
        keep = [i for i in range(12) if step * 12 + i != drop]
        start, parts = 0, []
        for rank, r in enumerate(plan.ranks):
            parts.append([(rank, start + sum(r.micro_batch_sizes[:k]), size) for k, size in enumerate(r.micro_batch_sizes)])
            start += r.batch_size
        groups = [[m] for ms in parts for m in ms][::-1] if resummed else parts
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for micro in groups:
            work = copy.deepcopy(model).to(torch.bfloat16) if precision == "bf16-true" else model
            for rank, begin, size in micro:
                rows = [i for i in range(begin, begin + size) if i in keep]
                weight = (len(rows) / len(keep)) if weights is None else weights[rank] * size
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                    (work.loss(work(x[rows]), y[rows]) * weight).backward()
            for g, p in zip(grads, work.parameters()):
                g += p.grad.float()
                p.grad = None
        norm = sum(g.double().pow(2).sum() for g in grads).sqrt()
        coef = (0.5 / (norm + 1e-6)).clamp(max=1.0)
        if step != skip:
            with torch.no_grad():
                for p, g in zip(model.parameters(), grads):
                    p -= LR * g * coef.to(g.dtype)
    return {f"model.{k}": v.detach() for k, v in model.state_dict().items()}


def _precision_ranks(rank: int, world: int):
    warnings.simplefilter("ignore")
    out = {}
    for precision in ("bf16-mixed", "bf16-true"):  # Lightning runs "16-mixed" as bf16-mixed on CPU
        trainer = fit(SGDLayered(), PLAN, world, STEPS, token_data(48), {"precision": precision, "gradient_clip_val": 0.5})
        out[precision] = {
            "params": trainer.strategy.sharded.full_state_dict(),
            "master_dtypes": {u.master.dtype for u in trainer.strategy.sharded.units if u.spans},
        }
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_precision_ranks, 2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision,tol", [("bf16-mixed", 3e-3), ("bf16-true", 1e-2)])
def test_16_bit_training_tracks_fp32_with_fp32_masters(runs, precision, tol):
    want = reference()
    for rank_result in runs:
        got = rank_result[precision]
        assert got["master_dtypes"] == {torch.float32}
        err = max((got["params"][k].float() - v).abs().max().item() for k, v in want.items())
        assert err <= tol, f"{precision}: {err}"


def _overflow_on_one_rank(rank: int, world: int):
    """fp16 AMP: an inf gradient on ONE rank must make EVERY rank skip the step and back off."""
    from cephalo_lightning.lightning.strategy.precision import CephaloMixedPrecision
    from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

    plugin = CephaloMixedPrecision("16-mixed", "cpu")
    model = TinyLM()
    sharded = ShardedModel(model, [0.6, 0.4])
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = token_data(8)[:8]
    sharded.backward(plugin.scaler.scale(model.loss(model(x), y)))
    if rank == 0:
        next(p for p in model.parameters() if p.numel()).grad[0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    scale = float(plugin.scaler.get_scale())
    plugin.scaler.step(optimizer)
    plugin.scaler.update()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return unchanged, scale, float(plugin.scaler.get_scale())


@pytest.mark.multiprocess
def test_16_mixed_scaler_skips_the_step_on_every_rank_together():
    results = run_distributed(_overflow_on_one_rank, 2)
    for unchanged, before, after in results:
        assert unchanged and after < before  # skipped and backed off, on the rank without the inf too


def _error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max((got[k].float() - v).abs().max().item() for k, v in want.items())


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_training_equals_single_process_training_in_the_same_precision(runs, precision):
    """Against single-process training in the same precision on the same micro-batches, bounded by
    that precision's noise floor (the same reference summed otherwise, x FLOOR),
    a bound a dropped sample, ranks weighted wrongly or a skipped step each exceed (the bound of
    ``test_16_bit_training_tracks_fp32_with_fp32_masters`` does not)."""
    want = same_precision_reference(precision)
    floor = _error(same_precision_reference(precision, resummed=True), want)
    bound = FLOOR * floor + FLOOR_EPS
    for rank_result in runs:
        err = _error(rank_result[precision]["params"], want)
        assert err <= bound, f"{precision}: {err:.2e} > {bound:.2e} (noise floor {floor:.2e})"
    mistakes = {"a sample dropped": same_precision_reference(precision, drop=13),
                "each rank's mean weighted 1/2": same_precision_reference(precision, weights=(0.5 / 8, 0.5 / 4)),
                "a step skipped": same_precision_reference(precision, skip=1)}
    for what, wrong in mistakes.items():
        assert _error(wrong, want) > bound, f"{precision}: {what} lands within the bound {bound:.2e}"
