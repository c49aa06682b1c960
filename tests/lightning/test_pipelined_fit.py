"""Pipelined plans through ``Trainer.fit`` with no user code: one spawn of four gloo ranks.

Hugging Face Llama and GPT-2 (its embedding tied to its head, held by the first and the last stage),
built from tiny configs, in a plain LightningModule (tests/library_models.LibraryLM: the adapter finds
the layers), on right-padded batches whose loss is a mean over the label tokens, AdamW in fp64:
2 stages x 2 pipelines from a plan file (uneven batches, micro-batch counts and shares), 1F1B and
GPipe, one with gradient clipping. Each is compared with single-process training on the same global
batches (tests/reference.train_steps, tests/library_models.pipeline_reference), within the
bounds the runtime's tests use. Their validation loops (the sanity check and one after training)
and a ``trainer.test`` log the loss one process computes on the whole validation batch; predict is
refused.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch

from cephalo_lightning._common.vocabulary import PipelineSchedule
from tests.distributed import run_distributed
from tests.library_models import pipeline_reference

STEPS, GLOBAL = 2, 8
VAL, VAL_SEED = 7, 5  # one validation batch of 7 samples: uneven over the pipelines and the ranks
# [Note: library-model bounds] as tests/runtime/test_pipeline.py: four steps of fp64's grid above 1, or
# where larger FLOOR_FACTOR x the noise floor (single-process training cut into the pipelines' micro-batches)
EXACT = 4 * torch.finfo(torch.float64).eps
FLOOR_FACTOR = 2

# name: (family, stage_layers, rows (batch, micro-batches, share, stage, pipeline) per rank, schedule, clip)
SCENARIOS = {
    "llama-1f1b": ("llama", (2, 2), [(5, 2, 0.3, 0, 0), (3, 2, 0.7, 0, 1), (5, 2, 0.6, 1, 0), (3, 2, 0.4, 1, 1)],
                   PipelineSchedule.ONE_F_ONE_B, None),
    "gpt2-gpipe-clip": ("gpt2", (3, 1), [(2, 2, 0.55, 0, 1), (6, 3, 0.45, 0, 0), (2, 2, 0.2, 1, 1),
                                         (6, 3, 0.8, 1, 0)], PipelineSchedule.GPIPE, 0.05),
}


def _plan(stage_layers, rows, schedule):
    from cephalo_lightning.planner import ModelSummary, Plan, RankPlan

    ranks = tuple(RankPlan(i, "cpu", b, m, -(-b // m), share, stage=stage, pipeline=d, shard_group=stage)
                  for i, (b, m, share, stage, d) in enumerate(rows))
    return Plan(GLOBAL, "layered", ranks, stage_layers=stage_layers, pipeline_schedule=schedule,
                model=ModelSummary(num_layers=sum(stage_layers)))


FLAT = ((3, 2, 1, 2), (2, 1, 1, 1), (0.1, 0.4, 0.3, 0.2))  # a plan without pipelines: batches, micro-batches, shares


def _states(t) -> dict:  # noqa: ANN001 - a Trainer after fit
    runner = t.strategy.fit_runtime.pipeline
    states = runner.model_state_dict() if runner is not None else t.strategy.sharded.full_state_dict()
    return {k.removeprefix("model."): v for k, v in states.items()}


def _checkpoints(rank: int, world: int, folder: str, scenario: str) -> dict:
    """Save under the pipelined plan after step 1, resume under it, and under a plan without pipelines;
    save under that plan, resume under the pipelined one."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from cephalo_lightning import CephaloStrategy
    from tests.helpers import trainer
    from tests.library_models import LibraryLM, PaddedTokens, loader
    from tests.plans import plan_of

    family, clip = SCENARIOS[scenario][0], SCENARIOS[scenario][4]
    folder = f"{folder}/{scenario}"
    piped, flat = f"{folder}.json", plan_of(batches=FLAT[0], micro=FLAT[1], shares=FLAT[2])
    out = {}

    class Trained(pl.Callback):
        batches = 0

        def on_train_batch_end(self, *args) -> None:  # noqa: ANN002 - Lightning's
            self.batches += 1

    def run(plan, steps: int, name: str, ckpt: str | None = None):  # noqa: ANN202 - (parameters, batches trained)
        saver = ModelCheckpoint(dirpath=f"{folder}/{name}", every_n_train_steps=1, save_top_k=-1, filename="{step}")
        counted = Trained()
        t = trainer(CephaloStrategy(plan=plan), world, steps, precision="64-true", callbacks=[saver, counted],
                    enable_checkpointing=True, gradient_clip_val=clip)
        t.fit(LibraryLM(family, "adamw"), loader(PaddedTokens(GLOBAL * STEPS), GLOBAL), ckpt_path=ckpt)
        return _states(t), counted.batches

    out["straight"] = run(piped, STEPS, "piped")
    if family == "llama":
        out["piped-piped"] = run(piped, STEPS, "again", f"{folder}/piped/step=1.ckpt")
    out["piped-flat"] = run(flat, STEPS, "to-flat", f"{folder}/piped/step=1.ckpt")
    run(flat, 1, "flat")
    out["flat-piped"] = run(piped, STEPS, "to-piped", f"{folder}/flat/step=1.ckpt")
    return out


