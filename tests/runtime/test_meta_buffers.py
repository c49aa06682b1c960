"""A model built on the meta device gets every buffer a model built normally holds.

Non-persistent buffers (rotary ``inv_freq``, GPT-J's position table, Gemma's ``embed_scale``) are
neither in weight files nor, under every library version, written by the model's initialisation:
transformers 4.x's ``_init_weights`` never touches a rotary embedding, so a model built on meta
kept whatever memory its buffers were given. ``InitLikeTransformers4`` reproduces that
initialisation under the transformers this suite pins (``_init_weights`` for every module that
holds parameters or persistent buffers, nothing for a module holding only non-persistent ones).
Six families (three named adapters, three found by structure), built in ``configure_model()``
without ``pretrained=``, layered and uniform, on 2 gloo ranks (one spawn): every buffer on every
rank equals a freshly built model's, and three SGD steps equal single-process training from the
parameters the strategy materialised, within the family's measured noise floor. The guard that
refuses a buffer two computations disagree on, and a buffer nothing gives a value, run in-process.
"""

from __future__ import annotations

import functools
import itertools
import logging
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning.runtime.sharding.construction import ConstructionRecord
from cephalo_lightning.runtime.sharding.materialize import MetaBufferError
from tests.distributed import run_distributed
from tests.helpers import fit

transformers = pytest.importorskip("transformers")

from tests.discovered_models import Samples, build  # noqa: E402
from tests.plans import plan_of  # noqa: E402
from tests.reference import steps_of, target_tokens, train_steps  # noqa: E402

NAMED = ("llama", "qwen3", "gpt_neox")  # the named adapters' families
BY_STRUCTURE = ("gemma", "phi3", "gptj")  # layered by the structure (no adapter knows them)
FAMILIES = NAMED + BY_STRUCTURE
STEPS = 3
GLOBAL = 8
PLANS = {  # different micro-batch counts and shares in the layered plan; one count in the uniform one
    "layered": plan_of(batches=[5, 3], micro=[3, 1], shares=[0.3, 0.7]),
    "uniform": plan_of(batches=[6, 2], micro=[2, 2], shares=[0.4, 0.6], mode="uniform"),
}
# [Note: exactness bound] as tests/models/test_discovery.py: SGD in fp32, 1e-7 or FLOOR_FACTOR x the distance
# between single-process training on the whole batch and summed as the plan sums it (each rank's
# micro-batches accumulated, then the ranks added: the same training, its sums re-associated), from
# the same parameters; and never below one ulp of the largest parameter (a norm weight near 1 moves in
# steps of 1.19e-7, so a gradient summed in another order lands a whole ulp away: measured, Llama's
# uniform plan, 1.19e-7 where that plan's single-process floor was smaller).
FLOOR_FACTOR = 2


class BuiltOnMeta(pl.LightningModule):
    """A user's module: the library model built in ``configure_model()`` from its config."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.family = family
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build(self.family)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _holds_only_non_persistent_buffers(module: nn.Module) -> bool:
    return not any(p is not None for p in module._parameters.values()) and all(
        name in module._non_persistent_buffers_set for name, b in module._buffers.items() if b is not None)


class InitLikeTransformers4(BuiltOnMeta):
    """The initialisation transformers 4.x gives a meta-built model: ``_init_weights`` writes
    parameters and persistent buffers; a rotary embedding's frequencies are left as allocated."""

    def cephalo_init_weights(self, module: nn.Module) -> None:
        if not _holds_only_non_persistent_buffers(module):
            self.model._init_weights(module)


