"""``Fabric(strategy="cephalo")``: a plain Fabric loop under an uneven plan equals single-process
training on the same global batches; its checkpoints resume exactly; the boundaries are refused.
(``Fabric(strategy="cephalo")`` in either import order: tests/lightning/test_registration.py.) The one spawn
also runs a two-rank Trainer fit whose stdout is not a terminal (progress lines, no warnings about
the strategy's own logs), the multi-rank half of tests/lightning/callback/test_cluster_logs.py."""

from __future__ import annotations

import contextlib
import io
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from cephalo_lightning import CephaloStrategy
from cephalo_lightning._common.errors import ConfigurationError, UnsupportedError
from cephalo_lightning.lightning.strategy.fabric import CephaloFabricStrategy
from tests.distributed import run_distributed
from tests.helpers import NUM_SAMPLES
from tests.lightning_models import TinyLayered, loader, token_data
from tests.plans import plan_of
from tests.reference import cut, sliced, train_steps
from tests.tiny_lm import TinyLM

GLOBAL = 12
STEPS = 3
TRAINER_PLAN = plan_of(batches=[9, 3], micro=[3, 1], shares=[0.25, 0.75])
ACCUMULATED_STEPS, CLIP = 2, 0.05  # two global batches per step: the 48 samples; a clip that binds
# rank 0: 4 samples and 70% of the state; rank 1: 8 samples and 30%
PLAN = plan_of(batches=[4, 8], micro=[1, 1], shares=[0.7, 0.3], mode="uniform")
# as in tests/models/test_models.py: 10x the spread of two single-process runs that only sum in another order
FLOOR_FACTOR = 10
FLOOR_EPS = 1e-12


def _frozen(name: str) -> bool:
    """A LoRA-like base: the embedding, the blocks' matrices and the head frozen."""
    return name.endswith("weight") and any(k in name for k in ("embed", ".up.", ".down.", "head"))


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
    model = TinyLM()
    parts = sliced(token_data(NUM_SAMPLES), steps * accumulate, GLOBAL)
    accumulated = [[(piece, weight / accumulate) for batch in parts[s * accumulate : (s + 1) * accumulate]
                    for piece, weight in cut(batch, split, GLOBAL)] for s in range(steps)]
    train_steps(_optimizer(model.parameters()), lambda batch: _loss(model, batch), accumulated, clip)
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
    batches = list(fabric.setup_dataloaders(DataLoader(token_data(NUM_SAMPLES), batch_size=GLOBAL)))
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
    # a frozen base under bf16-mixed, stored as the compute dtype says (bf16) and as NF4 blocks
    for storage in ("compute", "nf4"):
        fabric = Fabric(strategy=CephaloFabricStrategy(plan=PLAN, base_storage=storage), accelerator="cpu",
                        devices=world, precision="bf16-mixed")
        fabric.launch()
        model = TinyLM()
        for name, p in model.named_parameters():
            p.requires_grad_(not _frozen(name))
        model, optimizer = fabric.setup(model, _optimizer([p for p in model.parameters() if p.requires_grad]))
        with fabric.autocast():
            loss = _loss(model, next(iter(fabric.setup_dataloaders(DataLoader(token_data(NUM_SAMPLES),
                                                                              batch_size=GLOBAL)))))
        fabric.backward(loss)
        optimizer.step()
        units = fabric.strategy.sharded.units
        try:
            fabric.save(f"{folder}-{storage}", {"model": model})
            refused = ""
        except UnsupportedError as err:
            refused = str(err)
        out[f"frozen {storage}"] = {
            "kinds": {str(u.frozen.kind) for u in units if u.frozen is not None},
            "frozen_dtypes": {str(p.dtype) for u in units for p, rg in zip(u.local_params, u.requires_grad)
                              if not rg and not p.is_meta},
            "trainable_dtypes": {str(p.dtype) for u in units for p, rg in zip(u.local_params, u.requires_grad) if rg},
            "full": fabric.strategy.sharded.full_state_dict(), "refused": refused}
    # the same two ranks, a Trainer fit whose stdout is not a terminal (see tests/lightning/callback/test_cluster_logs.py)
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()) as text:
        warnings.simplefilter("always")
        t = pl.Trainer(strategy=CephaloStrategy(plan=TRAINER_PLAN, progress_every=2), accelerator="cpu", devices=world,
                       max_steps=4, logger=False, enable_model_summary=False, enable_checkpointing=False,
                       use_distributed_sampler=False)
        t.fit(TinyLayered(), loader(token_data(NUM_SAMPLES), GLOBAL))
    out["trainer_stdout"], out["trainer_warnings"] = text.getvalue(), [str(w.message) for w in caught]
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """ONE spawn of two gloo ranks for every scenario of this file."""
    return run_distributed(_fabric_loop, 2, str(tmp_path_factory.mktemp("fabric") / "ckpt"))


@pytest.mark.multiprocess
def test_a_fabric_loop_under_an_uneven_plan_equals_single_process_training(two_ranks):
    assert _error(two_ranks[0]["full"], _reference()) <= _tolerance()
    assert [r["sizes"] for r in two_ranks] == [[4] * STEPS, [8] * STEPS]
    assert [r["weight"] for r in two_ranks] == [4 / 12, 8 / 12]
    total = sum(v.numel() for v in TinyLM().state_dict().values())
    assert [round(r["local"] / total, 1) for r in two_ranks] == [0.7, 0.3]  # the plan's uneven shares