def _validated(family: str):  # noqa: ANN202 - a LightningModule
    from tests.library_models import LibraryLM

    class Validated(LibraryLM):
        def validation_step(self, batch, batch_idx):  # what a user writes; under a pipeline the strategy's runs
            self.log("val_loss", self.model(**batch).loss)

        def test_step(self, batch, batch_idx):
            self.log("test_loss", self.model(**batch).loss)

        def predict_step(self, batch, batch_idx):
            return self.model(**batch).logits

    return Validated(family, "adamw")


class _ValLosses(pl.Callback):
    """Each validation run's logged ``val_loss``: (sanity check?, value)."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, float]] = []

    def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001 - Lightning's
        self.seen.append((trainer.sanity_checking, float(trainer.callback_metrics["val_loss"])))


def _fit(rank: int, world: int, folder: str) -> dict:
    warnings.simplefilter("ignore")
    from cephalo_lightning import CephaloStrategy
    from cephalo_lightning._common.errors import UnsupportedError
    from tests.helpers import trainer
    from tests.library_models import PaddedTokens, loader

    out = {}
    for name, (family, stage_layers, rows, schedule, clip) in SCENARIOS.items():
        path = f"{folder}/{name}.json"
        if rank == 0:
            _plan(stage_layers, rows, schedule).save(path)
        torch.distributed.barrier() if torch.distributed.is_initialized() else None
        val = _ValLosses()  # a validation loop too (Lightning's sanity check before training, one after)
        t = trainer(CephaloStrategy(plan=path), world, STEPS, precision="64-true",
                    gradient_clip_val=clip, callbacks=[val], num_sanity_val_steps=1)
        t.fit(_validated(family), loader(PaddedTokens(GLOBAL * STEPS), GLOBAL),
              val_dataloaders=loader(PaddedTokens(VAL, seed=VAL_SEED), VAL))
        runner = t.strategy.fit_runtime.pipeline
        states = {k.removeprefix("model."): v for k, v in runner.model_state_dict().items()}
        out[name] = {"states": states, "loss": float(t.callback_metrics["train_loss_step"]),
                     "steps": t.global_step, "val": val.seen}
    t.test(t.lightning_module, loader(PaddedTokens(VAL, seed=VAL_SEED), VAL))  # the trained module again
    out["test"] = float(t.callback_metrics["test_loss"])
    t = trainer(CephaloStrategy(plan=path), world, STEPS, precision="64-true")  # predict: refused
    try:
        t.predict(_validated(family), loader(PaddedTokens(GLOBAL), GLOBAL))
        out["predict"] = None
    except UnsupportedError as refused:
        out["predict"] = str(refused)
    out["checkpoints"] = {name: _checkpoints(rank, world, folder, name) for name in SCENARIOS}
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("plans")


@pytest.fixture(scope="module")
def runs(folder):
    pytest.importorskip("transformers")
    return run_distributed(_fit, 4, str(folder))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_pipelined_plan_file_trains_in_lightning_like_one_process(runs, name):
    family, stage_layers, rows, _, clip = SCENARIOS[name]
    plan = _plan(stage_layers, rows, SCENARIOS[name][3])
    losses: list[float] = []
    want = pipeline_reference(family, STEPS, GLOBAL, clip=clip, losses=losses)
    cuts = tuple(n for chain in plan.pipelines for n in plan.ranks[chain[0]].micro_batch_sizes)
    cut = pipeline_reference(family, STEPS, GLOBAL, cuts, clip)
    floor = max((cut[k] - v).abs().max().item() for k, v in want.items())
    bound = max(EXACT, FLOOR_FACTOR * floor)
    got = runs[0][name]["states"]
    assert all(r[name]["steps"] == STEPS for r in runs)
    assert {k: tuple(v.shape) for k, v in got.items()} == {k: tuple(v.shape) for k, v in want.items()}
    err = max((got[k] - v).abs().max().item() for k, v in want.items())
    print(f"{name}: largest difference {err:.3e} (noise floor {floor:.3e}, bound {bound:.3e})")
    assert err <= bound, f"{name}: parameters differ from one process's by {err:.2e} > {bound:.2e}"
    logged = {r[name]["loss"] for r in runs}  # the last stage's loss, logged alike on every rank
    assert len(logged) == 1, f"{name}: the ranks logged {logged}"
    assert logged.pop() == pytest.approx(float(losses[-1]), rel=1e-6), f"{name}: the logged loss is not the global one"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_validation_loop_under_a_pipelined_plan_logs_one_process_loss_on_every_rank(runs, name):
    """The sanity check (the initial model) and the validation after training (the trained
    parameters) log, on every rank, the loss one process computes on the whole validation batch."""
    from tests.library_models import LibraryLM, PaddedTokens

    batch = PaddedTokens(VAL, seed=VAL_SEED).batch(0, VAL)
    seen = [r[name]["val"] for r in runs]
    assert all(s == seen[0] for s in seen), f"{name}: the ranks logged {seen}"
    assert [sanity for sanity, _ in seen[0]] == [True, False], f"{name}: validation runs {seen[0]}"
    module = LibraryLM(SCENARIOS[name][0], "adamw").to(torch.float64)
    with torch.no_grad():
        initial = module.training_step(batch, 0).item()
        missing, unexpected = module.model.load_state_dict(runs[0][name]["states"], strict=False)
        assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
        trained = module.training_step(batch, 0).item()
    # Hugging Face's loss runs in fp32 whatever the model's dtype
    assert seen[0][0][1] == pytest.approx(initial, rel=1e-6), f"{name}: the sanity check's val_loss"
    assert seen[0][1][1] == pytest.approx(trained, rel=1e-6), f"{name}: the val_loss after training"
    if name == list(SCENARIOS)[-1]:  # trainer.test after its fit: the same loss as test_loss
        assert all(r["test"] == pytest.approx(trained, rel=1e-6) for r in runs), [r["test"] for r in runs]


@pytest.mark.multiprocess
def test_predict_under_a_pipelined_plan_is_refused_naming_what_runs(runs):
    for result in runs:
        assert result["predict"] is not None, "a predict step ran the whole model on a stage"
        assert "val_loss" in result["predict"] and "without pipelines" in result["predict"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("name", "resume"), [("llama-1f1b", "piped-piped"), ("llama-1f1b", "piped-flat"),
                                              ("llama-1f1b", "flat-piped"), ("gpt2-gpipe-clip", "piped-flat"),
                                              ("gpt2-gpipe-clip", "flat-piped")])
def test_a_checkpoint_resumes_across_pipelined_and_flat_plans_like_one_process(runs, name, resume):
    """Saved after step 1 under one plan (pipelined or not), resumed under another for step 2: the
    parameters and AdamW's moments under their names, so step 2 lands where one process's does."""
    from tests.plans import plan_of

    runs_ = runs[0]["checkpoints"][name]
    got = {name: states for name, (states, _) in runs_.items()}
    assert runs_[resume][1] == STEPS - 1, f"{resume}: trained {runs_[resume][1]} batches after the resume"
    if resume == "piped-piped":  # the same plan: the uninterrupted run's bits
        assert all(torch.equal(got[resume][k], v) for k, v in got["straight"].items())
        return
    family, stage_layers, rows, schedule, clip = SCENARIOS[name]
    plan = _plan(stage_layers, rows, schedule)
    flat = plan_of(batches=FLAT[0], micro=FLAT[1], shares=FLAT[2])
    want = pipeline_reference(family, STEPS, GLOBAL, clip=clip)
    floors = []
    for cuts in (tuple(n for chain in plan.pipelines for n in plan.ranks[chain[0]].micro_batch_sizes),
                 tuple(n for r in flat.ranks for n in r.micro_batch_sizes)):
        cut = pipeline_reference(family, STEPS, GLOBAL, cuts, clip)
        floors.append(max((cut[k] - v).abs().max().item() for k, v in want.items()))
    bound = max(EXACT, FLOOR_FACTOR * max(floors))
    assert set(got[resume]) == set(want)
    err = max((got[resume][k] - v).abs().max().item() for k, v in want.items())
    print(f"{resume}: largest difference {err:.3e} (noise floors {floors}, bound {bound:.3e})")
    assert err <= bound, f"{resume}: {err:.2e} > {bound:.2e}"


@pytest.mark.multiprocess
def test_a_pipelined_checkpoint_consolidates_into_the_whole_models_state_dict(runs, folder):
    """GPT-2's checkpoint after step 1 under 2 stages: one Lightning file whose state_dict is the
    model's (its head under its own key too), as one process's after the same step."""
    from cephalo_lightning.lightning.fit.checkpoint_io import consolidated
    from tests.library_models import LibraryLM

    family, _, _, _, clip = SCENARIOS["gpt2-gpipe-clip"]
    state = torch.load(consolidated(folder / "gpt2-gpipe-clip" / "piped" / "step=1.ckpt"), weights_only=False)["state_dict"]
    assert set(state) == set(LibraryLM(family).state_dict())  # every key of the model's own state dict
    want = pipeline_reference(family, 1, GLOBAL, clip=clip, samples=GLOBAL * STEPS)
    err = max((state[f"model.{k}"] - v).abs().max().item() for k, v in want.items())
    assert err <= 4 * EXACT, f"the consolidated parameters differ from one process's by {err:.2e}"
