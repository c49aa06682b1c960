"""The plan a fit runs under: given, planned from a cluster file, or even; checked against the job.

A plan is only right for the job it was made for: the same number of ranks, the same model, and
each rank on the device the plan assumed (a rank launched on another GPU would get another GPU's
batch and share: silently slow, or out of memory once training is under way). :func:`check_devices`
compares every rank's actual device with the plan's before anything is trained.

[Note: planning from a cluster file weighs pipelines as the CLI does] ``CephaloStrategy(cluster=...)``
plans at setup as ``python -m cephalo_lightning plan`` does, pipelined plans weighed
(:func:`from_cluster`), wherever the fit could run the plan chosen: not where an option, the
schedule or the model rules a pipeline out (``pipeline_obstacle``: then the plan is made without
them), and never a plan that leaves ranks idle (the runtime refuses those: a pipelined plan that
would, wins over the plan over every rank only in the CLI). One setup line says which plan was
made and, where pipelines were not weighed, why; ``pipelines=False`` never weighs them,
``pipelines=True`` refuses what rules them out instead of planning without them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from cephalo_lightning._common import vocabulary
from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning._common.units import GIB
from cephalo_lightning.lightning._private import training_dataloader
from cephalo_lightning.lightning.steps.schedules import refuse_idle
from cephalo_lightning.lightning.strategy_config import MAX_SEED, StrategyConfig
from cephalo_lightning.planner import Cluster, Plan, PlanningError
from cephalo_lightning.planner import plan as make_plan
from cephalo_lightning.planner.choice import NO_PIPELINE, PIPELINED, span_text
from cephalo_lightning.planner.replan import replan
from cephalo_lightning.planner.schema.catalog import lookup, same_gpu
from cephalo_lightning.planner.schema.gpu_names import memory_agrees
from cephalo_lightning.planner.schema.plan import UNPROFILED
from cephalo_lightning.runtime.distributed import gather_objects, is_distributed
from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator
from cephalo_lightning.runtime.sharding.flat_unit import full_shape


@dataclass(frozen=True)
class DeviceIdentity:
    """What a rank actually runs on: a name as the profiler writes it and the memory it has."""

    rank: int
    name: str
    memory_gb: float | None  # None: not comparable (a CPU process without an emulated capacity)
    emulated: bool


def identity(rank: int, device: torch.device, emulator: DeviceEmulator) -> DeviceIdentity:
    if device.type == "cuda":  # pragma: no cover - CUDA only
        name = torch.cuda.get_device_name(device)
        memory = emulator.memory_gb or torch.cuda.get_device_properties(device).total_memory / GIB
    else:
        name, memory = device.type, emulator.memory_gb
    return DeviceIdentity(rank, name + emulator.name_suffix(), memory, emulator.is_emulated)


def gather_identities(mine: DeviceIdentity, world_size: int) -> list[DeviceIdentity]:
    """Collective: every rank's identity, in rank order."""
    return gather_objects(mine) if is_distributed() else [mine] * world_size


def global_batch(configured: int | None, trainer: Any, world_size: int) -> int:
    """The global batch to plan for: configured, else the training DataLoader's ``batch_size``."""
    if configured is not None:
        return configured
    if trainer.state.fn != TrainerFn.FITTING:
        return world_size  # evaluation only: its batches are Lightning's even shards anyway
    batch = getattr(training_dataloader(trainer), "batch_size", None)
    if batch is None:
        raise ConfigurationError(
            "set batch_size on the training DataLoader (the global batch) or CephaloStrategy(global_batch_size=B)")
    return batch


