"""``Fabric(strategy="cephalo")``: a plain Fabric loop under an uneven plan equals single-process
training on the same global batches; its checkpoints resume exactly; the boundaries are refused.
(``Fabric(strategy="cephalo")`` in either import order: tests/test_registration.py.)"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from cephalo_lightning import CephaloStrategy, Plan
from cephalo_lightning._common.errors import UnsupportedError
from cephalo_lightning.lightning.fabric import CephaloFabricStrategy
from cephalo_lightning.planner import RankPlan
from tests.distributed import run_distributed
from tests.helpers import NUM_SAMPLES
from tests.lightning_models import token_data
from tests.models import TinyLM

GLOBAL = 12
STEPS = 3
ACCUMULATED_STEPS, CLIP = 2, 0.05  # two global batches per step: the 48 samples; a clip that binds
# rank 0: 4 samples and 70% of the state; rank 1: 8 samples and 30%
PLAN = Plan(GLOBAL, "uniform", (RankPlan(0, "a", 4, 1, 4, 0.7), RankPlan(1, "b", 8, 1, 8, 0.3)))
# as in tests/test_models.py: 10x the spread of two single-process runs that only sum in another order
FLOOR_FACTOR = 10
FLOOR_EPS = 1e-12


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)  # momentum: the optimizer state matters on resume


def _loss(model, batch) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _reference(split: tuple[int, ...] = (GLOBAL,), steps: int = STEPS, accumulate: int = 1,
               clip: float | None = None) -> dict[str, torch.Tensor]:
    """One process, the global batches in order (``accumulate`` of them per optimizer step), each
    cut into ``split`` (weighted by size)."""
    data = token_data(NUM_SAMPLES)
    model = TinyLM()
    optimizer = _optimizer(model.parameters())
    for batch in range(steps * accumulate):
        start = batch * GLOBAL
        for size in split:
            (_loss(model, data[start : start + size]) * (size / GLOBAL / accumulate)).backward()
            start += size
        if (batch + 1) % accumulate:
            continue
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _tolerance(**settings) -> float:
    """FLOOR_FACTOR x the largest difference of two single-process runs in other summation orders."""
    whole, split = _reference(**settings), _reference((5, 4, 3), **settings)
    return FLOOR_FACTOR * max((whole[k] - split[k]).abs().max().item() for k in whole) + FLOOR_EPS


def _error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max((got[k] - want[k]).abs().max().item() for k in want)


def _fabric_loop(rank: int, world: int, folder: str) -> dict:
    warnings.simplefilter("ignore")
    fabric = Fabric(strategy=CephaloFabricStrategy(plan=PLAN), accelerator="cpu", devices=world)
    fabric.launch()
    model = TinyLM()
    model, optimizer = fabric.setup(model, _optimizer(model.parameters()))
    loader = fabric.setup_dataloaders(DataLoader(token_data(NUM_SAMPLES), batch_size=GLOBAL))
    batches = list(loader)
    sizes = []
    for step in range(STEPS):
        if step == 2:
            fabric.save(folder, {"model": model, "optimizer": optimizer, "step": step})
        sizes.append(len(batches[step][0]))
        fabric.backward(_loss(model, batches[step]))
        optimizer.step()
        optimizer.zero_grad()
    sharded = fabric.strategy.sharded
    out = {"full": sharded.full_state_dict(), "sizes": sizes, "local": sharded.local_state_numel(),
           "weight": fabric.strategy.loss_weight}
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(folder, state)  # back to before step 2, then step 2 again
    fabric.backward(_loss(model, batches[state["step"]]))
    optimizer.step()
    out["resumed"], out["resumed_step"] = sharded.full_state_dict(), state["step"]
    # gradient accumulation over two global batches (no_backward_sync) and clipping: a fresh Fabric
    fabric = Fabric(strategy=CephaloFabricStrategy(plan=PLAN), accelerator="cpu", devices=world)
    fabric.launch()
    model = TinyLM()
    model, optimizer = fabric.setup(model, _optimizer(model.parameters()))
    batches = iter(fabric.setup_dataloaders(DataLoader(token_data(NUM_SAMPLES), batch_size=GLOBAL)))
    for _ in range(ACCUMULATED_STEPS):
        with fabric.no_backward_sync(model):
            fabric.backward(_loss(model, next(batches)) / 2)
        fabric.backward(_loss(model, next(batches)) / 2)
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
    out["accumulated"] = fabric.strategy.sharded.full_state_dict()
    return out


@pytest.mark.multiprocess
def test_a_fabric_loop_under_an_uneven_plan_equals_single_process_training_and_resumes_exactly(tmp_path):
    ranks = run_distributed(_fabric_loop, 2, str(tmp_path / "ckpt"))
    want = _reference()
    got = ranks[0]["full"]
    assert _error(got, want) <= _tolerance()
    accumulated = {"steps": ACCUMULATED_STEPS, "accumulate": 2, "clip": CLIP}
    assert _error(ranks[0]["accumulated"], _reference(**accumulated)) <= _tolerance(**accumulated)
    assert [r["sizes"] for r in ranks] == [[4] * STEPS, [8] * STEPS]
    assert [r["weight"] for r in ranks] == [4 / 12, 8 / 12]
    total = sum(v.numel() for v in want.values())
    assert [round(r["local"] / total, 1) for r in ranks] == [0.7, 0.3]  # the plan's uneven shares
    assert ranks[0]["resumed_step"] == 2
    assert all(torch.equal(ranks[0]["resumed"][k], got[k]) for k in got)  # the same step 2, bit for bit


def test_a_layered_plan_is_refused_with_the_reason():
    layered = Plan(GLOBAL, "layered", (RankPlan(0, "a", 4, 1, 4, 0.7), RankPlan(1, "b", 8, 2, 4, 0.3)))
    with pytest.raises(UnsupportedError, match="owns the forward and backward loop"):
        CephaloFabricStrategy(plan=layered)


def test_the_trainer_strategy_is_not_a_fabric_strategy():
    """Lightning's own refusal: the Trainer's CephaloStrategy is a Trainer strategy (the README says
    to use CephaloFabricStrategy or strategy="cephalo")."""
    with pytest.raises(ValueError, match="invalid strategy"):
        Fabric(strategy=CephaloStrategy(), accelerator="cpu", devices=1)
