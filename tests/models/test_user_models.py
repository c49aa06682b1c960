"""What a user's model gets from the strategy: exact loss weighting, and the model usable after fit.

``loss_weighting="auto"`` weights micro-batches by what each model's loss averages over.

In-process: the count ``auto`` picks is the one the model's loss decomposes by (a whole batch's loss
is the count-weighted mean of its parts' losses), and the causal LM's shifted count is not, for a
masked LM, T5 and BART. On 2 gloo ranks, with an uneven uniform plan (different per-rank batches),
BERT masked-LM (labels at any position, 0 included), T5, BART and a per-sample mean of a model of
its own train exactly like single-process training on the global batch, and the setup log names
the weighting; a Mixtral with the router's auxiliary loss is warned about at setup and trains like single-process
training micro-batched as the plan cuts the batch (the term is a statistic of each micro-batch), and
with ``router_aux_loss="exclude"`` exactly like single-process training of the token loss.

After ``fit`` in either mode (an HF Llama, 2 ranks, uneven plans) every rank's module holds the
whole trained parameters: equal to the consolidated checkpoint bit for bit and to single-process
training within its noise floor; ``save_pretrained`` + ``from_pretrained`` and the export command's
directory load the same weights exactly; ``generate()`` gives the single-process tokens. With
``gather_on_teardown=False`` a forward, ``generate``, ``state_dict`` of the pieces or sharding them
again (another Trainer) is refused.
All ranks' fits run in one spawn.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch

pytest.importorskip("transformers")

from cephalo_lightning.__main__ import main as cli  # noqa: E402
from cephalo_lightning._common.errors import UnsupportedError  # noqa: E402
from cephalo_lightning.models import resolve, weighting  # noqa: E402
from cephalo_lightning.runtime.checkpoint import load_full_state_dict  # noqa: E402
from cephalo_lightning.runtime.checkpoint.export import export_hf  # noqa: E402
from cephalo_lightning.runtime.emulation.memory import MemoryTracker  # noqa: E402
from tests import library_models  # noqa: E402
from tests.assembly import assemble, strategy_pieces  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.helpers import fit  # noqa: E402
from tests.library_models import LibraryLM, PaddedTokens  # noqa: E402
from tests.loss_models import KINDS, HFModule, collate, data, reference  # noqa: E402
from tests.plans import plan_of  # noqa: E402

STEPS = 2
GLOBAL = 12
# uniform mode: one micro-batch count on every rank, but different batches, micro-batch sizes and shares
PLAN = plan_of(batches=[7, 5], micro=[2, 2], shares=[0.3, 0.7], mode="uniform")
LAYERED = plan_of(batches=[9, 3], micro=[4, 1], shares=[0.25, 0.75])
PROMPT = torch.tensor([[5, 7, 9, 11]])
SPLIT = (4, 3, 3, 2)  # the plan's micro-batches, in order: the reference's summation order
FLOOR_FACTOR, FLOOR_EPS = 10, 1e-12  # as tests/models/test_models.py: x the measured noise floor
WORDS = {"bert": "every non-ignored label", "t5": "every non-ignored label", "bart": "every non-ignored label",
         "per_sample": "samples", "mixtral": "after each row's first"}


# What each model's loss averages over, written out here: the reference cuts the batch by these, so
# the exactness bound (the cut's noise floor) does not move with the count the package picks.
_LABELS = lambda micro_batch: int((micro_batch["labels"] != -100).sum())  # noqa: E731
AVERAGED_OVER = {"bert": _LABELS, "t5": _LABELS, "bart": _LABELS,
                 "per_sample": lambda micro_batch: len(micro_batch["input_ids"]),
                 "mixtral": lambda micro_batch: int((micro_batch["labels"][:, 1:] != -100).sum())}


def _count(kind: str):
    """The count ``loss_weighting="auto"`` picks for ``kind`` (the package's choice, under test)."""
    module = HFModule(kind)
    chosen = weighting.choose("auto", module, resolve(module).layered).weighting
    return chosen.count or (lambda micro_batch: len(micro_batch["input_ids"]))


@pytest.mark.parametrize("kind", ["bert", "t5", "bart"])
def test_auto_counts_what_the_loss_averages_over(kind):
    module = HFModule(kind).double()
    samples = data(kind, GLOBAL)
    whole, parts = collate(samples), [collate(samples[:5]), collate(samples[5:])]
    loss = lambda b: module.training_step(b, 0).item()  # noqa: E731
    for count, exact in ((_count(kind), True), (weighting.shifted_label_tokens, False)):
        combined = sum(loss(p) * count(p) for p in parts) / sum(count(p) for p in parts)
        error = abs(combined - loss(whole))
        assert (error < 1e-12) == exact, f"{kind}: {count.__name__} error {error:.2e}"
    assert [_count(kind)(p) for p in parts] == [AVERAGED_OVER[kind](p) for p in parts]


def test_weighting_choices_for_heads_and_unknown_models():
    import transformers

    config = transformers.BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16)
    classifier = transformers.BertForSequenceClassification(config)
    assert weighting.choose("auto", classifier, None).weighting.kind == "samples"
    unknown = weighting.choose("auto", HFModule("per_sample"), None)
    assert unknown.weighting.kind == "samples" and "loss_weighting='tokens'" in unknown.note
    assert weighting.choose("auto", HFModule("bert"), None).note == ""
    assert weighting.choose("samples", HFModule("bert"), None).weighting.kind == "samples"


