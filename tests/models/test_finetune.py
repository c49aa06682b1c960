"""Fine-tuning a pretrained Hugging Face model: frozen parameters priced, peft LoRA end to end.

* The memory model charges every parameter its stored weight and only the trainable ones their
  gradient and optimizer moments (analytic check), the profiler records both counts, and an
  emulated LoRA run's measured peak memory per rank is never above the prediction; the runtime keeps
  no gradient and no optimizer state for a frozen parameter (measured on the pieces). The same
  emulated run with the base's matrices stored as NF4 blocks (QLoRA) is priced at what they hold and
  stays under its prediction too.
* A peft LoRA model built in ``configure_model()`` (on the meta device) from ``pretrained=DIR`` (a
  ``save_pretrained`` directory of the base model, looked up by the original names): the base comes
  from the files bitwise, the adapters start as peft starts them (B = 0), training equals
  single-process training within its noise floor in both modes, ``generate()`` gives the
  single-process tokens, a checkpoint resumes the adapters exactly, peft's ``save_pretrained``
  writes the adapters alone and ``python -m cephalo_lightning export`` the merged model.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from cephalo_lightning import CephaloCallback, CephaloStrategy, Plan  # noqa: E402
from cephalo_lightning.__main__ import main  # noqa: E402
from cephalo_lightning._common.units import GIB  # noqa: E402
from cephalo_lightning.lightning.fit import checkpoint_io  # noqa: E402
from cephalo_lightning.planner import cluster_from_dict  # noqa: E402
from cephalo_lightning.planner.cost.cluster_cost import evaluate  # noqa: E402
from cephalo_lightning.planner.cost.device_cost import DeviceCost  # noqa: E402
from cephalo_lightning.planner.planning import plan as make_plan  # noqa: E402
from cephalo_lightning.planner.report import render_plan  # noqa: E402
from cephalo_lightning.runtime.checkpoint import CheckpointError, read_info, read_meta  # noqa: E402
from cephalo_lightning.runtime.checkpoint.export import export_hf  # noqa: E402
from cephalo_lightning.runtime.checkpoint.safe_load import read_dcp_metadata  # noqa: E402
from tests import helpers  # noqa: E402
from tests.assembly import assemble, strategy_pieces  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.library_models import PaddedTokens, loader, with_lora  # noqa: E402
from tests.plans import plan_of  # noqa: E402
from tests.reference import steps_of, target_tokens, train_steps, with_moments  # noqa: E402

STEPS = 3
GLOBAL = 12
PROMPT = [[1, 5, 9, 3]]
LAYERED = plan_of(batches=[9, 3], micro=[3, 1], shares=[0.3, 0.7])
UNIFORM = plan_of(batches=[8, 4], micro=[2, 2], shares=[0.6, 0.4], mode="uniform")
SHARDED = (plan_of(batches=[6, 6], micro=[1, 1], shares=[0.5, 0.5]),
           plan_of(batches=[GLOBAL, 0], micro=[1, 1], shares=[0.003, 0.997]))
EMULATE = [{"slowdown": 1, "memory_gb": 0.05}, {"slowdown": 2, "memory_gb": 0.05}]
FLOOR_FACTOR = 10  # as tests/models/test_models.py: [Note: tolerances from the noise floor]
FLOOR_EPS = 1e-12
BF16 = ("bf16-true", "bf16-mixed")  # the precisions that store the frozen base in bf16


# ----------------------------------------------------------------------------- pricing, analytic

def _cluster(trainable: int | None, parameters: int = 8_030_261_248, devices: int = 4, name: str = "rtx4090"):
    model = {"name": "llama-8b", "num_layers": 32, "parameters": parameters, "hidden_size": 4096, "seq_len": 2048}
    if trainable is not None:
        model["trainable_parameters"] = trainable
    return cluster_from_dict({"model": model, "settings": {"link_bandwidth": "16 GB/s per rank"},  # PCIe 4.0
                              "devices": [{"name": name, "count": devices}]})


LORA_8B = 6_815_744  # r = 16 on q_proj and v_proj of Llama-3-8B's 32 layers


def test_frozen_parameters_are_charged_their_weights_and_trainable_ones_their_state():
    """rank memory = compute + reserved + (16 trainable + 4 frozen + the reduction's buffers) x share:
    every parameter's stored weight, gradients and moments for the trainable ones only, and the
    reduce-scatter's shards of a unit; the optimizer step over the trainable ones."""
    full, lora = _cluster(None), _cluster(LORA_8B)
    p, t = lora.model.parameters, lora.model.trainable
    assert (full.model.trainable, lora.model.frozen) == (p, p - t)
    share = 0.25
    reduction = 2 * 4 * p / full.model.num_layers  # the reduce-scatter's two shards of a layer's fp32 gradient
    for cluster, state_bytes in ((full, 16 * p + reduction), (lora, 16 * t + 4 * (p - t) + reduction)):
        cost = DeviceCost(cluster.devices[0], cluster)
        reserved = cluster.settings.reserved_memory_gb
        want = float(cost.compute_memory(2)) + reserved + state_bytes * share / GIB
        assert cost.memory_gb(2, share, reserved) == pytest.approx(want, rel=1e-12)
        got = evaluate(cluster, [2] * 4, [1] * 4, [share] * 4)[0].memory_gb
        assert got == pytest.approx(want, rel=1e-12)
    assert lora.model.state_bytes > 4 * p  # the frozen base is not free
    with pytest.raises(Exception, match="trainable_parameters"):
        _cluster(p + 1)


def test_a_bf16_base_is_charged_what_it_stores_and_the_reduction_only_its_trainable_part():
    """A base stored in bf16 (weight_bytes_per_param 2) and a largest unit of U parameters of which R
    train: rank memory = compute + reserved + (16 trainable + 2 frozen + 2 x R x 4) x share, and one
    layer's reduce-scatter moves (W - 1) / W of a layer's trainable parameters in fp32."""
    from cephalo_lightning.planner.cost.collective_prices import link_prices

    p, t, layers, world = 8_030_261_248, LORA_8B, 32, 4
    unit, reduced = 218_112_000, LORA_8B // layers
    model = {"name": "llama-8b", "num_layers": layers, "parameters": p, "trainable_parameters": t, "hidden_size": 4096,
             "seq_len": 2048, "weight_bytes_per_param": 2, "largest_unit_parameters": unit, "largest_reduced_parameters": reduced}
    cluster = cluster_from_dict({"model": model, "settings": {"link_bandwidth": "16 GB/s per rank"},
                                 "devices": [{"name": "rtx4090", "count": world}]})
    share = 0.25
    cost = DeviceCost(cluster.devices[0], cluster)
    reserved = cluster.settings.reserved_memory_gb
    want = float(cost.compute_memory(2)) + reserved + (16 * t + 2 * (p - t) + 2 * reduced * 4) * share / GIB
    assert cost.memory_gb(2, share, reserved) == pytest.approx(want, rel=1e-12)
    assert evaluate(cluster, [2] * world, [1] * world, [share] * world)[0].memory_gb == pytest.approx(want, rel=1e-12)
    rs_ms = (world - 1) / world * t / layers * 4 / 16e9 * 1e3
    assert link_prices(cluster).reduce_scatter_ms == pytest.approx(rs_ms, rel=1e-12)


def test_an_8b_model_on_24gb_cards_fits_with_lora_and_not_fully():
    """The shipped catalog's 24 GB cards: full fine-tuning of 8B needs 128 GB of state, which four
    cards do not have; LoRA needs the 32 GB of fp32 base weights plus the adapters' state, and fits."""
    with pytest.raises(Exception, match="training state and its reduction need"):
        make_plan(_cluster(None), 16)
    plan = make_plan(_cluster(LORA_8B), 16)
    assert all(r.predicted_memory_gb <= r.memory_limit_gb for r in plan.ranks)
    cluster = _cluster(LORA_8B)
    for r, device in zip(plan.ranks, cluster.devices):  # each rank's state: its share of the fp32 base + adapters
        cost = DeviceCost(device, cluster)
        beside = cost.memory_gb(max(r.micro_batch_sizes), 0.0, cluster.settings.reserved_memory_gb,
                                r.num_micro_batches, r.recompute, r.batch_size)
        reduction = 2 * 4 * 8_030_261_248 / cluster.model.num_layers  # two shards of a layer's fp32 gradient
        state = (16 * LORA_8B + 4 * (8_030_261_248 - LORA_8B) + reduction) * r.state_share / GIB
        assert r.predicted_memory_gb - beside == pytest.approx(state, rel=1e-9)
    table = render_plan(plan)
    assert f"trainable {LORA_8B:,} of {8_030_261_248:,} parameters" in table
    assert f"16 bytes each (master, gradient, optimizer state), the {8_030_261_248 - LORA_8B:,} frozen 4 bytes each" in table


# ----------------------------------------------------------------------------- LoRA on 2 ranks

def _config():
    import transformers

    return transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)


