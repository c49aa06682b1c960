"""Pipelined plans through ``Trainer.fit`` with no user code: one spawn of four gloo ranks.

Hugging Face Llama and GPT-2 (its embedding tied to its head, held by the first and the last stage),
built from tiny configs, in a plain LightningModule (tests/library_models.LibraryLM: the adapter finds
the layers), on right-padded batches whose loss is a mean over the label tokens, AdamW in fp64:
2 stages x 2 pipelines from a plan file (uneven batches, micro-batch counts and shares), 1F1B and
GPipe, one with gradient clipping. Each is compared with single-process training on the same global
batches (tests/reference.train_steps, tests/library_models.pipeline_reference), within the
bounds the runtime's tests use. Their validation loops (the sanity check and one after training)
and a ``trainer.test`` log the loss one process computes on the whole validation batch; predict
returns, on every rank, one process's logits of the samples the rank was dealt. With no plan at all,
``CephaloStrategy(cluster=...)`` picks the pipelined plan a slow inter-node link makes faster and
trains like one process; an option that rules pipelines out gives the flat plan, said at setup.
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
PREDICT, PREDICT_BATCH = 10, 4  # predict batches of 4, 4 and 2 samples: every pipeline gets one of each
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
    predictions = _Predictions()  # the last scenario's plan (uneven micro-batch counts), the initial model
    t = trainer(CephaloStrategy(plan=path), world, STEPS, precision="64-true", callbacks=[predictions])
    returned = t.predict(_validated(family), loader(PaddedTokens(PREDICT), PREDICT_BATCH))
    out["predict"] = {"seen": predictions.seen, "returned": returned}
    out["cluster"] = _from_cluster(rank, world, folder)
    out["checkpoints"] = {name: _checkpoints(rank, world, folder, name) for name in SCENARIOS}
    return out


class _Predictions(pl.Callback):
    """Each predict batch this rank was given and what the step returned for it."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict, torch.Tensor]] = []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:  # noqa: ANN001
        self.seen.append(({k: v.clone() for k, v in batch.items()}, outputs.detach().clone()))


def _from_cluster(rank: int, world: int, folder: str) -> dict:
    """No plan: a cluster file whose slow inter-node link makes a pipelined plan faster (tests/plans.py);
    fit under what the strategy plans, then validate with an option that rules pipelines out."""
    from cephalo_lightning import CephaloStrategy
    from cephalo_lightning.planner import save_cluster
    from tests.helpers import trainer
    from tests.library_models import LibraryLM, PaddedTokens, loader
    from tests.plans import setup_lines, slow_link_cluster

    path = f"{folder}/slow-link.yaml"
    if rank == 0:
        save_cluster(slow_link_cluster(), path)
    torch.distributed.barrier() if torch.distributed.is_initialized() else None
    with setup_lines() as lines:
        t = trainer(CephaloStrategy(cluster=path, global_batch_size=GLOBAL), world, STEPS, precision="64-true")
        t.fit(LibraryLM("llama", "adamw"), loader(PaddedTokens(GLOBAL * STEPS), GLOBAL))
        piped = {"plan": t.strategy.plan, "states": _states(t), "loss": float(t.callback_metrics["train_loss_step"])}
        t = trainer(CephaloStrategy(cluster=path, global_batch_size=GLOBAL, state_dict_type="full"), world, STEPS,
                    precision="64-true")
        t.validate(_validated("llama"), loader(PaddedTokens(VAL, seed=VAL_SEED), VAL))
    return {"piped": piped, "flat": t.strategy.plan,
            "lines": [line for line in lines if line.startswith("Cephalo: planned from the cluster file")]}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("plans")


@pytest.fixture(scope="module")
def runs(folder):
    pytest.importorskip("transformers")
    return run_distributed(_fit, 4, str(folder))


def _trained_like_one_process(name: str, family: str, plan, clip, got: dict, logged: set[float]) -> None:  # noqa: ANN001
    """``got`` (the parameters after STEPS steps under ``plan``) within the noise floor of one process's,
    and the loss every rank logged the global one."""
    losses: list[float] = []
    want = pipeline_reference(family, STEPS, GLOBAL, clip=clip, losses=losses)
    cuts = tuple(n for chain in plan.pipelines for n in plan.ranks[chain[0]].micro_batch_sizes)
    cut = pipeline_reference(family, STEPS, GLOBAL, cuts, clip)
    floor = max((cut[k] - v).abs().max().item() for k, v in want.items())
    bound = max(EXACT, FLOOR_FACTOR * floor)
    assert {k: tuple(v.shape) for k, v in got.items()} == {k: tuple(v.shape) for k, v in want.items()}
    err = max((got[k] - v).abs().max().item() for k, v in want.items())
    print(f"{name}: largest difference {err:.3e} (noise floor {floor:.3e}, bound {bound:.3e})")
    assert err <= bound, f"{name}: parameters differ from one process's by {err:.2e} > {bound:.2e}"
    assert len(logged) == 1, f"{name}: the ranks logged {logged}"  # the last stage's loss, alike on every rank
    assert logged.pop() == pytest.approx(float(losses[-1]), rel=1e-6), f"{name}: the logged loss is not the global one"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_pipelined_plan_file_trains_in_lightning_like_one_process(runs, name):
    family, stage_layers, rows, schedule, clip = SCENARIOS[name]
    assert all(r[name]["steps"] == STEPS for r in runs)
    _trained_like_one_process(name, family, _plan(stage_layers, rows, schedule), clip, runs[0][name]["states"],
                              {r[name]["loss"] for r in runs})