class Initial(pl.Callback):
    """The whole parameters as the strategy materialised them (collective: every rank calls it)."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module):
        self.params = trainer.strategy.sharded.full_state_dict()


def _meta_ranks(rank: int, world: int) -> dict:
    warnings.simplefilter("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    out = {}
    for family in FAMILIES:
        for mode, plan in PLANS.items():
            initial = Initial()
            module = InitLikeTransformers4(family)
            t = fit(module, plan, world, STEPS, Samples(family, GLOBAL * STEPS), {"callbacks": [initial]}, mode=mode)
            out[family, mode] = {
                "schedule": str(t.strategy.fit_runtime.schedule),
                "buffers": {n: b.clone() for n, b in module.model.named_buffers()},
                "initial": {n.removeprefix("model."): v for n, v in initial.params.items()},
                "final": {n: p.detach().clone() for n, p in module.model.named_parameters()},
            }
        # the model's own initialisation (transformers 5 writes the rotary frequencies too: the guard compares)
        module = BuiltOnMeta(family)
        fit(module, PLANS["layered"], world, 0, Samples(family, GLOBAL))
        out[family, "own init"] = {"buffers": {n: b.clone() for n, b in module.model.named_buffers()}}
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_meta_ranks, 2)


def _reference(family: str, start: dict[str, torch.Tensor], ranks: list[list[int]] | None) -> dict[str, torch.Tensor]:
    """Single-process SGD from ``start`` on the same global batches: whole, or as data parallelism
    sums it (``ranks``: each rank's micro-batch sizes; a rank's gradient accumulated over its
    micro-batches, each loss weighted by its share of the global batch's label tokens, then the
    ranks' gradients added in rank order)."""
    model = build(family)
    model.load_state_dict(start, strict=False)  # the parameters; the buffers stay the fresh model's
    ranks = ranks or [[GLOBAL]]
    pieces = steps_of(Samples(family, GLOBAL * STEPS).batch, STEPS, GLOBAL, [n for cuts in ranks for n in cuts],
                      target_tokens)
    steps = [[list(itertools.islice(step, len(cuts))) for cuts in ranks] for step in map(iter, pieces)]
    train_steps(torch.optim.SGD(model.parameters(), lr=0.5), lambda batch: model(**batch).loss, steps, per_rank=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.cache
def _fresh_buffers(family: str) -> dict[str, torch.Tensor]:
    return dict(build(family).named_buffers())


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_every_buffer_of_a_meta_built_model_is_a_fresh_models_on_every_rank(runs, family):
    fresh = _fresh_buffers(family)
    assert any("inv_freq" in n or "embed_positions" in n for n in fresh), f"{family} has no rotary buffer to check"
    for rank, out in enumerate(runs):
        for case in ("layered", "uniform", "own init"):
            got = out[family, case]["buffers"]
            assert got.keys() == fresh.keys(), (family, case)
            for name, want in fresh.items():
                assert torch.equal(got[name], want), (
                    f"{family} {case} rank {rank}: {name} differs from a fresh model's by "
                    f"{(got[name].double() - want.double()).abs().max().item():.3g}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", PLANS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_meta_built_model_trains_as_single_process_training_from_its_materialised_parameters(runs, family, mode):
    result = runs[0][family, mode]
    assert result["schedule"] == mode
    want = _reference(family, result["initial"], None)
    ranks = [list(rank.micro_batch_sizes) for rank in PLANS[mode].ranks]
    floor = max((want[n] - v).abs().max().item() for n, v in _reference(family, result["initial"], ranks).items())
    largest = max(v.abs().max() for v in want.values())
    bound = max(torch.finfo(torch.float32).eps * 2 ** torch.floor(torch.log2(largest)).item(), FLOOR_FACTOR * floor)
    moved = max((want[n] - result["initial"][n]).abs().max().item() for n in want)
    error = max((want[n] - result["final"][n]).abs().max().item() for n in want)
    assert moved > 100 * bound, f"{family}: training barely moved the parameters ({moved:.3g})"
    assert error <= bound, f"{family} {mode}: {error:.3g} from single-process training (bound {bound:.3g})"
    for rank_result in runs[1:]:  # every rank ends with the same whole parameters
        assert all(torch.equal(rank_result[family, mode]["final"][n], v) for n, v in result["final"].items())


# ----------------------------------------------------------------------------- in-process: the guard


def _one_rank(module: pl.LightningModule, family: str = "llama") -> pl.Trainer:
    plan = plan_of(batches=[GLOBAL], micro=[1], shares=[1.0])
    return fit(module, plan, 1, 0, Samples(family, GLOBAL))


class WrongFrequencies(BuiltOnMeta):
    """An initialisation that writes rotary frequencies other than the constructor's."""

    def cephalo_init_weights(self, module: nn.Module) -> None:
        self.model._init_weights(module)
        if "RotaryEmbedding" in type(module).__name__:
            module.inv_freq.mul_(1.5)


def test_a_buffer_the_initialisation_and_the_constructor_disagree_on_refuses_the_fit_naming_it():
    with pytest.raises(MetaBufferError, match=r"'model\.model\.rotary_emb\.inv_freq' \(LlamaRotaryEmbedding, "
                                              r"non-persistent\).*differ from what LlamaRotaryEmbedding's constructor"):
        _one_rank(WrongFrequencies("llama"))


class Rotary(nn.Module):
    """A user's rotary table: computed in the constructor, not saved, no ``reset_parameters()``."""

    def __init__(self, dim: int, length: int) -> None:
        super().__init__()
        inv_freq = 1.0 / 10_000 ** (torch.arange(0, dim, 2).float() / dim)
        angles = torch.outer(torch.arange(length).float(), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)


class Attention(nn.Module):
    """A block whose ``reset_parameters()`` writes its weights, not the mask its constructor made."""

    def __init__(self, dim: int, length: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dim))
        self.register_buffer("mask", torch.full((length, length), float("-inf")).triu(1), persistent=False)
        self.mask[0, 0] = 0.5  # written in place after it was made
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight


class UserModel(pl.LightningModule):
    """The layered protocol, with buffers in the root unit and in a block."""

    def __init__(self, on_meta_in_init: bool = False) -> None:
        super().__init__()
        self.on_meta_in_init = on_meta_in_init
        self.rotary = self.blocks = None
        if on_meta_in_init:
            with torch.device("meta"):
                self.configure_model()

    def configure_model(self) -> None:
        if self.blocks is None:
            self.embed = nn.Embedding(11, 8)
            self.rotary = Rotary(8, 6)
            self.blocks = nn.ModuleList([Attention(8, 6) for _ in range(2)])

    def cephalo_layers(self):
        return [self.embed, *self.blocks]

    def cephalo_input(self, batch):
        return batch[0]

    def cephalo_loss(self, out, batch):
        return (out * self.rotary.cos.sum()).pow(2).mean()

    def training_step(self, batch, batch_idx):
        h = self.embed(batch[0])
        for block in self.blocks:
            h = block(h)
        return self.cephalo_loss(h, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _user_fit(module: UserModel) -> pl.Trainer:
    plan = plan_of(batches=[4], micro=[1], shares=[1.0])
    data = torch.utils.data.TensorDataset(torch.randint(0, 11, (4, 6)))
    return fit(module, plan, 1, 0, data)


def test_a_users_constructor_computed_buffers_are_replayed_in_the_root_and_in_blocks():
    module = UserModel()
    _user_fit(module)
    eager = UserModel()
    eager.configure_model()
    want = dict(eager.named_buffers())
    got = dict(module.named_buffers())
    assert got.keys() == want.keys() and len(want) == 4
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_meta_buffer_nothing_gives_a_value_refuses_the_fit_naming_it():
    with pytest.raises(MetaBufferError, match=r"buffer 'rotary\.cos' \(Rotary\) was built on the meta device and "
                                              r"nothing gives it a value.*configure_model\(\)"):
        _user_fit(UserModel(on_meta_in_init=True))  # built on meta by the user: no record of its constructor


class NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3))


class MetaWithoutInit(BuiltOnMeta):
    def configure_model(self) -> None:
        super().configure_model()
        self.extra = NoInit()


def test_a_setup_failure_of_a_meta_built_model_is_reported_as_itself():
    """Lightning's teardown moves the module to the host, which a meta tensor refuses: the
    failure that stopped the setup must reach the user, not that."""
    with pytest.raises(ConfigurationError, match="NoInit was built on the meta device and has no reset_parameters"):
        _one_rank(MetaWithoutInit("llama"))


# ----------------------------------------------------------------------------- the record itself


def test_the_replay_follows_in_place_writes_casts_and_the_default_dtype_and_leaves_out_what_it_never_saw():
    record = ConstructionRecord()
    outside = torch.empty(3, device="meta")
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"), record:
            table = torch.arange(4) / 4  # float64: the default dtype while it was built
            table[1] = 7.0
            table.mul_(2)
            half = table.to(torch.float16)
            tainted = outside + 1
    finally:
        torch.set_default_dtype(torch.float32)
    values = record.replay([table, half, tainted])
    expected = torch.tensor([0.0, 14.0, 1.0, 1.5], dtype=torch.float64)
    assert values[id(table)].dtype == torch.float64 and torch.equal(values[id(table)], expected)
    assert torch.equal(values[id(half)], expected.half())
    assert id(tainted) not in values


def test_the_replay_computes_no_parameter():
    """A buffer's replay runs the calls it depends on, not the model's: a layer's weights (and their
    initialisation, an in-place write) are never made on the host."""
    record = ConstructionRecord()
    with torch.device("meta"), record:
        model = nn.Sequential(nn.Linear(64, 64), Rotary(8, 6))
    made = []

    class Sizes(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                made.append(out.numel())
            return out

    with Sizes():
        values = record.replay(list(model.buffers()))
    assert len(values) == 2 and made and max(made) < 64 * 64