@pytest.mark.multiprocess
def test_fabric_save_and_load_resume_a_step_exactly(two_ranks):
    got = two_ranks[0]["full"]
    assert two_ranks[0]["resumed_step"] == 2
    assert all(torch.equal(two_ranks[0]["resumed"][k], got[k]) for k in got)  # the same step 2, bit for bit


@pytest.mark.multiprocess
def test_fabric_gradient_accumulation_and_clipping_equal_single_process(two_ranks):
    accumulated = {"steps": ACCUMULATED_STEPS, "accumulate": 2, "clip": CLIP}
    assert _error(two_ranks[0]["accumulated"], _reference(**accumulated)) <= _tolerance(**accumulated)


@pytest.mark.multiprocess
def test_a_two_rank_trainer_fit_prints_progress_lines_once_and_warns_nothing_about_its_own_logs(two_ranks):
    steps = [[int(m[1]) for m in re.finditer(r"^Epoch 0 \| step (\d+)/4 \| ", r["trainer_stdout"], re.MULTILINE)]
             for r in two_ranks]
    assert steps == [[2, 4], []]  # rank 0 only, each step once
    for r in two_ranks:
        assert not [w for w in r["trainer_warnings"] if "sync_dist" in w or "train_loss" in w], r["trainer_warnings"]


@pytest.mark.multiprocess
def test_fabric_stores_a_frozen_base_in_bf16_under_bf16_mixed_or_as_nf4(two_ranks):
    """base_storage reaches the sharded model: under bf16-mixed a frozen parameter is a bf16 piece
    (the trainable ones fp32) and stays bitwise its bf16 value through a step; ``nf4`` stores the
    base as NF4 blocks, and fabric.save refuses it by name rather than save pieces that hold no values."""
    start = TinyLM().state_dict()
    for r in two_ranks:
        bf16 = r["frozen compute"]
        assert bf16["kinds"] == {"compute"} and bf16["refused"] == ""
        assert bf16["frozen_dtypes"] == {"torch.bfloat16"} and bf16["trainable_dtypes"] == {"torch.float32"}
        for name, value in start.items():
            if _frozen(name):
                assert torch.equal(bf16["full"][name], value.to(torch.bfloat16).float()), name
        nf4 = r["frozen nf4"]
        assert nf4["kinds"] == {"nf4"} and nf4["trainable_dtypes"] == {"torch.float32"}
        assert "stored as nf4" in nf4["refused"], nf4["refused"]


def test_an_unknown_base_storage_is_refused_by_name():
    with pytest.raises(ConfigurationError, match=r"CephaloFabricStrategy\(base_storage='int8'\): choose one of"):
        CephaloFabricStrategy(global_batch_size=GLOBAL, base_storage="int8")


def test_a_layered_plan_is_refused_with_the_reason():
    layered = plan_of(batches=[4, 8], micro=[1, 2], shares=[0.7, 0.3])
    with pytest.raises(UnsupportedError, match="owns the forward and backward loop"):
        CephaloFabricStrategy(plan=layered)


def test_a_plan_with_shard_groups_is_refused_not_flattened():
    grouped = plan_of(batches=[4, 8], micro=[1, 1], shares=[1.0, 1.0], mode="uniform", groups=[0, 1])
    with pytest.raises(UnsupportedError, match=r"2 shard groups \[\[0\], \[1\]\].*groupings=\('full',\)"):
        CephaloFabricStrategy(plan=grouped)


def test_the_trainer_strategy_is_not_a_fabric_strategy():
    """Lightning's own refusal: the Trainer's CephaloStrategy is a Trainer strategy (the README says
    to use CephaloFabricStrategy or strategy="cephalo")."""
    with pytest.raises(ValueError, match="invalid strategy"):
        Fabric(strategy=CephaloStrategy(), accelerator="cpu", devices=1)


def test_other_precisions_are_refused_before_any_process_group():
    fabric = Fabric(strategy=CephaloFabricStrategy(global_batch_size=GLOBAL), precision="64-true", accelerator="cpu",
                    devices=1)
    with pytest.raises(UnsupportedError, match="precision"):
        fabric.strategy.setup_environment()  # what fabric.launch() calls first


def test_a_checkpoint_of_another_plan_and_a_dataloader_in_the_state_are_refused(tmp_path):
    """One rank, no process group: the refusals come before any collective."""
    strategy = Fabric(strategy=CephaloFabricStrategy(global_batch_size=GLOBAL), accelerator="cpu", devices=1).strategy
    # an even plan of one rank: share 1.0
    with pytest.raises(UnsupportedError, match="DataLoader"):
        strategy.save_checkpoint(tmp_path / "a", {"loader": DataLoader(token_data(NUM_SAMPLES), batch_size=GLOBAL)})
    (tmp_path / "b").mkdir()
    torch.save({"format": "cephalo-fabric/1", "state_shares": [0.7, 0.3], "state": {}}, tmp_path / "b" / "rank0-of-1.pt")
    with pytest.raises(ConfigurationError, match="same plan"):
        strategy.load_checkpoint(tmp_path / "b", {"step": 0})
