"""Trainer(precision=...) under the Cephalo strategy: 16-bit compute with fp32 masters on gloo ranks."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch

from cephalo_lightning import CephaloStrategy
from tests.distributed import run_distributed
from tests.lightning_models import TinyLayered, loader, token_data
from tests.models import TinyLM
from tests.plans import plan_of

PLAN = plan_of(batches=[8, 4], micro=[2, 1], shares=[0.7, 0.3])
STEPS = 3
LR = 0.1


class SGDLayered(TinyLayered):
    """SGD: an update is lr x gradient, so 16-bit rounding stays small (Adam's sign-like first
    steps would turn it into lr-sized differences)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def reference() -> dict[str, torch.Tensor]:
    data = token_data(48)
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = data[step * 12 : (step + 1) * 12]
        model.loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    return {f"model.{k}": v.detach() for k, v in model.state_dict().items()}


def _fit(rank: int, world: int):
    warnings.simplefilter("ignore")
    out = {}
    for precision in ("bf16-mixed", "bf16-true"):  # Lightning runs "16-mixed" as bf16-mixed on CPU
        trainer = pl.Trainer(
            strategy=CephaloStrategy(plan=PLAN), accelerator="cpu", devices=world, max_steps=STEPS,
            precision=precision, gradient_clip_val=0.5, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        )
        trainer.fit(SGDLayered(), loader(token_data(48), 12))
        out[precision] = {
            "params": trainer.strategy.sharded.full_state_dict(),
            "master_dtypes": {u.master.dtype for u in trainer.strategy.sharded.units if u.spans},
        }
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_fit, 2)


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
    from cephalo_lightning.lightning.precision import CephaloMixedPrecision
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
