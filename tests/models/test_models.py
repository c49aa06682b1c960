"""Real models, zero code: HF transformers and litgpt LMs under ``strategy="cephalo"``.

Every family is built tiny from its config (no downloads) inside a LightningModule that knows
nothing about Cephalo (``training_step`` returns ``self.model(**batch).loss``), trained on padded
dict batches of random lengths, and compared with single-process training on the same global
batches: parameters (and Adam moments) equal, under two different plans, on 2 and 3 ranks.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("litgpt")

from cephalo_lightning import Plan  # noqa: E402
from tests.assembly import assemble, strategy_pieces  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.helpers import fit  # noqa: E402
from tests.library_models import LibraryLM, PaddedTokens, noise_floor, reference  # noqa: E402
from tests.plans import plan_of  # noqa: E402

FAMILIES = ("gpt2", "llama", "qwen2", "gpt_neox", "litgpt")
STEPS = 3
GLOBAL = 12

# [Note: tolerances from the noise floor] Even in fp64 these libraries compute some things in fp32
# (masks, rotary tables), so how closely a sharded run can match single-process training depends
# on the family: gpt_neox's parameters land ~2e-6 apart between two single-process runs that only
# sum in another order, gpt2's ~1e-7. So the bound is measured, per family and per kind of tensor
# (parameters, exp_avg, exp_avg_sq: their scales differ by orders of magnitude): the largest
# difference between the whole-batch reference and the same training micro-batched 5 + 4 + 3
# (library_models.noise_floor), times FLOOR_FACTOR, plus FLOOR_EPS where that floor is 0. The
# sharded run re-associates the same sums once more (other micro-batches, partial sums reduced
# across ranks), which is the same kind of noise, varying by a small factor from one order to
# another; 10 leaves room for that, while a real error (a wrong sample, a stale shard, a lost
# moment) is orders of magnitude above it.
FLOOR_FACTOR = 10
FLOOR_EPS = 1e-12


def _kind(name: str) -> str:
    return name.rpartition(".")[2] if name.endswith((".exp_avg", ".exp_avg_sq")) else "parameter"


def tolerances(family: str, optimizer: str, dtype: torch.dtype) -> dict[str, float]:
    """Per tensor name: FLOOR_FACTOR x the noise floor of its kind of tensor, plus FLOOR_EPS."""
    floor = noise_floor(family, optimizer, STEPS, GLOBAL, PaddedTokens(GLOBAL * STEPS), dtype)
    by_kind: dict[str, float] = {}
    for name, value in floor.items():
        by_kind[_kind(name)] = max(by_kind.get(_kind(name), 0.0), value)
    return {name: FLOOR_FACTOR * by_kind[_kind(name)] + FLOOR_EPS for name in floor}

PLANS = {
    3: [plan_of(batches=[2, 6, 4], micro=[1, 3, 4], shares=[0.6, 0.3, 0.1]),
        plan_of(batches=[7, 0, 5], micro=[2, 1, 5], shares=[0.1, 0.5, 0.4])],
    2: [plan_of(batches=[9, 3], micro=[4, 1], shares=[0.25, 0.75]),
        plan_of(batches=[1, 11], micro=[1, 3], shares=[0.9, 0.1])],
}

# HF activation checkpointing (each layer's forward recomputed inside its backward by the library)
CHECKPOINTED = ("gpt2", "llama")
UNIFORM = plan_of(batches=[7, 5], micro=[2, 2], shares=[0.4, 0.6], mode="uniform")


def _fitted_pieces(family: str, plan: Plan, world: int, optimizer: str, precision: str,
         checkpointing: bool = False) -> dict[str, tuple[int, torch.Tensor]]:
    trainer = fit(LibraryLM(family, optimizer, checkpointing=checkpointing), plan, world, STEPS,
                  PaddedTokens(GLOBAL * STEPS), {"precision": precision}, mode=plan.mode)
    assert trainer.strategy.fit_runtime.schedule == plan.mode
    return strategy_pieces(trainer.strategy)


def _all(rank: int, world: int):
    warnings.simplefilter("ignore")
    out = {}
    for family in FAMILIES:
        for index, plan in enumerate(PLANS[world]):
            out[(family, "sgd", index)] = _fitted_pieces(family, plan, world, "sgd", "32-true")
        out[(family, "adamw", 0)] = _fitted_pieces(family, PLANS[world][0], world, "adamw", "64-true")
    for index, plan in enumerate(PLANS[world]):  # peft LoRA: adapters trained, the base frozen
        out[("llama", "lora", index)] = _fitted_pieces("llama", plan, world, "lora", "32-true")
    if world == 2:
        out[("llama", "lora", "uniform")] = _fitted_pieces("llama", UNIFORM, world, "lora", "32-true")
        for family in CHECKPOINTED:
            for plan in (PLANS[2][0], UNIFORM):
                out[(family, "checkpointed", plan.mode)] = _fitted_pieces(family, plan, world, "sgd", "32-true", checkpointing=True)
    return out


@pytest.fixture(scope="module")
def bounds():
    """``bounds(family, optimizer, dtype)``: :func:`tolerances`, each measured once per module
    (the 2- and 3-rank runs are compared with the same references)."""
    measured: dict[tuple, dict[str, float]] = {}

    def get(family: str, optimizer: str, dtype: torch.dtype) -> dict[str, float]:
        if (family, optimizer, dtype) not in measured:
            measured[family, optimizer, dtype] = tolerances(family, optimizer, dtype)
        return measured[family, optimizer, dtype]

    return get


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def runs(request):
    world = request.param
    return world, run_distributed(_all, world)


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_library_lm_trains_exactly_like_single_process_under_two_plans(runs, bounds, family):
    world, results = runs
    data = PaddedTokens(GLOBAL * STEPS)
    want = reference(family, "sgd", STEPS, GLOBAL, data)
    bound = bounds(family, "sgd", torch.float32)
    for index in range(len(PLANS[world])):
        got = assemble([r[(family, "sgd", index)] for r in results], torch.float64)
        for name, value in want.items():
            assert not torch.isnan(got[name]).any(), f"{name}: an element is owned by nobody"
            err = (got[name].float() - value.reshape(-1)).abs().max().item()
            assert err <= bound[name], f"{family} plan {index}: {name} differs by {err:.2e} > {bound[name]:.2e}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_library_lm_adamw_fp64_parameters_and_moments_match(runs, bounds, family):
    world, results = runs
    data = PaddedTokens(GLOBAL * STEPS)
    want = reference(family, "adamw", STEPS, GLOBAL, data, dtype=torch.float64)
    got = assemble([r[(family, "adamw", 0)] for r in results], torch.float64)
    assert set(want) <= set(got)
    bound = bounds(family, "adamw", torch.float64)
    for name, value in want.items():
        err = (got[name] - value.reshape(-1)).abs().max().item()
        assert err <= bound[name], f"{family}: {name} differs by {err:.2e} > {bound[name]:.2e}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("runs", [2], indirect=True, ids=["2-ranks"])  # the 2-rank spawn only (checkpointed there)
@pytest.mark.parametrize("mode", ["layered", "uniform"])
@pytest.mark.parametrize("family", CHECKPOINTED)
def test_hf_activation_checkpointing_trains_exactly_in_both_modes(runs, bounds, family, mode):
    """``gradient_checkpointing_enable()`` makes the library re-run each layer inside its backward;
    the sharded run must still be single-process training (without checkpointing: the same maths)."""
    _, results = runs
    want = reference(family, "sgd", STEPS, GLOBAL, PaddedTokens(GLOBAL * STEPS))
    bound = bounds(family, "sgd", torch.float32)
    got = assemble([r[(family, "checkpointed", mode)] for r in results], torch.float64)
    for name, value in want.items():
        err = (got[name].float() - value.reshape(-1)).abs().max().item()
        assert err <= bound[name], f"{family} {mode}, checkpointed: {name} differs by {err:.2e} > {bound[name]:.2e}"


@pytest.mark.multiprocess
def test_lora_adapters_train_like_single_process_and_the_base_stays_bitwise_frozen(runs, bounds):
    """peft LoRA (AdamW over the adapters) under two layered plans on 2 and 3 ranks, and a uniform
    plan on 2: adapters and their moments within the noise floor of single-process training, and
    every frozen parameter bitwise what it was built as."""
    world, results = runs
    data = PaddedTokens(GLOBAL * STEPS)
    want = reference("llama", "lora", STEPS, GLOBAL, data)
    start = {name: p.detach() for name, p in LibraryLM("llama", "lora").named_parameters()}
    bound = bounds("llama", "lora", torch.float32)
    keys = [k for k in results[0] if k[:2] == ("llama", "lora")]
    assert len(keys) == len(PLANS[world]) + (world == 2)
    adapters = [name for name, p in LibraryLM("llama", "lora").named_parameters() if p.requires_grad]
    assert adapters and all(".lora_" in name for name in adapters)
    for key in keys:
        got = assemble([r[key] for r in results], torch.float64)
        for name, value in want.items():
            if name in start and name not in adapters:  # frozen: exactly as built, never moved
                assert torch.equal(got[name].float(), start[name].reshape(-1)), f"{key}: frozen {name} changed"
                continue
            err = (got[name].float() - value.reshape(-1)).abs().max().item()
            assert err <= bound[name], f"{key}: {name} differs by {err:.2e} > {bound[name]:.2e}"
        moved = max((want[n] - start[n]).abs().max().item() for n in adapters)
        assert moved > 100 * max(bound[n] for n in adapters), "the adapters barely moved: the check would be empty"


def test_the_library_checkpoint_under_the_layered_schedule_is_named_at_setup():
    from cephalo_lightning.lightning.fit.fit_runtime import recomputed_twice

    module = LibraryLM("llama")
    assert recomputed_twice(module) is None
    note = recomputed_twice(LibraryLM("llama", checkpointing=True))
    assert note is not None and "LlamaDecoderLayer" in note and "gradient_checkpointing_disable()" in note