def data_seed(configured: int | None, environ: Mapping[str, str]) -> int | None:
    """The seed of the data order, by Lightning's convention: ``CephaloStrategy(seed=...)``, else
    ``PL_GLOBAL_SEED`` (what ``seed_everything`` sets, and what Lightning's own distributed sampler
    reads), else None: the caller takes the process's ``torch.initial_seed()`` at setup, which a
    ``torch.manual_seed`` call after ``seed_everything`` (say, in the model's constructor) changes."""
    if configured is not None:
        return configured
    given = environ.get("PL_GLOBAL_SEED")
    if given is None:
        return None
    try:
        seed = int(given)
    except ValueError:
        seed = -1
    if not 0 <= seed <= MAX_SEED:
        raise ConfigurationError(
            f"PL_GLOBAL_SEED={given!r} is not a seed (an integer in [0, 2**63 - 1]); call seed_everything(42), "
            "unset PL_GLOBAL_SEED, or give CephaloStrategy(seed=42)")
    return seed


def emulation_specs(configured: Sequence[Any] | None, cluster: Cluster | None) -> list[Any] | None:
    """Per-rank emulation: the strategy's ``emulate``, else the cluster file's ``emulate`` entries."""
    if configured is not None:
        return list(configured)
    if cluster is not None and any(d.emulate is not None for d in cluster.devices):
        return [d.emulate for d in cluster.devices]
    return None


def check_loader_batch(batch_size: int | None, plan: Plan, configured: int | None) -> None:
    """The training DataLoader's ``batch_size`` is the global batch: it must be the plan's."""
    if configured is None and batch_size not in (None, plan.global_batch_size):
        raise PlanningError(
            f"the training DataLoader has batch_size={batch_size} but the plan is for a global batch of "
            f"{plan.global_batch_size}: set batch_size={plan.global_batch_size} or re-plan with --global-batch-size "
            f"{batch_size}")


def resolve(*, plan: Plan | None, cluster: Cluster | None, schedule: vocabulary.Schedule, config: StrategyConfig,
            trainer: Any, world_size: int, identities: Callable[[], list[DeviceIdentity]],
            provisional: bool, pipeline_obstacle: str | None = None) -> Plan:
    """The plan to shard by at setup: the given one, one made from ``cluster`` (:func:`from_cluster`;
    ``pipeline_obstacle``: why this fit could not run a pipelined plan, None: it could), or an even one
    (``provisional``: state shares by memory until the callback's plan arrives). A given plan is
    checked against the world size and, ``config.check_devices``, the ranks' devices. The global
    batch (:func:`global_batch`) and the ranks' identities (a collective) are asked for only if needed."""
    def batch() -> int:
        return global_batch(config.global_batch_size, trainer, world_size)

    planner_mode = vocabulary.Schedule.UNIFORM if schedule == vocabulary.Schedule.UNIFORM else vocabulary.Schedule.LAYERED
    if config.elastic and cluster is not None and (plan if plan is not None else cluster).world_size != world_size:
        return replanned(plan, cluster, plan.global_batch_size if plan is not None else batch(),
                         plan.mode if plan is not None else planner_mode, identities)
    if plan is None and cluster is not None:
        plan = from_cluster(cluster, batch(), planner_mode, config.pipelines, pipeline_obstacle)
    if plan is None:
        plan = Plan.even(world_size, batch(), mode=schedule)
        if provisional:
            return memory_proportional(plan, identities())
        rank_zero_info("Cephalo: no plan or profile given; using an even split (equal batches and shares). "
                       "Add CephaloCallback() to profile and plan for heterogeneous devices.")
        return plan
    refuse_idle(plan, "Trainer(strategy='cephalo')")  # before the world size: launched busy ranks only, it names the fix
    if plan.world_size != world_size:
        if config.elastic:
            return replanned(plan, None, plan.global_batch_size, plan.mode, identities)
        raise PlanningError(
            f"the plan is for {plan.world_size} ranks but the job has {world_size}: re-plan for {world_size} ranks "
            f"(python -m cephalo_lightning plan ... ), launch {plan.world_size} processes, or pass "
            "CephaloStrategy(elastic=True) to re-plan it for the ranks present (elastic restarts)"
        )
    if config.check_devices:
        check_devices(plan, identities())
    return plan