def pretrained_dir(root: Path, name: str = "base", seed: int = 7) -> Path:
    """A local ``save_pretrained`` directory of a tiny Llama (no download)."""
    import transformers

    torch.manual_seed(seed)
    path = root / name
    transformers.LlamaForCausalLM(_config()).save_pretrained(path)
    return path


def tokens(n: int = GLOBAL * STEPS) -> PaddedTokens:
    data = PaddedTokens(n, seed=11)
    data.ids = data.ids * 5 % 256  # the tiny Llama's vocabulary is 256
    return data


class LoraFromPretrained(pl.LightningModule):
    """What a user writes: the base model's class from its config, LoRA on top, in configure_model();
    ``compile``: each decoder block compiled in place there (``block.compile()``), with that backend."""

    def __init__(self, path: str, compile: str | None = None) -> None:
        super().__init__()
        self.path = path
        self.compile_backend = compile

    def configure_model(self) -> None:
        import transformers

        if not hasattr(self, "model"):
            self.model = with_lora(transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(self.path)))
            if self.compile_backend is not None:
                for block in self.model.base_model.model.model.layers:
                    block.compile(backend=self.compile_backend)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


class Probe(pl.Callback):
    """The whole state at the start, and what the runtime holds for frozen pieces before a step."""

    def __init__(self) -> None:
        self.start: dict[str, torch.Tensor] = {}
        self.frozen: list[tuple[int, int, int, int]] = []

    def on_train_start(self, trainer, pl_module):
        self.start = {k: v.clone() for k, v in trainer.strategy.sharded.full_state_dict().items()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        """(frozen pieces with a gradient, frozen pieces with optimizer state, bytes of the gradient
        storages held, bytes of the trainable pieces' gradients)."""
        frozen = [p for u in trainer.strategy.sharded.units for p, rg in zip(u.local_params, u.requires_grad) if not rg]
        trainable = [p for u in trainer.strategy.sharded.units for p, rg in zip(u.local_params, u.requires_grad) if rg]
        storages = {id(p.grad.untyped_storage()): p.grad.untyped_storage().nbytes() for p in trainable
                    if p.grad is not None and p.grad.numel()}
        self.frozen.append((sum(p.grad is not None for p in frozen), sum(bool(optimizer.state.get(p)) for p in frozen),
                            sum(storages.values()), sum(p.numel() * 4 for p in trainable)))


def _trainer(plan: Plan, root: Path, steps: int, callbacks=(), **strategy) -> pl.Trainer:
    return helpers.trainer(CephaloStrategy(plan=plan, mode=plan.mode, **strategy), 2, steps,
                           callbacks=list(callbacks), default_root_dir=str(root))


def _lora_ranks(rank: int, world: int, root: str) -> dict:
    warnings.simplefilter("ignore")
    root_path, base = Path(root), Path(root) / "base"
    out: dict = {}
    for plan in (LAYERED, UNIFORM):
        probe = Probe()
        module = LoraFromPretrained(str(base))
        trainer = _trainer(plan, root_path, STEPS, [probe], pretrained=str(base))
        trainer.fit(module, loader(tokens(), GLOBAL))
        assert trainer.strategy.fit_runtime.schedule == plan.mode
        adapters = strategy_pieces(trainer.strategy, trainable_only=True)
        if plan is LAYERED:
            trainer.save_checkpoint(str(root_path / "lora.ckpt"))
            if rank == 0:
                module.model.save_pretrained(str(root_path / "adapters"))
        generated = module.model.generate(input_ids=torch.tensor(PROMPT), max_new_tokens=5, do_sample=False)
        out[plan.mode] = {"start": probe.start, "frozen": probe.frozen, "pieces": adapters,
                          "generated": generated.tolist(),
                          "final": {k: v.clone() for k, v in module.state_dict().items()}}
    # each block compiled in configure_model(): "aot_eager" traces the blocks through dynamo and AOT
    # autograd as inductor does, without generating code (seconds, not minutes, on a CPU)
    for plan in (LAYERED, UNIFORM):
        module = LoraFromPretrained(str(base), compile="aot_eager")
        trainer = _trainer(plan, root_path, STEPS, pretrained=str(base))
        trainer.fit(module, loader(tokens(), GLOBAL))
        compiled = module.model.base_model.model.model.layers[0]
        out[f"compiled {plan.mode}"] = {"pieces": strategy_pieces(trainer.strategy, trainable_only=True),
                                        "compiled": compiled._compiled_call_impl is not None}
    # resume: the adapters and their moments come back exactly as saved
    seen: dict = {}

    class AtResume(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.update(strategy_pieces(trainer.strategy, trainable_only=True))

    trainer = _trainer(LAYERED, root_path, STEPS + 1, [AtResume()], pretrained=str(base))
    trainer.fit(LoraFromPretrained(str(base)), loader(tokens(), GLOBAL),
                ckpt_path=str(root_path / "lora.ckpt"))
    out["resumed"] = seen
    # checkpoint_frozen=False: an uninterrupted run that saves a checkpoint of the adapters at step STEPS and
    # trains on to STEPS + 1; a resume from that checkpoint to STEPS + 1; and one over another base
    adapters_only = str(root_path / "adapters-only.ckpt")

    class SaveAt(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == STEPS:
                trainer.save_checkpoint(adapters_only)

    trainer = _trainer(LAYERED, root_path, STEPS + 1, [SaveAt()], pretrained=str(base), checkpoint_frozen=False)
    trainer.fit(LoraFromPretrained(str(base)), loader(tokens(), GLOBAL))
    out["uninterrupted"] = strategy_pieces(trainer.strategy)
    trainer = _trainer(LAYERED, root_path, STEPS + 1, pretrained=str(base), checkpoint_frozen=False)
    trainer.fit(LoraFromPretrained(str(base)), loader(tokens(), GLOBAL), ckpt_path=adapters_only)
    out["resumed adapters-only"] = (strategy_pieces(trainer.strategy), trainer.global_step)
    other = root_path / "other"
    try:
        _trainer(LAYERED, root_path, STEPS + 1, pretrained=str(other)).fit(
            LoraFromPretrained(str(other)), loader(tokens(), GLOBAL), ckpt_path=adapters_only)
        out["other base"] = ""
    except CheckpointError as err:
        out["other base"] = str(err)
    # profiled and planned under emulated memory: the prediction against the measured peak
    watcher = CephaloCallback(max_micro_batch=3, cache_dir=None, watch_every_n_steps=1, print_plan=False, quiet=True,
                              calibrate_after_windows=0, adapt=False)
    trainer = helpers.trainer(CephaloStrategy(pretrained=str(base), emulate=EMULATE), 2, STEPS, callbacks=[watcher],
                              default_root_dir=str(root_path))
    trainer.fit(LoraFromPretrained(str(base)), loader(tokens(), GLOBAL))
    profiled = watcher.cluster  # the fp32 base's profile: what the pinned plans below are priced from
    module = trainer.lightning_module
    out["memory"] = {"model": watcher.cluster.model, "history": watcher.history, "plan": trainer.strategy.plan,
                     "counts": (sum(p.numel() for p in module.parameters()),
                                sum(p.numel() for p in module.parameters() if p.requires_grad))}
    # QLoRA: the same profiled fit with the base's matrices stored as NF4 blocks
    watcher = CephaloCallback(max_micro_batch=3, cache_dir=None, watch_every_n_steps=1, print_plan=False, quiet=True,
                              calibrate_after_windows=0, adapt=False)
    trainer = helpers.trainer(CephaloStrategy(pretrained=str(base), emulate=EMULATE, base_storage="nf4"), 2, STEPS,
                              callbacks=[watcher], default_root_dir=str(root_path))
    trainer.fit(LoraFromPretrained(str(base)), loader(tokens(), GLOBAL))
    sharded = trainer.strategy.sharded
    trainer.save_checkpoint(str(root_path / "qlora.ckpt"))
    out["qlora final"] = {k: v.clone() for k, v in trainer.lightning_module.state_dict().items()}
    out["qlora memory"] = {"model": watcher.cluster.model, "history": watcher.history, "plan": trainer.strategy.plan,
                           "stored": sharded.local_state_bytes(),
                           "part_bytes": sum(u.frozen.part_bytes() for u in sharded.units if u.frozen is not None),
                           "frozen_numel": sum(u.frozen.layout.numel for u in sharded.units if u.frozen is not None)}
    # pinned plans that shard the state, skewed as the planner may choose them (a rank with no samples
    # holding nearly all of it): their measured peaks, for the profiled cluster's prediction
    out["pinned"] = []
    for plan in SHARDED:
        pinned = CephaloCallback(cache_dir=None, watch_every_n_steps=1, print_plan=False, quiet=True,
                                 calibrate_after_windows=0, adapt=False)
        trainer = _trainer(plan, root_path, STEPS, [pinned], pretrained=str(base), emulate=EMULATE)
        trainer.fit(LoraFromPretrained(str(base)), loader(tokens(), GLOBAL))
        out["pinned"].append([max(w["ranks"][i]["peak_memory_gb"] for w in pinned.history) for i in range(2)])
    out["cluster"] = profiled
    # the same under bf16-true and bf16-mixed: the frozen base stored in bf16, priced at 2 bytes
    for precision in BF16:
        watcher = CephaloCallback(max_micro_batch=3, cache_dir=None, watch_every_n_steps=1, print_plan=False,
                                  quiet=True, calibrate_after_windows=0, adapt=False)
        trainer = helpers.trainer(CephaloStrategy(pretrained=str(base), emulate=EMULATE), 2, STEPS,
                                  callbacks=[watcher], default_root_dir=str(root_path), precision=precision)
        trainer.fit(LoraFromPretrained(str(base)), loader(tokens(), GLOBAL))
        sharded = trainer.strategy.sharded
        out[f"{precision} memory"] = {
            "model": watcher.cluster.model, "history": watcher.history, "plan": trainer.strategy.plan,
            "stored": sharded.local_state_bytes(),
            "frozen_numel": sum(u.frozen.local_numel for u in sharded.units if u.frozen is not None),
            "trainable_numel": sum(-a + b for a, b in (u.trainable_layout.shard_range(u.rank) for u in sharded.units))}
    return out


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    pretrained_dir(root)
    pretrained_dir(root, "other", seed=8)  # the same shapes, other weights
    return root, run_distributed(_lora_ranks, 2, str(root))


def reference(start: dict[str, torch.Tensor], data: PaddedTokens, micro: tuple[int, ...] | None = None):
    """Single-process training of the same LoRA model from the same start, on the global batches
    (``micro``: cut into these micro-batches, each weighted by its share of the label tokens)."""
    module = LoraFromPretrained("unused")
    import transformers

    module.model = with_lora(transformers.LlamaForCausalLM(_config()))
    module.load_state_dict(start)
    opt = module.configure_optimizers()
    train_steps(opt, lambda batch: module.training_step(batch, 0),
                steps_of(data.batch, STEPS, GLOBAL, micro, target_tokens))
    trainable = {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}
    return with_moments(trainable, module.named_parameters(), opt), module


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["layered", "uniform"])
def test_lora_from_pretrained_in_configure_model_trains_like_single_process(lora_runs, mode):
    root, results = lora_runs
    from safetensors.torch import load_file

    start = results[0][mode]["start"]
    stored = load_file(str(root / "base" / "model.safetensors"))
    base = {k: v for k, v in start.items() if ".lora_" not in k}
    for name, value in base.items():  # every base weight from the file, by its original name
        original = name.removeprefix("model.base_model.model.").replace(".base_layer.", ".")
        assert torch.equal(value, stored[original]), f"{name} is not the file's {original}"
    lora_b = [v for k, v in start.items() if ".lora_B." in k]
    assert lora_b and all(not v.any() for v in lora_b)  # peft's start: B = 0, the adapted model is the base
    data = tokens()
    want, model = reference(start, data)
    split, _ = reference(start, data, micro=(5, 4, 3))
    floor: dict[str, float] = {}
    for name in want:
        kind = name.rpartition(".")[2] if name.endswith(("exp_avg", "exp_avg_sq")) else "parameter"
        floor[kind] = max(floor.get(kind, 0.0), (want[name] - split[name]).abs().max().item())
    got = assemble([r[mode]["pieces"] for r in results], torch.float64)
    assert set(got) == set(want)
    for name, value in want.items():
        kind = name.rpartition(".")[2] if name.endswith(("exp_avg", "exp_avg_sq")) else "parameter"
        bound = FLOOR_FACTOR * floor[kind] + FLOOR_EPS
        err = (got[name].float() - value.reshape(-1)).abs().max().item()
        assert err <= bound, f"{mode}: {name} differs by {err:.2e} > {bound:.2e}"
    for r in results:  # handed back whole: the frozen base bitwise the file's, generate() the reference's
        final = r[mode]["final"]
        assert all(torch.equal(final[k], v) for k, v in base.items())
        assert r[mode]["generated"] == model.model.generate(input_ids=torch.tensor(PROMPT), max_new_tokens=5,
                                                            do_sample=False).tolist()


@pytest.mark.multiprocess
def test_the_runtime_keeps_no_gradient_or_moment_for_a_frozen_parameter(lora_runs):
    """Measured before every optimizer step on every rank: no frozen piece holds a gradient or an
    optimizer state, and the gradient storages held are the trainable pieces' alone (a view into a
    unit's whole reduced shard would keep the frozen parameters' share alive too)."""
    _, results = lora_runs
    for r in results:
        for mode in ("layered", "uniform"):
            assert r[mode]["frozen"], mode
            for with_grad, with_state, held, trainable in r[mode]["frozen"]:
                assert (with_grad, with_state) == (0, 0), mode
                assert held == trainable, f"{mode}: {held} bytes of gradient held for {trainable} trainable"


@pytest.mark.multiprocess
def test_a_lora_checkpoint_resumes_the_adapters_exactly(lora_runs):
    _, results = lora_runs
    for r in results:
        saved, resumed = r["layered"]["pieces"], r["resumed"]
        assert set(saved) == set(resumed) and saved
        for name, (start, value) in saved.items():
            assert resumed[name][0] == start and torch.equal(resumed[name][1], value), name


@pytest.mark.multiprocess
def test_adapters_save_with_peft_and_the_export_merges_them(lora_runs):
    """peft's save_pretrained after the fit writes the adapters only; the export of the checkpoint is
    the merged plain model (what merge_and_unload() gives), and it generates the fit's tokens."""
    import transformers
    from peft import PeftModel

    root, results = lora_runs
    final = results[0]["layered"]["final"]
    files = sorted(p.name for p in (root / "adapters").iterdir())
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files
    assert not any(name.startswith("model") for name in files)
    from safetensors.torch import load_file

    adapters = load_file(str(root / "adapters" / "adapter_model.safetensors"))
    assert adapters and all("lora_" in k for k in adapters)
    base = transformers.LlamaForCausalLM.from_pretrained(root / "base")
    tuned = PeftModel.from_pretrained(base, root / "adapters")
    for name, p in tuned.named_parameters():
        assert torch.equal(p, final[f"model.{name}"]), name
    merged = tuned.merge_and_unload()
    out = root / "merged"
    assert main(["export", str(root / "lora.ckpt"), "--hf", str(out)]) == 0  # the command, in this process
    exported = transformers.LlamaForCausalLM.from_pretrained(out)
    want = merged.state_dict()
    got = exported.state_dict()
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    tokens_ = exported.generate(input_ids=torch.tensor(PROMPT), max_new_tokens=5, do_sample=False).tolist()
    assert tokens_ == results[0]["layered"]["generated"]


@pytest.mark.multiprocess
def test_a_qlora_export_merges_the_adapters_into_the_dequantised_base_in_bf16_and_says_so(lora_runs, tmp_path, capsys):
    """The QLoRA fit's checkpoint exported: every tensor in bf16, what peft's merge_and_unload() gives
    from the fit's final model (its base the dequantised NF4 values) cast to bf16, and the command
    says the base was 4-bit."""
    import transformers
    from peft import PeftModel

    root, results = lora_runs
    final = results[0]["qlora final"]
    base = transformers.LlamaForCausalLM(_config())
    tuned = PeftModel(base, with_lora(transformers.LlamaForCausalLM(_config())).peft_config["default"])
    tuned.load_state_dict({k[len("model."):]: v for k, v in final.items()})
    want = {k: v.to(torch.bfloat16) for k, v in tuned.merge_and_unload().state_dict().items()}
    assert main(["export", str(root / "qlora.ckpt"), "--hf", str(tmp_path / "merged")]) == 0  # in this process
    printed = capsys.readouterr().out
    assert "the base was stored as 4-bit NF4 blocks" in printed and "in bf16" in printed
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    for name, value in want.items():
        if name in got:
            assert torch.equal(got[name], value), name
    assert set(want) - set(got) <= {"lm_head.weight"}  # a tied head is stored once


@pytest.mark.multiprocess
def test_an_emulated_lora_run_never_exceeds_its_predicted_memory(lora_runs):
    """The callback profiles the LoRA model: every parameter counted, the adapters as trainable, the
    frozen base at its fp32 master's 4 bytes; every rank's measured peak (emulated memory, counted by
    the tracker) stays at or below the plan's prediction, which holds the frozen base's share. (On this
    tiny model the prediction's slack, mostly its kept-graph activation estimate, is larger than the
    frozen share: that frozen weights are charged at all is checked analytically above.)"""
    _, results = lora_runs
    memory = results[0]["memory"]
    model, plan = memory["model"], memory["plan"]
    total, trainable = memory["counts"]  # after the fit: whole parameters handed back
    assert (model.parameters, model.trainable, model.weight_bytes_per_param) == (total, trainable, 4.0)
    assert 0 < trainable < total / 10
    for i, r in enumerate(plan.ranks):
        peaks = [w["ranks"][i]["peak_memory_gb"] for w in memory["history"]]
        assert peaks and all(p is not None for p in peaks)
        print(f"rank {i}: measured peak {max(peaks) * GIB / 2**20:.3f} MiB, predicted {r.predicted_memory_gb * GIB / 2**20:.3f} MiB, frozen share {4 * (total - trainable) * r.state_share / 2**20:.3f} MiB (emulated)")
        assert max(peaks) <= r.predicted_memory_gb, f"rank {i}: measured {max(peaks):.4g} > predicted {r.predicted_memory_gb:.4g} GiB"


@pytest.mark.multiprocess
def test_an_emulated_qlora_run_never_exceeds_its_predicted_memory(lora_runs):
    """The same profiled LoRA fit with ``base_storage="nf4"``: the callback prices a frozen parameter at
    what the NF4 storage holds (codes, scales, the unquantised vectors, over every frozen element), well
    under bf16's 2 bytes, and every rank's measured peak (emulated) stays at or below the prediction."""
    _, results = lora_runs
    memory = results[0]["qlora memory"]
    model, plan = memory["model"], memory["plan"]
    assert model.weight_bytes_per_param == memory["part_bytes"] / memory["frozen_numel"]
    assert 0.5 < model.weight_bytes_per_param < 1.0
    for rank, r in enumerate(results):  # every rank's stored frozen bytes: the 4-bit share, not 2 bytes a parameter
        assert 0 < r["qlora memory"]["stored"][1] < memory["frozen_numel"]
    for i, r in enumerate(plan.ranks):
        peaks = [w["ranks"][i]["peak_memory_gb"] for w in memory["history"]]
        assert peaks and all(p is not None for p in peaks)
        print(f"rank {i}: measured peak {max(peaks) * GIB / 2**20:.3f} MiB, predicted "
              f"{r.predicted_memory_gb * GIB / 2**20:.3f} MiB (emulated, NF4 base)")
        assert max(peaks) <= r.predicted_memory_gb, f"rank {i}: measured {max(peaks):.4g} > predicted {r.predicted_memory_gb:.4g} GiB"


@pytest.mark.multiprocess
def test_pinned_plans_that_shard_a_lora_models_state_never_exceed_their_prediction(lora_runs):
    """Plans the profiler does not choose on an idle host but the planner may (an even split, and a
    rank with no samples and 99.7% of the state): every rank's measured peak (emulated) is at or
    below the profiled cluster's prediction, which holds the unit's flat gradient and the
    reduce-scatter's two shards beside the frozen base's share."""
    _, results = lora_runs
    cluster = results[0]["cluster"]
    import transformers

    blocks = with_lora(transformers.LlamaForCausalLM(_config())).base_model.model.model.layers
    assert cluster.model.largest_unit_parameters == max(sum(p.numel() for p in b.parameters()) for b in blocks)
    for plan, measured in zip(SHARDED, results[0]["pinned"]):
        predicted = evaluate(cluster, plan.batch_sizes, plan.num_micro_batches, [r.state_share for r in plan.ranks])
        for i, (got, want) in enumerate(zip(measured, predicted)):
            print(f"{plan.batch_sizes} rank {i}: measured {got * GIB / 2**20:.3f} MiB, predicted "
                  f"{want.memory_gb * GIB / 2**20:.3f} MiB (emulated)")
            assert got <= want.memory_gb, f"{plan.batch_sizes}, rank {i}: measured {got:.4g} > predicted {want.memory_gb:.4g} GiB"


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["layered", "uniform"])
def test_blocks_compiled_in_configure_model_train_as_uncompiled(lora_runs, mode):
    """``block.compile()`` on every decoder block in configure_model(), the same LoRA fine-tune:
    the adapters and their moments equal the uncompiled run's bit for bit (measured floor: 0 with the
    "aot_eager" backend, which runs the captured graphs with the eager kernels; inductor's fused
    kernels land 4.7e-7 away after 3 AdamW steps, benchmarks/bench_compile.py)."""
    _, results = lora_runs
    for r in results:
        compiled, plain = r[f"compiled {mode}"], r[mode]["pieces"]
        assert compiled["compiled"]
        assert set(compiled["pieces"]) == set(plain)
        for name, (start, value) in plain.items():
            assert compiled["pieces"][name][0] == start
            assert torch.equal(compiled["pieces"][name][1], value), f"{mode}: {name}"


# ----------------------------------------------------------------------------- a checkpoint of the adapters alone

def _lora_model():
    import transformers

    module = LoraFromPretrained("unused")
    module.model = with_lora(transformers.LlamaForCausalLM(_config()))
    return module


def _fingerprint(path: Path) -> str:
    """The frozen base's fingerprint as cephalo_lightning.runtime.checkpoint.frozen_base defines it, computed
    here from the whole tensors of the base's file (numpy; no layout): the SHA-256 of the JSON list
    [[name, shape, dtype, sum], ...] by name, sum = sum_k (w_k mod P)((k mod P) 48271 + 11 mod P) mod P."""
    import hashlib

    import numpy as np
    from safetensors.torch import load_file

    p = 2**31 - 1
    stored = load_file(str(path / "model.safetensors"))
    rows = []
    for name, param in sorted(_lora_model().named_parameters()):
        if param.requires_grad:
            continue
        value = stored[name.removeprefix("model.base_model.model.").replace(".base_layer.", ".")]
        words = value.float().reshape(-1).numpy().view(np.uint32).astype(np.int64) % p
        k = np.arange(words.size, dtype=np.int64) % p
        rows.append([name, list(value.shape), "float32", int(((words * ((k * 48271 + 11) % p)) % p).sum()) % p])
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def _stored_bytes(path: Path, prefix: str) -> int:
    """The bytes of the tensors a checkpoint stores under ``prefix``, from DCP's metadata."""
    stored = read_dcp_metadata(path).state_dict_metadata
    return sum(md.properties.dtype.itemsize * int(torch.Size(md.size).numel())
               for fqn, md in stored.items() if fqn.startswith(prefix) and hasattr(md, "size"))


@pytest.mark.multiprocess
def test_an_adapters_only_checkpoint_holds_the_trainable_state_and_names_its_base(lora_runs, capsys):
    """checkpoint_frozen=False: the model's tensors in the checkpoint are the adapters alone (trainable
    parameters x 4 bytes, fp32 masters), their AdamW moments as in a full checkpoint, the loops, and the
    frozen base's path, count and fingerprint (the same as from the base's file, whole); a single
    file or an export of the whole model is refused naming the base."""
    root, _ = lora_runs
    path = root / "adapters-only.ckpt"
    params = dict(_lora_model().named_parameters())
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    frozen = [p for p in params.values() if not p.requires_grad]
    total = trainable + sum(p.numel() for p in frozen)
    adapters, full = _stored_bytes(path, "model."), _stored_bytes(root / "lora.ckpt", "model.")
    assert (adapters, full) == (4 * trainable, 4 * total)
    assert _stored_bytes(path, "optimizer_0.state.") == _stored_bytes(root / "lora.ckpt", "optimizer_0.state.")
    with capsys.disabled():
        print(f"\nLoRA checkpoint, model tensors: {adapters:,} bytes adapters-only, {full:,} bytes full "
              f"({full / adapters:.0f}x; {trainable:,} of {total:,} parameters trainable)")
    info = read_info(path)
    assert info["frozen_base"] == {"source": str(root / "base"), "fingerprint": _fingerprint(root / "base"),
                                   "tensors": len(frozen), "numel": total - trainable}
    assert read_meta(path)["global_step"] == STEPS
    for refused in (lambda: export_hf(path, root / "merged-from-adapters"),
                    lambda: checkpoint_io.consolidate(path, root / "adapters-only-single.ckpt")):
        with pytest.raises(CheckpointError, match=rf"holds the trainable parameters only .*are in {root / 'base'}"):
            refused()


@pytest.mark.multiprocess
def test_an_adapters_only_checkpoint_resumes_exactly_and_refuses_another_base(lora_runs):
    """From the checkpoint of step STEPS, the base read from pretrained= again: every parameter (the frozen
    ones from the file) and every moment at step STEPS + 1 bitwise those of the run that did not stop.
    Over another base of the same shapes the resume is refused, naming both bases and fingerprints."""
    root, results = lora_runs
    for r in results:
        resumed, step = r["resumed adapters-only"]
        assert step == STEPS + 1
        assert set(resumed) == set(r["uninterrupted"]) and any(".lora_" in k for k in resumed)
        for name, (start, value) in r["uninterrupted"].items():
            assert resumed[name][0] == start and torch.equal(resumed[name][1], value), name
        message = r["other base"]
        for named in (str(root / "base"), str(root / "other"), _fingerprint(root / "base"), _fingerprint(root / "other")):
            assert named in message, (named, message)


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision", BF16)
def test_a_bf16_base_is_priced_at_what_it_stores_and_never_above_the_prediction(lora_runs, precision):
    """Under bf16-true and bf16-mixed the frozen base is stored in bf16: the profiled model prices a
    frozen parameter at 2 bytes, each rank holds 2 bytes per frozen element and 4 per trainable one,
    and every rank's measured peak (emulated memory) stays at or below the plan's prediction."""
    _, results = lora_runs
    memory = results[0][f"{precision} memory"]
    model = memory["model"]
    assert model.weight_bytes_per_param == 2.0
    assert model.largest_reduced_parameters is not None and model.largest_reduced_parameters < model.largest_unit_parameters
    assert sum(results[i][f"{precision} memory"]["stored"][0] for i in range(2)) > 0
    for i, r in enumerate(memory["plan"].ranks):
        mine = results[i][f"{precision} memory"]
        trainable, frozen = mine["stored"]
        # a rank whose ranges hold no adapter element stores no trainable bytes: the plan decides
        assert frozen > 0 and frozen == 2 * mine["frozen_numel"] and trainable == 4 * mine["trainable_numel"]
        peaks = [w["ranks"][i]["peak_memory_gb"] for w in memory["history"]]
        print(f"rank {i}: measured peak {max(peaks) * GIB / 2**20:.3f} MiB, predicted {r.predicted_memory_gb * GIB / 2**20:.3f} "
              f"MiB, stored {trainable / 2**20:.3f} MiB trainable + {frozen / 2**20:.3f} MiB frozen (emulated)")
        assert max(peaks) <= r.predicted_memory_gb, f"rank {i}: measured {max(peaks):.4g} > predicted {r.predicted_memory_gb:.4g} GiB"