def _fit_warned(module: pl.LightningModule, samples, **strategy) -> tuple[pl.Trainer, list[str]]:
    """A fit under PLAN (uniform) and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(module, PLAN, 2, STEPS, samples, mode="uniform", **strategy)
    return trainer, [str(w.message) for w in caught]


def _whole(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _generate(model: torch.nn.Module) -> torch.Tensor:
    return model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=6, do_sample=False,
                          pad_token_id=0)


def _refused(use) -> str:
    try:
        use()
    except UnsupportedError as err:
        return str(err)
    return ""


class TeardownMemory(pl.Callback):
    """The tensor bytes allocated from the end of training to the end of the fit (Lightning's
    teardown, where the strategy hands the module back), counted by the runtime's memory tracker."""

    def __init__(self) -> None:
        self.tracker = MemoryTracker()

    def on_train_end(self, trainer, pl_module):
        self.tracker.__enter__()

    def on_fit_end(self, trainer, pl_module):
        self.tracker.__exit__(None, None, None)


def _held_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class EvaluatedLM(LibraryLM):
    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.model(**batch).loss)


def _after_fit(rank: int, out_dir: str) -> dict:
    out = {}
    tokens = PaddedTokens(GLOBAL * STEPS)
    for mode, plan in (("uniform", PLAN), ("layered", LAYERED)):
        module = EvaluatedLM("llama")
        trainer = fit(module, plan, 2, STEPS, tokens, mode=mode)
        assert trainer.strategy.fit_runtime.schedule == mode
        whole = _whole(module.model)
        module.model.save_pretrained(f"{out_dir}/{mode}")  # Hugging Face writes on the main process only
        generated = _generate(module.model)
        trainer.save_checkpoint(f"{out_dir}/{mode}.ckpt")  # after the fit, from the shards
        # an edit of the whole parameters survives another run of the same trainer (sharded again, handed back)
        with torch.no_grad():
            module.model.lm_head.weight.mul_(0.5)
        edited = _whole(module.model)
        trainer.test(module, library_models.loader(tokens, GLOBAL), verbose=False)
        out[mode] = (whole, generated, edited, _whole(module.model))
    module = LibraryLM("llama")
    fit(module, PLAN, 2, 1, tokens, mode="uniform", gather_on_teardown=False)
    out["parked"] = [_refused(lambda: _generate(module.model)), _refused(module.state_dict),
                     _refused(lambda: module.model.save_pretrained(f"{out_dir}/parked")),
                     _refused(lambda: fit(module, PLAN, 2, 1, tokens, mode="uniform"))]
    # the whole model on global rank 0 alone; the other rank keeps its pieces and allocates none of it
    module, watch = LibraryLM("llama"), TeardownMemory()
    trainer = fit(module, PLAN, 2, 1, tokens, options={"callbacks": [watch]}, mode="uniform", gather_on_teardown="rank0")
    out["rank0"] = {"peak": watch.tracker.peak_bytes, "live": watch.tracker.current_bytes, "held": _held_bytes(module),
                    "pieces": strategy_pieces(trainer.strategy), "state_dict": _refused(module.state_dict),
                    "whole": dict(module.named_parameters(remove_duplicate=False)) if rank == 0 else None}
    # the same model under the default ("auto", far below its limit): whole on every rank, as before
    module = LibraryLM("llama")
    fit(module, PLAN, 2, 1, tokens, mode="uniform")
    out["auto"] = _held_bytes(module)
    return out


