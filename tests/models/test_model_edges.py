"""The edges real models meet: meta-device init, pretrained weights into the shards, optimizer groups
by ``p.dim()``, the uniform mode's logged loss, frozen layers, manual optimization, adapters that
wrap the model's own modules."""

from __future__ import annotations

import logging
import sys
import warnings

import lightning.pytorch as pl
import pytest
import torch

from cephalo_lightning import CephaloStrategy, consolidated, full_shape
from cephalo_lightning.planner import PlanningError
from tests.distributed import run_distributed
from tests.helpers import NUM_SAMPLES, fit, max_error, reference
from tests.helpers import trainer as quiet_trainer
from tests.lightning_models import TinyLayered, TinyUniform, loader, token_data
from tests.plans import plan_of
from tests.reference import sliced, tiny_loss, train_steps, whole

transformers = pytest.importorskip("transformers")

TWO = plan_of(batches=[9, 3], micro=[3, 1], shares=[0.3, 0.7])
UNIFORM_TWO = plan_of(batches=[8, 4], micro=[2, 2], shares=[0.4, 0.6], mode="uniform")


def llama_config(**extra) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, vocab_size=17, max_position_embeddings=16, **extra)


class MetaLlama(pl.LightningModule):
    """Built in configure_model(), which the strategy runs on the meta device."""

    def __init__(self, family: str = "llama") -> None:
        super().__init__()
        self.family = family
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            if self.family == "gpt2":
                config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=17)
                self.model = transformers.GPT2LMHeadModel(config)
            else:
                self.model = transformers.LlamaForCausalLM(llama_config())

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.model(input_ids=x, labels=torch.cat([x[:, :1], y], dim=1)[:, :-1]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class EagerLlama(MetaLlama):
    """Built in ``__init__``, as the README's Hugging Face example may: full random weights on the host."""

    def __init__(self, family: str = "llama") -> None:
        super().__init__(family)
        self.configure_model()


class InfoLines(logging.Handler):
    """The messages Lightning's rank-zero loggers emit (``rank_zero_info``), while attached."""

    LOGGERS = ("lightning.pytorch", "lightning.fabric")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> InfoLines:
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)


