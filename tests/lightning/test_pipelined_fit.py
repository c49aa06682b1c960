"""Pipelined plans through ``Trainer.fit`` with no user code: one spawn of four gloo ranks.

Hugging Face Llama and GPT-2 (its embedding tied to its head, held by the first and the last stage),
built from tiny configs, in a plain LightningModule (tests/library_models.LibraryLM: the adapter finds
the layers), on right-padded batches whose loss is a mean over the label tokens, AdamW in fp64:
2 stages x 2 pipelines from a plan file (uneven batches, micro-batch counts and shares), 1F1B and
GPipe, one with gradient clipping. Each is compared with single-process training on the same global
batches (tests/reference.train_steps, tests/library_models.pipeline_reference), within the
bounds the runtime's tests use.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from cephalo_lightning._common.vocabulary import PipelineSchedule
from tests.distributed import run_distributed
from tests.library_models import pipeline_reference

STEPS, GLOBAL = 2, 8
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


def _validated(family: str):  # noqa: ANN202 - a LightningModule
    from tests.library_models import LibraryLM

    class Validated(LibraryLM):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.model(**batch).loss)

    return Validated(family, "adamw")


def _fit(rank: int, world: int, folder: str) -> dict:
    warnings.simplefilter("ignore")
    from cephalo_lightning import CephaloStrategy
    from cephalo_lightning._common.errors import UnsupportedError
    from tests.helpers import trainer
    from tests.library_models import LibraryLM, PaddedTokens, loader

    out = {}
    for name, (family, stage_layers, rows, schedule, clip) in SCENARIOS.items():
        path = f"{folder}/{name}.json"
        if rank == 0:
            _plan(stage_layers, rows, schedule).save(path)
        torch.distributed.barrier() if torch.distributed.is_initialized() else None
        t = trainer(CephaloStrategy(plan=path), world, STEPS, precision="64-true",
                    gradient_clip_val=clip)
        t.fit(LibraryLM(family, "adamw"), loader(PaddedTokens(GLOBAL * STEPS), GLOBAL))
        runner = t.strategy.fit_runtime.pipeline
        states = {k.removeprefix("model."): v for k, v in runner.model_state_dict().items()}
        out[name] = {"states": states, "loss": float(t.callback_metrics["train_loss_step"]),
                     "steps": t.global_step}
    t = trainer(CephaloStrategy(plan=path), world, STEPS, precision="64-true")  # a validation loop: refused before training
    try:
        data = loader(PaddedTokens(GLOBAL * STEPS), GLOBAL)
        t.fit(_validated(family), data, val_dataloaders=data)
        out["validation"] = None
    except UnsupportedError as refused:
        out["validation"] = (str(refused), t.global_step)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("transformers")
    return run_distributed(_fit, 4, str(tmp_path_factory.mktemp("plans")))


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
def test_a_validation_loop_under_a_pipelined_plan_is_refused_before_any_step(runs):
    for result in runs:
        assert result["validation"] is not None, "a validation loop ran the whole model on a stage"
        message, steps = result["validation"]
        assert "limit_val_batches=0" in message and steps == 0
