"""The layered mode for models no named adapter knows: the block sequence found from the structure.

Every family of :mod:`tests.discovered_models` trains with ``strategy="cephalo"`` and a plan with
different micro-batch counts and state shares per rank (2 and 3 gloo ranks, one spawn each), on
padded batches of random lengths, and must land on single-process training on the same global
batches, in the layered mode. Models whose blocks do not form a sequence fall back to the uniform
mode with one log line, and stay exact (in-process, one rank).
"""

from __future__ import annotations

import functools
import logging
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from cephalo_lightning.lightning.steps.layered_steps import LayeredSteps  # noqa: E402
from cephalo_lightning.lightning.steps.uniform_steps import UniformSteps  # noqa: E402
from cephalo_lightning.models import resolve  # noqa: E402
from cephalo_lightning.models.discovery import Discovery, block_list  # noqa: E402
from tests.assembly import assemble, strategy_pieces  # noqa: E402
from tests.discovered_models import FAMILIES, Samples, Wrapped, reference  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.helpers import fit  # noqa: E402
from tests.plans import plan_of  # noqa: E402
from tests.reference import train_steps, whole  # noqa: E402

STEPS = 2
GLOBAL = 8
PLANS = {  # different micro-batch counts and state shares on every rank
    2: plan_of(batches=[5, 3], micro=[3, 1], shares=[0.3, 0.7]),
    3: plan_of(batches=[3, 4, 1], micro=[2, 1, 1], shares=[0.5, 0.2, 0.3]),
}
# [Note: exactness bound] SGD in fp32: 1e-7, or where larger the measured noise floor: FLOOR_FACTOR x
# the distance from the whole-batch run of single-process training cut as the plan cuts the batch
# (rank by rank, micro-batch by micro-batch: the same training, its sums re-associated). A token
# embedding's gradient sums every occurrence of its token, and one ulp of a parameter in [1, 2) (a
# norm weight initialised to 1, the encoder's N(0, 1) embedding) is 1.19e-7 in fp32, so 1e-7 is below
# the floor of several families. Measured (two steps, the 2- and 3-rank plans): single-process
# training cut as the plan cuts it is 1.19e-7 / 1.03e-7 from the whole batch for Gemma2, 3.28e-7 /
# 3.58e-7 Gemma3 and 2.09e-7 / 2.09e-7 OLMo2 (an embedding entry near 0.3: 11 of its ulps), 1.19e-7 the
# encoder. On one rank (micro-batches 3+3+2) the layered run equals the same-cut single-process run
# bit for bit for OLMo2, Qwen2-MoE, ViT and the encoder; with tied embeddings (Gemma2, Gemma3, BERT)
# the tied weight's two gradients are summed in another order (the head's for every micro-batch in
# the last layer, then the embedding's): 2-3 ulps of it.
EXACT = 1e-7
FLOOR_FACTOR = 2


def _strategy_options(family: str) -> dict:
    # the masked LM's loss is a mean over its label tokens (labels here from position 1 on)
    return {"loss_weighting": "tokens"} if family == "bert_mlm" else {}


def _fit_all(rank: int, world: int) -> dict:
    warnings.simplefilter("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    out = {}
    for family in FAMILIES:
        t = fit(Wrapped(family), PLANS[world], world, STEPS, Samples(family, GLOBAL * STEPS), **_strategy_options(family))
        out[family] = (t.strategy.fit_runtime.schedule, strategy_pieces(t.strategy))
    return out


@functools.cache
def _reference(family: str) -> dict[str, torch.Tensor]:
    return reference(family, STEPS, GLOBAL, Samples(family, GLOBAL * STEPS))


def _floor_bound(family: str, want: dict[str, torch.Tensor], cuts: list[int]) -> float:
    """FLOOR_FACTOR x how far single-process training cut into ``cuts`` lands from ``want``."""
    cut = reference(family, STEPS, GLOBAL, Samples(family, GLOBAL * STEPS), cuts)
    floor = max((value - want[n]).abs().max().item() for n, value in cut.items())
    return max(EXACT, FLOOR_FACTOR * floor)


def _plan_cuts(world: int) -> list[int]:
    return [size for rank in PLANS[world].ranks for size in rank.micro_batch_sizes]


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    """Per world size, every rank's results: one spawn per world, on the first case that needs it."""
    return {}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "family"), [(w, f) for w in PLANS for f in FAMILIES],
                         ids=[f"{w}-ranks-{f}" for w in PLANS for f in FAMILIES])