def _meta_and_pretrained(rank: int, world: int, weights: dict[str, str]):
    warnings.simplefilter("ignore")
    out = {}
    plan = plan_of(batches=[12 // world] * world, micro=[1] * world, shares=[0.3, 0.7] if world == 2 else [1.0],
                   mode="uniform", devices=["a"] * world)
    for family in ("llama", "gpt2"):
        trainer = fit(MetaLlama(family), plan, world, steps=0)
        assert trainer.strategy.sharded.materialized_units == len(trainer.strategy.sharded.units)
        out[f"init/{family}"] = trainer.strategy.sharded.full_state_dict()
        with InfoLines() as info:
            trainer = fit(MetaLlama(family), plan, world, steps=0, pretrained=weights[family])
        out[f"pretrained/{family}"] = trainer.strategy.sharded.full_state_dict()
        out[f"not used/{family}"] = [line for line in info.lines if "not used" in line]
        torch.manual_seed(100 + rank)  # eager weights unlike the files' (and unlike each other's)
        trainer = fit(EagerLlama(family), plan, world, steps=0, pretrained=weights[family])
        out[f"eager/{family}"] = trainer.strategy.sharded.full_state_dict()
    with InfoLines() as info:  # the llama files and one tensor the model has no parameter for
        fit(MetaLlama("llama"), plan, world, steps=0, pretrained=weights["llama+spare"])
    out["not used/llama+spare"] = [line for line in info.lines if "not used" in line]
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    paths = {}
    torch.manual_seed(5)
    for family, model in (("llama", transformers.LlamaForCausalLM(llama_config())),
                          ("gpt2", transformers.GPT2LMHeadModel(transformers.GPT2Config(
                              n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=17)))):
        model.save_pretrained(root / family)  # safetensors; GPT-2's tied head is not stored
        paths[family] = str(root / family)
    from safetensors.torch import load_file, save_file

    (root / "llama+spare").mkdir()
    save_file({**load_file(root / "llama" / "model.safetensors"), "spare.weight": torch.ones(3)},
              root / "llama+spare" / "model.safetensors")
    paths["llama+spare"] = str(root / "llama+spare")
    one = run_distributed(_meta_and_pretrained, 1, paths)
    two = run_distributed(_meta_and_pretrained, 2, paths)
    return paths, one[0], two[0]


@pytest.mark.multiprocess
def test_meta_init_is_the_same_model_under_any_layout_and_a_sane_one(saved):
    _, one, two = saved
    for family in ("llama", "gpt2"):
        a, b = one[f"init/{family}"], two[f"init/{family}"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), family
        embed = next(v for k, v in a.items() if "embed_tokens" in k or "wte" in k)
        assert 0.015 < embed.std().item() < 0.025  # the HF initializer_range, not zeros or garbage


@pytest.mark.multiprocess
def test_pretrained_weights_land_in_the_shards_exactly(saved):
    from safetensors.torch import load_file

    paths, one, two = saved
    for family in ("llama", "gpt2"):
        stored = load_file(f"{paths[family]}/model.safetensors")
        # built on the meta device in configure_model(), or eagerly in __init__ (then the files replace it)
        for built in ("pretrained", "eager"):
            for got in (one[f"{built}/{family}"], two[f"{built}/{family}"]):
                assert {name[len("model."):] for name in got} >= set(stored), (built, family)
                for name, value in got.items():
                    key = name[len("model."):]
                    if key not in stored:  # GPT-2's tied head is the embedding
                        assert family == "gpt2" and torch.equal(value, stored["transformer.wte.weight"]), name
                        continue
                    assert torch.equal(value, stored[key]), f"{built} {family}: {name}"


@pytest.mark.multiprocess
def test_a_sharded_load_reports_as_not_used_only_the_tensors_no_rank_read(saved):
    """Under shares 0.3 / 0.7 rank 0 holds none of some tensors (the end of each unit is rank 1's):
    they were read, by rank 1, and rank 0 (which prints) does not call them unused. The reference is
    the files' keys against the names the trained model holds."""
    from safetensors.torch import load_file

    paths, one, two = saved
    for family in ("llama", "gpt2", "llama+spare"):
        stored = set(load_file(f"{paths[family]}/model.safetensors"))
        held = {name[len("model."):] for name in one[f"pretrained/{family.split('+')[0]}"]}
        unread = sorted(stored - held)
        assert unread == (["spare.weight"] if family == "llama+spare" else []), family
        for world, got in ((1, one), (2, two)):
            want = [f"Cephalo: 1 tensor of {paths[family]} was not used by any rank, e.g. {unread}"] if unread else []
            assert got[f"not used/{family}"] == want, (world, family)


def test_safetensors_weights_without_safetensors_are_refused_at_setup_naming_the_extra(tmp_path, monkeypatch):
    from cephalo_lightning.runtime.sharding.weights import WeightsError

    monkeypatch.setitem(sys.modules, "safetensors", None)  # `import safetensors` raises ImportError
    (tmp_path / "model.safetensors").write_bytes(b"")
    profiled = []

    class Recorder(pl.Callback):
        def setup(self, trainer, pl_module, stage):  # a CephaloCallback profiles here: after the refusal
            profiled.append(stage)

    plan = plan_of(batches=[12], micro=[1], shares=[1.0], mode="uniform")
    t = quiet_trainer(CephaloStrategy(plan=plan, pretrained=tmp_path), 1, 1, callbacks=[Recorder()])
    with pytest.raises(WeightsError, match=r"cephalo-lightning\[hf\]"):
        t.fit(MetaLlama(), loader(token_data(NUM_SAMPLES), 12))
    assert profiled == []


# ----------------------------------------------------------------------------- optimizer groups, logs, edges


class DecayByDim(TinyLayered):
    """nanoGPT's grouping: weight decay for tensors with 2+ dims, none for the rest."""

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        self.groups = ([n for n, p in self.named_parameters() if p.dim() >= 2],
                       [tuple(full_shape(p)) for p in decay])
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.5}, {"params": rest, "weight_decay": 0.0}],
                                 lr=1e-2)


class LogsLoss(TinyUniform):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.model.loss(self(x), y)
        self.log("step_loss", loss, on_step=True, on_epoch=False, prog_bar=True)  # no batch_size: the usual way
        return loss


class FrozenEmbedding(TinyLayered):
    def __init__(self) -> None:
        super().__init__()
        self.model.embed.requires_grad_(False)


class Manual(TinyUniform):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        self.manual_backward(self.model.loss(self(x), y))
        optimizer.step()
        optimizer.zero_grad()