@pytest.mark.multiprocess
def test_a_cluster_file_alone_gets_the_pipelined_plan_the_cli_picks_and_trains_like_one_process(runs):
    """CephaloStrategy(cluster=...) with no plan: the planning weighs pipelines as the CLI does (the
    slow link's pipelined plan, about 3x faster by the cluster file's figures), and the fit under it
    lands where one process's does; the setup line says what was picked."""
    from cephalo_lightning.planner import plan as make_plan
    from tests.plans import slow_link_cluster

    piped = runs[0]["cluster"]["piped"]
    want = make_plan(slow_link_cluster(), GLOBAL, pipelines=True)
    assert piped["plan"].pipelined and piped["plan"] == want
    assert all(r["cluster"]["piped"]["plan"] == want for r in runs)
    _trained_like_one_process("cluster", "llama", piped["plan"], None, piped["states"],
                              {r["cluster"]["piped"]["loss"] for r in runs})
    line = runs[0]["cluster"]["lines"][0]
    assert "with pipelines weighed" in line and f"{len(want.pipelines)} pipeline(s) x 2 stages" in line, line


@pytest.mark.multiprocess
def test_an_option_that_rules_pipelines_out_gets_the_flat_plan_and_the_setup_line_says_why(runs):
    from cephalo_lightning.planner import plan as make_plan
    from tests.plans import slow_link_cluster

    flat = runs[0]["cluster"]["flat"]
    assert not flat.pipelined and flat == make_plan(slow_link_cluster(), GLOBAL)
    assert len(runs[0]["cluster"]["lines"]) == 2, runs[0]["cluster"]["lines"]  # one line a setup
    line = runs[0]["cluster"]["lines"][1]
    assert "without weighing pipelines" in line and "state_dict_type='full'" in line, line


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
def test_predict_under_a_pipelined_plan_returns_one_process_logits_on_every_rank(runs):
    """GPT-2 under 2 stages x 2 pipelines (3 and 2 micro-batches), the initial model: every rank returns,
    for each batch it was dealt, the logits one process computes on that batch (the last stage's, sent
    to the first); the ranks of a pipeline are dealt the same batches, the pipelines every sample once."""
    from tests.library_models import LibraryLM, PaddedTokens

    family, stage_layers, rows, schedule, _ = SCENARIOS["gpt2-gpipe-clip"]
    plan = _plan(stage_layers, rows, schedule)
    module = LibraryLM(family, "adamw").to(torch.float64)
    for rank, result in enumerate(runs):
        seen, returned = result["predict"]["seen"], result["predict"]["returned"]
        assert len(seen) == len(returned) == -(-PREDICT // PREDICT_BATCH), f"rank {rank}: {len(seen)} batches"
        for (batch, got), back in zip(seen, returned):
            assert torch.equal(got, back), f"rank {rank}: trainer.predict returned other outputs than the step's"
            with torch.no_grad():
                want = module.model(**batch).logits
                rows_alone = torch.cat([module.model(**{k: v[i:i + 1] for k, v in batch.items()}).logits
                                        for i in range(len(want))])
            floor = (rows_alone - want).abs().max().item()  # the same maths, another batch size
            bound = max(EXACT * want.abs().max().item(), FLOOR_FACTOR * floor)
            assert got.shape == want.shape, (rank, got.shape, want.shape)
            err = (got - want).abs().max().item()
            assert err <= bound, f"rank {rank}: logits differ from one process's by {err:.2e} > {bound:.2e}"
    for chain in plan.pipelines:  # the ranks of a pipeline: the same batches
        first = [b["input_ids"] for b, _ in runs[chain[0]]["predict"]["seen"]]
        for r in chain[1:]:
            assert all(torch.equal(a, b["input_ids"]) for a, (b, _) in zip(first, runs[r]["predict"]["seen"]))
    dealt = sorted(tuple(row) for chain in plan.pipelines for b, _ in runs[chain[0]]["predict"]["seen"]
                   for row in b["input_ids"].tolist())
    assert dealt == sorted(tuple(row) for row in PaddedTokens(PREDICT).batch(0, PREDICT)["input_ids"].tolist())


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
