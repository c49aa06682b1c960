"""Which schedule a fit runs, what plans that schedule can run, and how its losses are weighted.

``layered``: the strategy runs the model's layers itself, layer-major over the micro-batches
(:class:`~.layered_steps.LayeredSteps`); ``uniform``: the user's ``training_step`` once per micro-batch
(:class:`~.uniform_steps.UniformSteps`), which needs one micro-batch count on every rank. The user asks
with ``CephaloStrategy(mode=...)``; ``auto`` takes ``layered`` wherever the model has a layered form.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from cephalo_lightning._common import vocabulary
from cephalo_lightning._common.errors import UnsupportedError
from cephalo_lightning.lightning.strategy_config import AUTO
from cephalo_lightning.models import SUPPORTED, Resolution, weighting
from cephalo_lightning.models.weighting import Decision
from cephalo_lightning.planner import Plan, PlanningError


def decide_schedule(requested: vocabulary.Schedule | vocabulary.Auto, resolution: Resolution,
                    module: pl.LightningModule) -> vocabulary.Schedule:
    """``layered`` when the model has a layered form (or was asked for), else ``uniform``."""
    layered_ok = resolution.layered is not None
    manual = not module.automatic_optimization
    if requested == vocabulary.Schedule.LAYERED and (not layered_ok or manual):
        why = "manual optimization runs your training_step itself" if manual else resolution.reason
        raise UnsupportedError(
            f"mode='layered' is not possible: {why}. Supported: {'; '.join(SUPPORTED)}. Or use mode='uniform'")
    if requested != AUTO:
        return vocabulary.Schedule(requested)
    schedule = vocabulary.Schedule.LAYERED if layered_ok and not manual else vocabulary.Schedule.UNIFORM
    if schedule == vocabulary.Schedule.UNIFORM:
        why = "manual optimization (automatic_optimization=False)" if manual else resolution.reason
        rank_zero_info(f"Cephalo: {why}; using the uniform mode (your training_step per micro-batch, one micro-batch "
                       f"count on every rank). The layered mode supports {'; '.join(SUPPORTED)}.")
    return schedule


def check_plan(plan: Plan, schedule: vocabulary.Schedule, resolution: Resolution, module: pl.LightningModule) -> None:
    """What the schedule can run: every plan a fit adopts (given, planned at setup, or re-planned)
    passes here, so none can train on part of its batches."""
    refuse_idle(plan, "Trainer(strategy='cephalo')")
    manual = not module.automatic_optimization
    if getattr(plan, "pipelined", False):
        if schedule != vocabulary.Schedule.LAYERED or manual:
            why = "manual optimization runs your training_step itself" if manual else "the uniform mode runs your " \
                "training_step on the whole model"
            raise UnsupportedError(
                f"a pipelined plan ({len(plan.stage_layers)} stages of {list(plan.stage_layers)} layers) runs in the "
                f"layered mode only ({why}): use mode='layered' with automatic optimization and a model with a layered "
                "form, or re-plan without pipelines (`python -m cephalo_lightning plan --no-pipelines`)")
        return
    if schedule == vocabulary.Schedule.UNIFORM and len(set(plan.num_micro_batches)) > 1:
        raise PlanningError(
            f"the plan gives ranks different micro-batch counts {plan.num_micro_batches}, which needs the layered mode "
            f"(here: {resolution.reason or 'manual optimization'}); re-plan with --mode uniform"
        )
    if manual and max(plan.num_micro_batches) > 1:  # the manual step runs training_step on one micro-batch
        raise PlanningError(
            f"manual optimization runs your training_step once per step on each rank, but the plan gives ranks "
            f"{plan.num_micro_batches} micro-batches; re-plan with one micro-batch per rank or use automatic optimization"
        )


def refuse_pipelined(plan: Plan, owner: str) -> None:
    """A pipelined plan (stages of layers, ``plan.stage_layers``) is refused where the loop is the
    user's (Fabric): a stage runs one part of the model and the schedule interleaves forward and
    backward passes across ranks, which only the Trainer's layered steps drive."""
    stages = tuple(getattr(plan, "stage_layers", ()) or ())
    if stages:
        raise UnsupportedError(
            f"the plan is pipelined ({len(stages)} stages of {list(stages)} layers), which {owner} cannot run: the "
            "forward and backward loop is yours, while a pipeline interleaves them across ranks. Train it with "
            "Trainer(strategy=CephaloStrategy(plan=...)), or re-plan without pipeline stages "
            "(`python -m cephalo_lightning plan --no-pipelines`)")


def refuse_idle(plan: Plan, owner: str) -> None:
    """A plan that leaves ranks idle (``RankPlan.idle``: no samples, no state; the planner's subsets)
    is refused by name: every rank a strategy launches holds a share of the state and takes part in
    every collective, so such a plan runs only where the idle GPUs are not launched at all."""
    idle = list(getattr(plan, "idle_ranks", ()) or ())
    if idle:
        busy = [r for r in range(len(plan.ranks)) if r not in idle]
        raise UnsupportedError(
            f"the plan leaves ranks {idle} idle (no samples, no state: it is faster on ranks {busy} alone), which "
            f"{owner} cannot run: every launched rank computes and holds state. Launch only the busy GPUs with a "
            "plan made for them (a cluster file listing those GPUs alone, `python -m cephalo_lightning plan`), or "
            "re-plan over every rank with `python -m cephalo_lightning plan --no-subsets`")


def loss_weighting(requested: str, resolution: Resolution, module: pl.LightningModule) -> Decision:
    """``CephaloStrategy(loss_weighting=...)`` as the steps apply it, with the setup log's words for
    it: what the model's loss averages over (:func:`cephalo_lightning.models.weighting.choose`)."""
    return weighting.choose(requested, module, resolution.layered)
