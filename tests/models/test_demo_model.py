"""The demo workload: GPT as a chain of one-tensor layers, its LightningModule, and the byte corpus."""

from __future__ import annotations

import math
import sys
import types

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from cephalo_lightning.demo import (
    GPT,
    PRESETS,
    ByteWindowDataset,
    GPTConfig,
    GPTModule,
    TextDataModule,
    decode,
    encode,
    load_corpus,
    no_weight_decay,
)
from tests.plans import plan_of


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def tiny(**overrides) -> GPTConfig:
    return GPTConfig.preset("tiny", vocab_size=256, seq_len=16, **overrides)


# ---- the model -----------------------------------------------------------------------------------


def test_layers_in_order_equal_forward_exactly() -> None:
    model = GPT(tiny()).eval()
    idx = torch.randint(0, 256, (3, 16))
    x = idx
    for layer in model.layers():
        x = layer(x)
    assert torch.equal(x, model(idx))
    assert model.layers() == [model.embed, *model.blocks, model.head]


def test_each_layer_maps_one_tensor_to_one_tensor_and_owns_its_parameters() -> None:
    config = tiny()
    model = GPT(config).eval()
    x = torch.randint(0, 256, (2, 16))
    shapes = []
    for layer in model.layers():
        assert isinstance(layer, nn.Module)
        x = layer(x)
        assert isinstance(x, torch.Tensor)
        shapes.append(tuple(x.shape))
    assert shapes == [(2, 16, 32)] * (1 + config.n_layer) + [(2, 16, 256)]
    # no parameter is shared between layers (no weight tying): each has exactly one shard unit
    owners = [id(p) for layer in model.layers() for p in layer.parameters()]
    assert len(owners) == len(set(owners)) == len(list(model.parameters()))
    assert model.embed.wte.weight.data_ptr() != model.head.lm_head.weight.data_ptr()


def test_shorter_sequences_work_and_longer_are_refused() -> None:
    model = GPT(tiny()).eval()
    assert model(torch.randint(0, 256, (2, 5))).shape == (2, 5, 256)
    with pytest.raises(ValueError, match="longer than seq_len"):
        model(torch.randint(0, 256, (1, 17)))


def test_fresh_model_loss_is_near_uniform() -> None:
    model = GPT(GPTConfig.preset("small", vocab_size=256, seq_len=64)).eval()
    idx = torch.randint(0, 256, (4, 65))
    loss = GPT.loss(model(idx[:, :-1]), idx[:, 1:])
    assert abs(loss.item() - math.log(256)) < 0.05


def test_a_few_steps_on_a_fixed_batch_reduce_the_loss() -> None:
    model = GPT(tiny())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = encode("the quick brown fox jumps over the lazy dog, " * 2)[:68].long().view(4, 17)
    x, y = idx[:, :-1], idx[:, 1:]
    losses = []
    for _ in range(25):
        loss = GPT.loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("bias", [True, False])
def test_num_parameters_from_config_match_the_built_model(preset: str, bias: bool) -> None:
    config = GPTConfig.preset(preset, vocab_size=256, seq_len=64, bias=bias)
    model = GPT(config)
    assert config.num_parameters() == model.num_parameters()
    assert config.layer_parameters() == [sum(p.numel() for p in layer.parameters()) for layer in model.layers()]
    assert config.num_parameters(non_embedding=True) == model.num_parameters(non_embedding=True)


def test_presets_and_planning_sizes() -> None:
    assert set(PRESETS) >= {"tiny", "small", "gpt2-124m", "gpt-1.3b", "gpt-2.7b", "llama-7b-shape"}
    big = GPTConfig.preset("gpt-2.7b", vocab_size=50304, seq_len=2048)
    assert (big.n_layer, big.n_embd, big.n_head) == (32, 2560, 32)
    assert 2.5e9 < big.num_parameters() < 2.9e9
    llama = GPTConfig.preset("llama-7b-shape", vocab_size=32000, seq_len=2048)
    assert (llama.n_layer, llama.n_embd) == (32, 4096)
    assert 6.4e9 < llama.num_parameters() < 7.0e9
    small = GPTConfig.preset("small", vocab_size=256, seq_len=64)
    assert 0.5e6 < small.num_parameters() < 1.5e6
    # 6N dominates; attention adds 12 L C T
    flops = big.estimate_flops_per_token()
    assert flops == 6 * big.num_parameters(non_embedding=True) + 12 * 32 * 2560 * 2048
    assert GPTConfig.preset("tiny", n_layer=5).n_layer == 5
    with pytest.raises(ValueError, match="unknown GPT preset"):
        GPTConfig.preset("gpt-5")
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)


# ---- the LightningModule -------------------------------------------------------------------------


def test_layered_protocol_matches_training_loss() -> None:
    module = GPTModule(preset="tiny", seq_len=16).eval()
    module.configure_model()  # outside a Trainer, as the docstring says
    idx = torch.randint(0, 256, (2, 17))
    batch = (idx[:, :-1], idx[:, 1:])
    h = module.cephalo_input(batch)
    for layer in module.cephalo_layers():
        h = layer(h)
    assert torch.equal(module.cephalo_loss(h, batch), GPT.loss(module(batch[0]), batch[1]))