class ManualReplanned(Manual):
    """A plan decided after setup (as the callback's is) reaches the same check as a given one."""

    def on_train_start(self) -> None:
        self.trainer.strategy.adopt_plan(UNIFORM_TWO)


def _edges(rank: int, world: int):
    warnings.simplefilter("ignore")
    out = {}
    module = DecayByDim()
    trainer = fit(module, TWO, world, 2, options={"precision": "64-true"})
    out["groups"] = module.groups
    out["decay"] = trainer.strategy.sharded.full_state_dict()
    trainer = fit(LogsLoss(), UNIFORM_TWO, world, steps=2)
    out["logged"] = float(trainer.callback_metrics["step_loss"])
    trainer = fit(FrozenEmbedding(), TWO, world, steps=2)
    out["frozen"] = trainer.strategy.sharded.full_state_dict()
    one_each = plan_of(batches=[7, 5], micro=[1, 1], shares=[0.5, 0.5], mode="uniform")
    trainer = fit(Manual(), one_each, world, steps=2)
    out["manual"] = trainer.strategy.sharded.full_state_dict()
    try:
        fit(Manual(), UNIFORM_TWO, world, steps=1)
    except PlanningError as err:
        out["manual_refused"] = str(err)
    try:
        fit(ManualReplanned(), one_each, world, steps=1)
    except PlanningError as err:
        out["manual_replan_refused"] = str(err)
    return out


@pytest.fixture(scope="module")
def edges():
    return run_distributed(_edges, 2)


def _single_process(model, steps: int = 2) -> dict:
    """The reference: ``model`` trained on the same global batches of 12 in one process."""
    train_steps(model.configure_optimizers(), tiny_loss(model.model), whole(sliced(token_data(NUM_SAMPLES), steps, 12)))
    return {f"model.{k}": v for k, v in model.model.state_dict().items()}


@pytest.mark.multiprocess
def test_grouping_by_dim_gives_the_unsharded_groups_and_trains_exactly(edges):
    names, shapes = edges[0]["groups"]
    plain = TinyLayered()
    assert names == [n for n, p in plain.named_parameters() if p.dim() >= 2]
    assert all(len(shape) >= 2 for shape in shapes)
    model = DecayByDim().double()
    want = _single_process(model)
    assert max_error(edges[0]["decay"], want) <= 1e-10


@pytest.mark.multiprocess
def test_uniform_mode_logs_the_steps_global_loss(edges):
    _, losses = reference(2, 12)
    assert edges[0]["logged"] == pytest.approx(losses[-1], abs=1e-6)  # the global batch's, not a micro-batch's
    assert edges[1]["logged"] == edges[0]["logged"]


@pytest.mark.multiprocess
def test_a_frozen_first_layer_trains_in_layered_mode(edges):
    model = FrozenEmbedding()
    want = _single_process(model)
    assert max_error(edges[0]["frozen"], want) <= 1e-5
    assert torch.equal(edges[0]["frozen"]["model.embed.weight"], FrozenEmbedding().model.embed.weight)


@pytest.mark.multiprocess
def test_manual_optimization_with_one_micro_batch_trains_and_more_are_refused(edges):
    want, _ = reference(2, 12)
    assert max_error(edges[0]["manual"], want) <= 1e-5
    for refused in (edges[0]["manual_refused"], edges[0].get("manual_replan_refused", "not refused")):
        assert "manual optimization" in refused and "one micro-batch" in refused, refused


# ----------------------------------------------------------------------------- adapters next to the model


class Adapted(TinyLayered):
    """The model kept as ``self.model`` next to registered adapters that wrap its own modules."""

    def __init__(self) -> None:
        super().__init__()
        self.adapters = torch.nn.ModuleList([self.model.embed, *self.model.blocks, self.model.norm, self.model.head])

    def cephalo_layers(self):
        return list(self.adapters)


def test_keeping_the_model_beside_adapters_checkpoints_and_loads_back(tmp_path):
    warnings.simplefilter("ignore")
    trainer = fit(Adapted(), plan_of(batches=[12], micro=[2], shares=[1.0]), 1, steps=1)
    trainer.save_checkpoint(tmp_path / "ckpt")
    restored = Adapted.load_from_checkpoint(consolidated(tmp_path / "ckpt"))  # strict: every state_dict key
    full = trainer.strategy.sharded.full_state_dict()
    for name, value in full.items():
        assert torch.equal(restored.state_dict()[name], value)
    assert torch.equal(restored.adapters[0].weight, restored.model.embed.weight)