def test_discovered_family_trains_layered_exactly_like_single_process(runs, world, family):
    if world not in runs:
        runs[world] = run_distributed(_fit_all, world)
    results = runs[world]
    want = _reference(family)
    assert [r[family][0] for r in results] == ["layered"] * world
    got = assemble([r[family][1] for r in results], torch.float64)
    err = max((got[name].float() - value.reshape(-1)).abs().max().item() for name, value in want.items())
    bound = EXACT if err <= EXACT else _floor_bound(family, want, _plan_cuts(world))
    print(f"{family} on {world} ranks: largest difference {err:.2e} (bound {bound:.2e})")
    assert err <= bound, f"{family} on {world} ranks: parameters differ by {err:.2e} > {bound:.2e}"


# ----------------------------------------------------------------------------- structure and fallback


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, scale: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> torch.Tensor:
        if getattr(self, "armed", None) is False:
            raise RuntimeError("called outside the model's forward")
        out = h + torch.tanh(self.linear(h)) * (scale if scale is not None else 1.0)
        return out + skip if skip is not None else out


class Toy(pl.LightningModule):
    """Embedding, three blocks, a head; ``wiring`` says how the forward calls the blocks."""

    def __init__(self, wiring: str = "sequence") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wiring = wiring
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        scale = torch.full((1,), 0.5)
        b = self.blocks
        if self.wiring == "sequence":
            h = b[2](b[1](b[0](h, scale), scale), scale)
        elif self.wiring == "twice":  # a block called twice (weights shared across depth)
            h = b[2](b[1](b[1](b[0](h))))
        elif self.wiring == "order":
            h = b[1](b[2](b[0](h)))
        elif self.wiring == "unet":  # a skip between blocks, into a block's call
            h0 = b[0](h)
            h = b[2](b[1](h0), skip=h0)
        elif self.wiring == "outside":  # a block's output used after the blocks (passes the structure check)
            h0 = b[0](h)
            h = b[2](b[1](h0)) + h0
        elif self.wiring == "armed":  # a block that runs inside the model's forward only (the layered pass fails)
            b[1].armed = True
            try:
                h = b[2](b[1](b[0](h)))
            finally:
                b[1].armed = False
        return self.head(h).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("toy_loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _toy_data(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 4, generator=gen), torch.randn(n, generator=gen)
    return [(x[i], y[i]) for i in range(n)]


def _observed(wiring: str) -> tuple[object, str]:
    module = Toy(wiring)
    discovery = Discovery(module.blocks, lambda mb: module.training_step(mb, 0), "blocks")
    x = torch.stack([a for a, _ in _toy_data(4)]), torch.stack([b for _, b in _toy_data(4)])
    with discovery.observe() as seen:
        module.training_step(x, 0)
    return seen.structure()


def test_block_list_is_the_largest_module_list():
    assert block_list(Toy())[0] == "blocks"
    assert resolve(Toy()).layered.discovery is not None
    assert block_list(nn.Sequential(nn.Linear(2, 2))) is None
    assert "no ModuleList" in resolve(type("Flat", (pl.LightningModule,), {})()).reason


@pytest.mark.parametrize("wiring, reason", [
    ("sequence", ""), ("twice", "block 1 is called 2 times"), ("order", "called in the order [0, 2, 1]"),
    ("unet", "block 2 takes block 0's output besides its hidden state"), ("outside", ""),
])
def test_observation_names_why_blocks_are_not_a_sequence(wiring, reason):
    structure, why = _observed(wiring)
    assert (structure is None) == bool(reason)
    assert reason in why if reason else why == ""


def _toy_reference(wiring: str, steps: int, batch: int) -> tuple[dict[str, torch.Tensor], float]:
    """Single-process training: the parameters, and the last step's loss."""
    module, data = Toy(wiring), _toy_data()
    parts = [data[step * batch : (step + 1) * batch] for step in range(steps)]
    losses = train_steps(module.configure_optimizers(), lambda xy: nn.functional.mse_loss(module(xy[0]), xy[1]),
                         whole((torch.stack([a for a, _ in part]), torch.stack([b for _, b in part])) for part in parts))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, losses[-1]


@pytest.mark.parametrize("wiring, mode, reason", [
    ("sequence", "layered", None), ("twice", "uniform", "block 1 is called 2 times"),
    ("unet", "uniform", "a skip between blocks"), ("outside", "uniform", "the layered pass gives the loss"),
    ("armed", "uniform", "the layered pass failed on the first micro-batch (RuntimeError: called outside the model's"),
])
def test_discovered_toy_trains_exactly_or_falls_back_with_one_line(wiring, mode, reason, caplog):
    plan = plan_of(batches=[4], micro=[2], shares=[1.0])
    module = Toy(wiring)
    with caplog.at_level(logging.INFO):
        t = fit(module, plan, 1, 2, _toy_data())
    runtime = t.strategy.fit_runtime
    assert runtime.schedule == mode
    # the runtime owns its step runner: after a fallback it holds the uniform one, for every later step
    assert type(runtime.steps) is (UniformSteps if mode == "uniform" else LayeredSteps)
    lines = [r.getMessage() for r in caplog.records if "discovered block sequence does not hold" in r.getMessage()]
    assert len(lines) == (0 if reason is None else 1) and (reason is None or reason in lines[0])
    want, last_loss = _toy_reference(wiring, 2, 4)
    with t.strategy.sharded.summon_full_params():
        err = max((p.detach() - want[n]).abs().max().item() for n, p in module.named_parameters())
    assert err <= EXACT, f"{wiring}: parameters differ by {err:.2e}"
    # what training_step logs is relayed in both modes: the global batch's value (two micro-batches of 2)
    assert float(t.callback_metrics["toy_loss"]) == pytest.approx(last_loss, rel=1e-6)


def _layered_pass_loss(discovery: Discovery, layered, micro_batch) -> float:
    """The discovered layers run in order on an unsharded model (what the first step's check computes)."""
    with torch.no_grad():
        x, side = layered.prepare(micro_batch)
        for layer in layered.layers:
            x = layer(x, side)
    return float(layered.loss(x, micro_batch, side))


@pytest.mark.parametrize("router_logits", [False, True])
def test_moe_router_aux_loss_keeps_the_uniform_mode(router_logits):
    """With ``output_router_logits`` the loss adds an auxiliary term over every block's routing,
    which the layered loss pass (one live block) cannot reproduce, and on a random model it moves
    the loss by only ~1e-6: refused by the config flag at setup, not left to the loss comparison.
    Without it the layered loss is the model's own to round-off."""
    from cephalo_lightning.models.protocol import LossWeighting

    module = Wrapped("mixtral")
    module.model.config.output_router_logits = router_logits
    resolution = resolve(module)
    if router_logits:
        assert resolution.layered is None and "output_router_logits=True" in resolution.reason
        assert "only the last block live" in resolution.reason and "router_aux_loss='exclude'" in resolution.reason
        assert resolve(module, router_aux_loss="exclude").layered is not None  # the fit turns the term off at setup
        return
    discovery = Discovery(module.model.model.layers, lambda mb: module.training_step(mb, 0), "model.model.layers")
    layered = discovery.layered(LossWeighting("samples"), "mixtral")
    batch = Samples("mixtral", 4).batch(0, 4)
    with discovery.observe() as seen:
        ordinary = float(module.training_step(batch, 0))
    discovery.structure, why = seen.structure()
    assert why == ""
    assert _layered_pass_loss(discovery, layered, batch) == pytest.approx(ordinary, rel=1e-6)


def test_moe_with_router_aux_excluded_trains_layered_exactly(caplog):
    """``router_aux_loss="exclude"`` turns the router term off at setup: the model is layered (a plan
    with several micro-batches) and trains the token loss exactly like single-process training."""
    module = Wrapped("mixtral")
    module.model.config.output_router_logits = True
    data = Samples("mixtral", GLOBAL * STEPS)
    plan = plan_of(batches=[GLOBAL], micro=[3], shares=[1.0])
    with caplog.at_level(logging.INFO):
        t = fit(module, plan, 1, STEPS, data, router_aux_loss="exclude")
    assert t.strategy.fit_runtime.schedule == "layered"
    assert module.model.config.output_router_logits is False
    assert any("output_router_logits=False" in r.getMessage() for r in caplog.records)
    want = _reference("mixtral")  # single-process training of the token loss (the flag off)
    with t.strategy.sharded.summon_full_params():
        err = max((p.detach() - want[n]).abs().max().item() for n, p in module.named_parameters())
    bound = EXACT if err <= EXACT else _floor_bound("mixtral", want, [3, 3, 2])
    assert err <= bound, f"parameters differ by {err:.2e} > {bound:.2e}"