def from_cluster(cluster: Cluster, global_batch_size: int, mode: vocabulary.Schedule,
                 pipelines: bool | vocabulary.Auto, obstacle: str | None) -> Plan:
    """[Note: planning from a cluster file weighs pipelines as the CLI does] The plan for ``cluster``,
    pipelined plans weighed unless ``pipelines`` is False or ``obstacle`` (why the fit could not run
    one) rules them out; said in one setup line."""
    if pipelines is True and obstacle is not None:
        raise ConfigurationError(f"CephaloStrategy(pipelines=True) weighs pipelined plans, which this fit cannot run: "
                                 f"{obstacle}. Drop pipelines=True (the plan is then made without pipelines) or what "
                                 "rules them out")
    weigh = pipelines is not False and obstacle is None and mode == vocabulary.Schedule.LAYERED
    plan = make_plan(cluster, global_batch_size, mode=mode, pipelines=weigh)
    if not weigh:
        why = "pipelines=False" if pipelines is False else obstacle or f"the {mode} mode"
        rank_zero_info(f"Cephalo: planned from the cluster file without weighing pipelines ({why}): {_shape(plan)}")
        return plan
    if plan.idle_ranks:  # the runtime runs every rank: the plan over every rank instead
        idle = span_text(plan.idle_ranks)
        plan = make_plan(cluster, global_batch_size, mode=mode)
        rank_zero_info(f"Cephalo: planned from the cluster file with pipelines weighed: the best pipelined plan leaves "
                       f"ranks {idle} idle, which the strategy does not run; the plan over every rank: {_shape(plan)}")
        return plan
    flat, piped = plan.baselines.get(NO_PIPELINE), plan.baselines.get(PIPELINED)
    against = (f" against {flat.predicted_step_s:.3g} s without a pipeline" if plan.pipelined and flat is not None
               and flat.predicted_step_s is not None else "")
    if not plan.pipelined and piped is not None:
        against = (f" (the best pipelined plan: {piped.predicted_step_s:.3g} s)" if piped.predicted_step_s is not None
                   else f" (pipelined: {piped.reason})")
    rank_zero_info(f"Cephalo: planned from the cluster file with pipelines weighed: {_shape(plan)}{against}")
    return plan


def _shape(plan: Plan) -> str:
    """The plan's shape and predicted step, in a few words."""
    if plan.pipelined:
        shape = (f"{len(plan.pipelines)} pipeline(s) x {len(plan.stage_layers)} stages (layers "
                 f"{'+'.join(map(str, plan.stage_layers))}, {plan.pipeline_schedule})")
    else:
        shape = f"{plan.num_shard_groups} shard group(s), no pipeline"
    return f"{shape}, predicted {plan.predicted_step_s:.3g} s a step"


def replanned(plan: Plan | None, cluster: Cluster | None, global_batch_size: int, mode: vocabulary.Schedule,
              identities: Callable[[], list[DeviceIdentity]]) -> Plan:
    """An elastic restart: the plan for the devices present (:func:`cephalo_lightning.planner.replan.replan`), with a warning.
    Each rank's device goes by the name the cluster file or the plan gives that card (:func:`planned_name`)."""
    known = [(d.name, d.memory_gb) for d in cluster.devices] if cluster is not None else []
    known += [(r.device, r.memory_capacity_gb) for r in plan.ranks] if plan is not None else []
    names = [planned_name(i, known) for i in identities()]
    new, warning = replan(plan, cluster, names, global_batch_size, mode)
    rank_zero_warn(warning)
    return new


def planned_name(actual: DeviceIdentity, known: Sequence[tuple[str, float | None]]) -> str:
    """The name a cluster file or plan gives this rank's card (``known``: (name, GiB) pairs): a name the
    catalog reads as the same GPU ("rtx3090" for CUDA's "NVIDIA GeForce RTX 3090", :func:`.catalog.lookup`),
    else the rank's own name; an emulated device goes by its own."""
    card = None if actual.emulated else lookup(actual.name, actual.memory_gb)
    if card is None or any(name == actual.name for name, _ in known):
        return actual.name
    return next((name for name, gib in known if getattr(lookup(name, gib), "key", None) == card.key), actual.name)