def _all(rank: int, world: int, out_dir: str):
    warnings.simplefilter("ignore")
    out = {}
    for kind in KINDS:
        trainer, _ = _fit_warned(HFModule(kind), data(kind, GLOBAL * STEPS))
        out[kind] = (_whole(trainer.lightning_module), trainer.strategy.fit_runtime.describe())
    moe = [{k: v[i] for k, v in PaddedTokens(GLOBAL * STEPS).batch(0, GLOBAL * STEPS).items()} for i in range(GLOBAL * STEPS)]
    trainer, caught = _fit_warned(HFModule("mixtral"), moe, router_aux_loss="keep")
    out["mixtral-keep"] = (_whole(trainer.lightning_module), caught)
    trainer, caught = _fit_warned(HFModule("mixtral"), moe, router_aux_loss="exclude")
    out["mixtral"] = (_whole(trainer.lightning_module), trainer.strategy.fit_runtime.describe())
    out.update(_after_fit(rank, out_dir))
    return out


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("after_fit")


@pytest.fixture(scope="module")
def results(out_dir):
    return run_distributed(_all, 2, str(out_dir))


def _check(kind: str, runs: list[dict[str, torch.Tensor]], samples, **overrides) -> None:
    want = reference(kind, STEPS, GLOBAL, samples, **overrides)
    split = reference(kind, STEPS, GLOBAL, samples, SPLIT, AVERAGED_OVER[kind], **overrides)
    floor = max((want[n] - split[n]).abs().max().item() for n in want)
    bound = FLOOR_FACTOR * floor + FLOOR_EPS
    for got in runs:
        for name, value in want.items():
            err = (got[name] - value).abs().max().item()
            assert err <= bound, f"{kind}: {name} differs from single-process training by {err:.2e} > {bound:.2e}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", KINDS)
def test_auto_weighting_is_exact_under_an_uneven_plan(results, kind):
    for rank_result in results:
        assert WORDS[kind] in rank_result[kind][1], rank_result[kind][1]
    # every rank holds the whole trained model after the fit
    _check(kind, [r[kind][0] for r in results], data(kind, GLOBAL * STEPS))


def _moe_samples() -> list[dict[str, torch.Tensor]]:
    padded = PaddedTokens(GLOBAL * STEPS)
    return [{k: v[i] for k, v in padded.batch(0, GLOBAL * STEPS).items()} for i in range(GLOBAL * STEPS)]


@pytest.mark.multiprocess
def test_moe_router_aux_loss_warned_and_excluded_exactly(results):
    assert any("router's auxiliary" in m and "router_aux_loss='exclude'" in m for m in results[0]["mixtral-keep"][1])
    got, described = results[0]["mixtral"]
    assert WORDS["mixtral"] in described
    _check("mixtral", [got], _moe_samples(), output_router_logits=False)


@pytest.mark.multiprocess
def test_moe_with_router_aux_kept_trains_like_single_process_training_cut_as_the_plan_cuts(results):
    """The kept router term is a statistic of each micro-batch: the run equals single-process training
    whose micro-batches are the plan's (each micro-batch's token loss plus its router term, weighted by
    its label tokens), within the re-association floor of the token loss, and differs from the
    whole-batch run by more than that (what the setup warning says)."""
    samples = _moe_samples()
    cut = reference("mixtral", STEPS, GLOBAL, samples, SPLIT, AVERAGED_OVER["mixtral"])
    whole = reference("mixtral", STEPS, GLOBAL, samples)
    tokens_whole = reference("mixtral", STEPS, GLOBAL, samples, output_router_logits=False)
    tokens_cut = reference("mixtral", STEPS, GLOBAL, samples, SPLIT, AVERAGED_OVER["mixtral"], output_router_logits=False)
    bound = FLOOR_FACTOR * max((tokens_whole[n] - tokens_cut[n]).abs().max().item() for n in tokens_whole) + FLOOR_EPS
    for rank_result in results:
        got = rank_result["mixtral-keep"][0]
        err = max((got[n] - cut[n]).abs().max().item() for n in cut)
        assert err <= bound, f"the kept router term: {err:.2e} from single-process training cut as the plan > {bound:.2e}"
        off = max((got[n] - whole[n]).abs().max().item() for n in whole)
        assert off > bound, f"the whole batch's router term would give the same weights ({off:.2e} <= {bound:.2e})"