def test_optimizer_groups_by_name_cover_every_parameter_once() -> None:
    module = GPTModule(preset="tiny", seq_len=16, weight_decay=0.1)
    module.configure_model()  # outside a Trainer, as the docstring says
    optimizer = module.configure_optimizers()["optimizer"]
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    grouped = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in module.parameters())
    assert len(grouped) == len(set(grouped))
    names = {id(p): n for n, p in module.named_parameters()}
    exempt = {names[id(p)] for p in no_decay["params"]}
    decayed = {names[id(p)] for p in decay["params"]}
    assert all(n.endswith("bias") or ".ln_" in n or ".wte." in n or ".wpe." in n for n in exempt)
    assert "model.blocks.0.ln_1.weight" in exempt and "model.head.ln_f.weight" in exempt
    assert "model.embed.wte.weight" in exempt and "model.blocks.1.mlp.c_fc.bias" in exempt
    assert decayed == {n for n in names.values() if n.endswith("weight") and (".c_" in n or "lm_head" in n)}
    assert no_weight_decay("layers.3.input_layernorm.weight") and not no_weight_decay("layers.3.mlp.up.weight")


def test_optimizer_works_on_flat_and_empty_shards() -> None:
    """Under Cephalo configure_optimizers sees 1-D local shards (some empty) under the original names."""
    module = GPTModule(preset="tiny", seq_len=16)
    module.configure_model()  # outside a Trainer, as the docstring says
    before = {n: p.clone() for n, p in module.named_parameters()}
    for i, (owner, name, p) in enumerate(
        [(m, n, p) for m in module.modules() for n, p in m.named_parameters(recurse=False)]
    ):
        flat = p.detach().flatten()
        setattr(owner, name, nn.Parameter(flat[: flat.numel() // 2] if i % 3 else flat[:0]))
    assert any(p.numel() == 0 for p in module.parameters())
    config = module.configure_optimizers()
    optimizer = config["optimizer"]
    decay, no_decay = optimizer.param_groups
    # grouping did not change although every tensor is now 1-D: a LayerNorm scale stays exempt, a matrix decays
    names = {id(p): n for n, p in module.named_parameters()}
    assert "model.blocks.0.attn.c_attn.weight" in {names[id(p)] for p in decay["params"]}
    assert "model.blocks.0.ln_2.weight" in {names[id(p)] for p in no_decay["params"]}
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    config["lr_scheduler"]["scheduler"].step()
    assert all(p.numel() == 0 or not torch.equal(p, before[n].flatten()[: p.numel()])
               for n, p in module.named_parameters())


def test_learning_rate_warms_up_then_decays_to_the_floor() -> None:
    module = GPTModule(preset="tiny", seq_len=16, learning_rate=1.0, warmup_steps=4, lr_decay_steps=20,
                       min_lr_ratio=0.1)
    scheduler = module.configure_optimizers()["lr_scheduler"]
    assert scheduler["interval"] == "step"
    lrs = []
    for _ in range(25):
        lrs.append(scheduler["scheduler"].get_last_lr()[0])
        scheduler["scheduler"].optimizer.step()
        scheduler["scheduler"].step()
    assert lrs[:5] == sorted(lrs[:5]) and lrs[4] == pytest.approx(1.0)
    assert lrs[4:21] == sorted(lrs[4:21], reverse=True)
    assert lrs[20] == pytest.approx(0.1) and lrs[24] == pytest.approx(0.1)


# ---- the data ------------------------------------------------------------------------------------


def test_pydoc_corpus_is_real_and_split_deterministically() -> None:
    text = load_corpus()
    assert len(text) > 100_000 and b"Assert statements" in text
    a, b = TextDataModule(seq_len=32), TextDataModule(seq_len=32)
    a.setup("fit"), b.setup("fit")
    assert torch.equal(a.train_dataset.data, b.train_dataset.data)
    assert torch.equal(a.val_dataset.starts, b.val_dataset.starts)
    # the validation text is the tail of the corpus and does not overlap the training text
    n_val = a.val_dataset.data.numel()
    assert bytes(a.val_dataset.data.tolist()) == text[-n_val:]
    assert a.train_dataset.data.numel() + n_val == len(text)
    assert n_val == pytest.approx(0.05 * len(text), abs=1)


def test_windows_are_shifted_pairs() -> None:
    dm = TextDataModule(seq_len=32, batch_size=4)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    x0, y0 = dm.train_dataset[0]
    x1, _ = dm.train_dataset[1]
    assert torch.equal(y0[-1], x1[0])  # stride seq_len: consecutive windows tile the text
    loader = dm.train_dataloader()
    assert loader.drop_last and isinstance(loader.sampler, torch.utils.data.RandomSampler)
    assert not dm.val_dataloader().drop_last


def test_max_samples_caps_and_spreads_windows() -> None:
    dm = TextDataModule(seq_len=16, max_train_samples=64, max_val_samples=8)
    dm.setup("fit")
    full = ByteWindowDataset(dm.train_dataset.data, 16)
    assert len(dm.train_dataset) == 64 and len(dm.val_dataset) == 8
    starts = dm.train_dataset.starts
    assert starts[0] == 0 and starts[-1] == full.starts[-1] and bool((starts.diff() > 0).all())


def test_local_text_file_corpus(tmp_path) -> None:
    path = tmp_path / "corpus.txt"
    text = "Grüße aus Zürich — naïve café. " * 200
    path.write_text(text, encoding="utf-8")
    dm = TextDataModule(corpus=str(path), seq_len=24, batch_size=2, val_fraction=0.1)
    dm.setup("fit")
    assert dm.train_dataset.data.numel() + dm.val_dataset.data.numel() == len(text.encode())
    assert decode(torch.cat([dm.train_dataset.data, dm.val_dataset.data])) == text
    assert decode(encode("héllo")) == "héllo"
    with pytest.raises(FileNotFoundError):
        TextDataModule(corpus=str(tmp_path / "missing.txt")).setup("fit")
    with pytest.raises(ValueError, match="seq_len"):
        TextDataModule(corpus=str(path), seq_len=100_000).setup("fit")


def test_hf_corpus_is_offline_only(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(ImportError, match="datasets"):
        load_corpus("hf:wikitext:wikitext-2-raw-v1")

    calls = []

    class FakeDataset:
        column_names = ["id", "text"]

        def __getitem__(self, column: str) -> list[str]:
            return ["first line", "second line"]

    def load_dataset(name, config, split):
        import os

        calls.append((name, config, split, os.environ["HF_DATASETS_OFFLINE"], os.environ["HF_HUB_OFFLINE"]))
        return FakeDataset()

    fake = types.ModuleType("datasets")
    fake.load_dataset = load_dataset
    fake.config = types.SimpleNamespace(HF_DATASETS_OFFLINE=False, HF_HUB_OFFLINE=False)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.setitem(sys.modules, "datasets.config", fake.config)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert load_corpus("hf:user/corpus:cfg") == b"first line\nsecond line"
    assert load_corpus("hf:plain") == b"first line\nsecond line"
    assert calls == [("user/corpus", "cfg", "train", "1", "1"), ("plain", None, "train", "1", "1")]
    assert fake.config.HF_DATASETS_OFFLINE is True


# ---- end to end ----------------------------------------------------------------------------------


def test_trainer_fit_and_checkpoint_round_trip(tmp_path) -> None:
    model = GPTModule(preset="tiny", seq_len=32, warmup_steps=1)
    data = TextDataModule(seq_len=32, batch_size=8, max_train_samples=64, max_val_samples=16)
    trainer = pl.Trainer(
        max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, val_check_interval=3,
    )
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 3
    metrics = trainer.callback_metrics
    assert {"train_loss", "val_loss", "val_ppl"} <= set(metrics)
    assert metrics["val_ppl"].item() == pytest.approx(math.exp(metrics["val_loss"].item()), rel=0.05)
    path = tmp_path / "tiny.ckpt"
    trainer.save_checkpoint(path)
    restored = GPTModule.load_from_checkpoint(path)
    assert restored.hparams == model.hparams and restored.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), restored.state_dict().items()):
        assert torch.equal(a, b), name


def test_the_gpt_is_built_in_configure_model_and_initialised_unit_by_unit_from_meta() -> None:
    """Under Cephalo, configure_model() runs on the meta device and every unit is initialised on its own
    through cephalo_init_weights: the same distributions as the eager GPT.reset_parameters."""
    from cephalo_lightning import CephaloStrategy

    assert GPTModule(preset="tiny", seq_len=16).model is None  # nothing model-sized in __init__
    module = GPTModule(preset="small", seq_len=16)
    plan = plan_of(batches=[8], micro=[1], shares=[1.0])
    trainer = pl.Trainer(strategy=CephaloStrategy(plan=plan), accelerator="cpu", devices=1, max_steps=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, TextDataModule(seq_len=16, batch_size=8, max_train_samples=16, max_val_samples=8))
    sharded = trainer.strategy.sharded
    assert sharded.materialized_units == len(module.cephalo_layers())  # built on meta, every layer materialised
    meta_built = sharded.full_state_dict()
    torch.manual_seed(0)
    eager = GPTModule(preset="small", seq_len=16)
    eager.configure_model()
    eager_built = eager.state_dict()
    layers = eager.config.n_layer
    for name, value in eager_built.items():
        got = meta_built[name]
        if name.endswith("bias"):
            assert torch.equal(got, torch.zeros_like(got)) and torch.equal(value, torch.zeros_like(value)), name
        elif ".ln_" in name:
            assert torch.equal(got, value), name  # LayerNorm: ones
        else:  # N(0, std): the same std within the sampling error of this many draws
            std = 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj.weight") else 0.02
            tolerance = 4 * std / math.sqrt(2 * value.numel())  # 4 standard errors of a sample std
            assert abs(got.std().item() - std) < tolerance and abs(value.std().item() - std) < tolerance, name