def memory_proportional(plan: Plan, identities: list[DeviceIdentity]) -> Plan:
    """``plan`` with state shares in proportion to each rank's memory (equal where any is unknown):
    a provisional layout before profiling that no device is too small for if the model fits at all."""
    memories = [i.memory_gb for i in identities]
    if any(m is None or m <= 0 for m in memories):
        return plan
    total = sum(memories)
    ranks = tuple(replace(r, state_share=m / total) for r, m in zip(plan.ranks, memories))
    return replace(plan, ranks=ranks, planner=vocabulary.Planner.PROVISIONAL)


def check_model(plan: Plan, module: nn.Module) -> None:
    """Refuse a plan made for another model: its parameters, and its trainable ones, where it records them."""
    model = plan.model
    params = list(module.parameters())
    total = sum(math.prod(full_shape(p)) for p in params)
    trainable = sum(math.prod(full_shape(p)) for p in params if p.requires_grad)
    for what, expected, actual in (("parameters", model.parameters, total),
                                   ("trainable parameters", model.trainable_parameters, trainable)):
        if expected and abs(actual - expected) > 0.02 * expected:
            raise PlanningError(
                f"the plan was made for a model with {expected:,} {what} ({model.name or '?'}) "
                f"but this LightningModule has {actual:,}: re-plan for this model"
            )


def _with_memory(name: str, memory_gb: float | None) -> str:
    return f"{name!r}" if memory_gb is None else f"{name!r} ({memory_gb:.3g} GiB)"


def _mismatch(expected_name: str, expected_memory: float | None, actual: DeviceIdentity) -> str | None:
    """Why a rank's device is not the plan's (None: it is). Real GPUs are compared by the catalog's
    name matcher (:func:`.catalog.same_gpu`: "rtx3090" is "NVIDIA GeForce RTX 3090"), emulated
    devices by their full name; both by memory where the plan records it."""
    if expected_name in (UNPROFILED, "") or expected_name == actual.name:
        return None
    if "(emulated" in expected_name or actual.emulated:
        if "(emulated" in expected_name and expected_name.lower() != actual.name.lower():
            return f"the plan expects {expected_name!r}, this rank is {actual.name!r}"
    elif not same_gpu(expected_name, expected_memory, actual.name, actual.memory_gb):
        return (f"the plan expects a {_with_memory(expected_name, expected_memory)}, this rank has a "
                f"{_with_memory(actual.name, actual.memory_gb)}")
    if expected_memory is not None and actual.memory_gb is not None and not memory_agrees(expected_memory,
                                                                                          actual.memory_gb):
        return (f"the plan expects {expected_memory:.3g} GiB of device memory ({expected_name!r}), this rank has "
                f"{actual.memory_gb:.3g} GiB ({actual.name!r})")
    return None


def check_devices(plan: Plan, identities: list[DeviceIdentity]) -> None:
    """Every rank's device is the one the plan gives that rank (every rank raises alike)."""
    problems = []
    for rank_plan, actual in zip(plan.ranks, identities):
        problem = _mismatch(rank_plan.device, rank_plan.memory_capacity_gb, actual)
        if problem:
            problems.append(f"rank {actual.rank}: {problem}")
    if problems:
        listing = "\n  ".join(problems)
        raise PlanningError(
            f"the plan does not match the devices the ranks run on:\n  {listing}\nEach rank would get another "
            "device's batch and state share. Launch the ranks in the plan's device order, re-plan for this cluster "
            "(CephaloCallback(), or python -m cephalo_lightning plan), or pass CephaloStrategy(check_devices=False) "
            "if you know the plan is right"
        )