@pytest.fixture(scope="module")
def llama_reference():
    """Single-process training of the same Llama on the same global batches, and its noise floor."""
    tokens = PaddedTokens(GLOBAL * STEPS)
    want = library_models.reference("llama", "sgd", STEPS, GLOBAL, tokens)
    floor = max(library_models.noise_floor("llama", "sgd", STEPS, GLOBAL, tokens).values())
    module = LibraryLM("llama")
    module.load_state_dict(want)
    return {n.removeprefix("model."): v for n, v in want.items()}, FLOOR_FACTOR * floor + FLOOR_EPS, _generate(module.model)


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))[:4]}"
    for name, value in want.items():
        assert got[name].shape == value.shape and torch.equal(got[name], value), f"{what}: {name} differs"


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["uniform", "layered"])
def test_after_fit_the_module_is_the_trained_model(results, out_dir, llama_reference, mode):
    import transformers

    want, bound, want_tokens = llama_reference
    whole = results[0][mode][0]
    for rank, rank_result in enumerate(results):
        got, generated, edited, after_test = rank_result[mode]
        _equal(got, whole, f"rank {rank} vs rank 0")
        assert torch.equal(edited["lm_head.weight"], whole["lm_head.weight"] * 0.5)
        _equal(after_test, edited, f"rank {rank} after trainer.test")
        for name, value in want.items():
            err = (got[name] - value).abs().max().item()
            assert err <= bound, f"{mode}: {name} differs from single-process training by {err:.2e} > {bound:.2e}"
        assert torch.equal(generated, want_tokens), f"{mode} rank {rank}: generate() {generated} != {want_tokens}"
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out_dir / mode)
    _equal(_whole(reloaded), whole, "save_pretrained + from_pretrained")
    checkpoint = out_dir / f"{mode}.ckpt"
    consolidated = load_full_state_dict(checkpoint)
    _equal({n: consolidated[f"model.{n}"] for n in whole}, whole, "the consolidated checkpoint")
    exported = out_dir / f"{mode}-export"
    assert cli(["export", str(checkpoint), "--hf", str(exported)]) == 0
    _equal(_whole(transformers.LlamaForCausalLM.from_pretrained(exported)), whole, "the exported directory")
    assert cli(["export", str(checkpoint), "--hf", str(exported)]) == 1  # refuses to overwrite
    if mode == "uniform":
        return
    # one file per unit (with the index), config and prefix given instead of the recorded ones
    pieces = export_hf(checkpoint, out_dir / f"{mode}-files", config=out_dir / mode, prefix="model.", max_shard_bytes=1)
    assert len(pieces.files) > 2 and (out_dir / f"{mode}-files" / "model.safetensors.index.json").exists()
    _equal(_whole(transformers.LlamaForCausalLM.from_pretrained(out_dir / f"{mode}-files")), whole, "one file per unit")


@pytest.mark.multiprocess
def test_pieces_left_sharded_are_refused_outside_the_strategy(results):
    for rank_result in results:
        generate, state_dict, save_pretrained, another_fit = rank_result["parked"]
        assert "cannot shard" in another_fit
        assert "gather_on_teardown='none' or False" in generate and "forward()" in generate
        assert "state_dict()" in state_dict and "gather_on_teardown='rank0'" in state_dict
        assert "state_dict()" in save_pretrained


@pytest.mark.multiprocess
def test_rank0_gathers_the_whole_model_on_rank_0_alone(results):
    """gather_on_teardown="rank0": rank 0's module holds the whole trained model (the ranks' pieces put
    together), allocated at teardown; rank 1 allocates none of it (its peak while tearing down is not
    even 5% of the model) and keeps its pieces, refused with a message that says where the model is.
    The default ("auto", a model far below 8 GiB) still hands it back whole on every rank."""
    whole_bytes = 4 * sum(p.numel() for p in LibraryLM("llama").parameters())  # fp32 masters, tied ones once
    first, second = results[0]["rank0"], results[1]["rank0"]
    assert first["held"] == whole_bytes and first["live"] >= whole_bytes and first["state_dict"] == ""
    moments = (".exp_avg", ".exp_avg_sq")  # strategy_pieces adds the optimizer's moments
    pieces_bytes = 4 * sum(v.numel() for name, (_, v) in second["pieces"].items() if not name.endswith(moments))
    assert second["held"] == pieces_bytes < whole_bytes
    assert second["peak"] < 0.05 * whole_bytes, f"rank 1 allocated {second['peak']} bytes of a {whole_bytes}-byte model"
    assert "gather_on_teardown='rank0': the whole model is on global rank 0 only" in second["state_dict"]
    params = [{k: v for k, v in r["rank0"]["pieces"].items() if not k.endswith(moments)} for r in results]
    for name, value in assemble(params).items():
        assert torch.equal(first["whole"][name].detach().reshape(-1), value), name
    assert [r["auto"] for r in results] == [whole_bytes, whole_bytes]
