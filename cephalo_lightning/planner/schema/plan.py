"""The plan: what every rank computes and stores. The JSON file the strategy loads."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from cephalo_lightning._common.atomic_io import write_text_atomic
from cephalo_lightning._common.vocabulary import (
    PipelineSchedule,
    Planner,
    ProfileSource,
    Schedule,
    StrEnum,
    hold_member,
    member_of,
    values_of,
)
from cephalo_lightning.planner.schema.files import read_document
from cephalo_lightning.planner.schema.plan_fields import field_member, finite, refuse_unknown, shown, text_field, whole
from cephalo_lightning.planner.schema.plan_pipeline import pipeline_fields_from_dict, validate_pipeline
from cephalo_lightning.planner.schema.planning_error import REMAKE, PlanningError

PLAN_FORMAT_VERSION = 5  # 5: pipeline stages and idle ranks; a plan without them is written as version 4
READ_VERSIONS = (4, 5)  # 4: every rank's binding and why (a version-4 file has none of version 5's fields)
PIPELINE_RANK_FIELDS = ("stage", "pipeline", "idle")  # version 5's fields of a rank
PIPELINE_PLAN_FIELDS = ("stage_layers", "pipeline_schedule")  # version 5's fields of a plan
UNPROFILED = "unprofiled"  # the device name of a plan made before anything was measured (Plan.even)


def split_sizes(batch_size: int, num_micro_batches: int) -> list[int]:
    """Near-equal micro-batch sizes, largest first; an empty batch has no micro-batches."""
    if batch_size == 0:
        return []
    if num_micro_batches < 1 or num_micro_batches > batch_size:
        raise PlanningError(f"cannot split {batch_size} samples into {num_micro_batches} micro-batches; use 1 to "
                            f"{max(batch_size, 1)} micro-batches")
    q, rem = divmod(batch_size, num_micro_batches)
    return [q + 1] * rem + [q] * (num_micro_batches - rem)


def _builtin_numbers(record: Any) -> None:
    """Figures computed with numpy are stored as Python numbers, so a plan serialises anywhere (JSON,
    YAML, logger configs) the same way."""
    for name, value in vars(record).items():
        if type(value).__module__ == "numpy" and hasattr(value, "item"):  # a numpy scalar (np.float64 is a float)
            object.__setattr__(record, name, value.item())


class Binding(StrEnum):
    """What keeps a rank from taking one sample more (:mod:`.why`)."""

    COMPUTE = "compute"  # its compute sets the step
    MEMORY = "memory"  # one sample more fits at no micro-batch count
    LINK = "link"  # collectives set the step, whatever the batch split
    GRANULARITY = "granularity"  # one sample more would reach or pass the step: samples are whole


@dataclass(frozen=True)
class RankPlan:
    rank: int
    device: str
    batch_size: int
    num_micro_batches: int
    micro_batch_size: int  # the largest micro-batch; the others are at most one smaller
    state_share: float
    predicted_step_s: float | None = None
    predicted_memory_gb: float | None = None
    source: ProfileSource = ProfileSource.MEASURED  # where the device's figures came from
    memory_limit_gb: float | None = None  # usable_memory_fraction * capacity: what memory must stay under
    memory_capacity_gb: float | None = None  # the device's total memory
    # False: the rank's one micro-batch keeps its autograd graph instead of recomputing each layer
    # in the backward pass (layered mode, num_micro_batches == 1)
    recompute: bool = True
    # The shard group the rank belongs to: the ranks of one group hold one whole replica of the
    # training state between them, split by their state shares (which sum to 1 within the group);
    # groups replicate each other. One group of every rank is a full shard; groups of one rank are
    # data parallelism.
    shard_group: int = 0
    binding: Binding | None = None  # what keeps the rank from one sample more (planner/why.py)
    why: str | None = None  # the same in one line, with the cost model's figures
    # A pipelined plan (Plan.stage_layers): the stage the rank computes (0 = the first layers) and the
    # pipeline (a chain of one rank per stage, a replica of the model) it belongs to.
    stage: int = 0
    pipeline: int = 0
    # A rank left out: no samples, no state, in no shard group or pipeline (its shard_group, stage and
    # pipeline stay 0 and mean nothing).
    idle: bool = False

    def __post_init__(self) -> None:
        _builtin_numbers(self)
        hold_member(self, "source", ProfileSource, PlanningError, REMAKE)

    @property
    def micro_batch_sizes(self) -> list[int]:
        return split_sizes(self.batch_size, self.num_micro_batches)


@dataclass(frozen=True)
class BaselineResult:
    predicted_samples_per_s: float | None
    feasible: bool
    predicted_step_s: float | None = None
    reason: str | None = None
    ranks: tuple[RankPlan, ...] = ()
    skipped: bool = False  # not computed (reason says why), rather than infeasible

    def __post_init__(self) -> None:
        _builtin_numbers(self)


@dataclass(frozen=True)
class ModelSummary:
    """What a plan records of the model it was made for, so a fit can refuse another model; every
    field is optional (a plan written by hand may record none)."""

    name: str | None = None
    parameters: int | None = None
    trainable_parameters: int | None = None
    num_layers: int | None = None
    state_bytes_per_param: float | None = None
    weight_bytes_per_param: float | None = None

    def __post_init__(self) -> None:
        _builtin_numbers(self)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> ModelSummary:
        if not isinstance(data, Mapping):
            raise PlanningError(f"{where}: 'model' must be an object, got {shown(data)}; {REMAKE}")
        refuse_unknown(data, {f.name for f in fields(cls)}, f"{where}: model")
        values: dict[str, Any] = {}
        for key, value in data.items():
            if value is None:
                continue
            if key == "name":
                if not isinstance(value, str):
                    raise PlanningError(f"{where}: model.name must be a string, got {shown(value)}; {REMAKE}")
                values[key] = value
            elif key.endswith("_per_param"):
                values[key] = finite(value, f"{where}: model.{key}", 0.0)
            else:
                values[key] = whole(value, f"{where}: model.{key}", 0)
        return cls(**values)


@dataclass(frozen=True)
class Plan:
    global_batch_size: int
    mode: Schedule
    ranks: tuple[RankPlan, ...]
    predicted_step_s: float | None = None
    predicted_samples_per_s: float | None = None
    upper_bound_samples_per_s: float | None = None
    model: ModelSummary = field(default_factory=ModelSummary)
    baselines: dict[str, BaselineResult] = field(default_factory=dict)
    planner: Planner = Planner.CEPHALO  # which planner made it: cephalo or a baseline (even, proportional, ...)
    emulated: bool = False
    optimality_gap: float | None = None  # certified: predicted step / proven lower bound - 1
    # A pipelined plan: how many of the model's layers each stage computes, in order (they sum to the
    # model's layer count), and the schedule of its micro-batches; () and None when not pipelined.
    stage_layers: tuple[int, ...] = ()
    pipeline_schedule: PipelineSchedule | None = None

    def __post_init__(self) -> None:
        _builtin_numbers(self)
        object.__setattr__(self, "mode", member_of(Schedule, self.mode))  # validate_plan refuses any other
        hold_member(self, "planner", Planner, PlanningError, REMAKE)
        object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
        if self.pipeline_schedule is not None:
            hold_member(self, "pipeline_schedule", PipelineSchedule, PlanningError, REMAKE)
        validate_plan(self)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def batch_sizes(self) -> list[int]:
        return [r.batch_size for r in self.ranks]

    @property
    def num_micro_batches(self) -> list[int]:
        return [r.num_micro_batches for r in self.ranks]

    @property
    def state_shares(self) -> list[float]:
        return [r.state_share for r in self.ranks]

    @property
    def shard_groups(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of every shard group (idle ranks in none), groups in order of their index, ranks in order."""
        groups: dict[int, list[int]] = {}
        for r in self.active_ranks:
            groups.setdefault(r.shard_group, []).append(r.rank)
        return tuple(tuple(groups[g]) for g in sorted(groups))

    @property
    def num_shard_groups(self) -> int:
        return len({r.shard_group for r in self.active_ranks})

    def group_shares(self, rank: int) -> list[float]:
        """The state shares of the ranks in ``rank``'s shard group, in rank order (they sum to 1)."""
        group = self.ranks[rank].shard_group
        return [r.state_share for r in self.active_ranks if r.shard_group == group]

    @property
    def active_ranks(self) -> tuple[RankPlan, ...]:
        return tuple(r for r in self.ranks if not r.idle)

    @property
    def idle_ranks(self) -> tuple[int, ...]:
        """The ranks the plan leaves out (no samples, no state)."""
        return tuple(r.rank for r in self.ranks if r.idle)

    @property
    def pipelined(self) -> bool:
        return bool(self.stage_layers)

    @property
    def num_stages(self) -> int:
        """The stages of a pipelined plan; 1 for a plan that is not pipelined."""
        return len(self.stage_layers) or 1

    @property
    def pipelines(self) -> tuple[tuple[int, ...], ...]:
        """Every pipeline's ranks ordered by stage, pipelines in order of their index; a plan that is
        not pipelined has one pipeline of one stage per active rank."""
        if not self.pipelined:
            return tuple((r.rank,) for r in self.active_ranks)
        chains: dict[int, dict[int, int]] = {}
        for r in self.active_ranks:
            chains.setdefault(r.pipeline, {})[r.stage] = r.rank
        return tuple(tuple(chains[d][s] for s in sorted(chains[d])) for d in sorted(chains))

    def samples_of(self, rank: int) -> tuple[int, int]:
        """(offset, count) of ``rank``'s samples within each global batch: the ranks' batches end to
        end in rank order, or, in a pipelined plan, the pipelines' in pipeline order, every rank of a
        pipeline taking its pipeline's (the global batch is the sum over pipelines)."""
        if not self.pipelined:
            sizes = self.batch_sizes
            return sum(sizes[:rank]), sizes[rank]
        offset = 0
        for chain in self.pipelines:
            size = self.ranks[chain[0]].batch_size
            if rank in chain:
                return offset, size
            offset += size
        return 0, 0  # an idle rank

    @property
    def fraction_of_upper_bound(self) -> float | None:
        if not self.predicted_samples_per_s or not self.upper_bound_samples_per_s:
            return None
        return self.predicted_samples_per_s / self.upper_bound_samples_per_s

    # ---------------------------------------------------------------- JSON round trip

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("ranks", "baselines")}
        data.update(mode=self.mode.value, planner=self.planner.value, model=self.model.to_dict())
        version_5 = self.pipelined or bool(self.idle_ranks)
        data["ranks"] = [_rank_dict(r, version_5) for r in self.ranks]
        if version_5:
            data.update(stage_layers=list(self.stage_layers),
                        pipeline_schedule=self.pipeline_schedule.value if self.pipeline_schedule else None)
        else:
            for key in PIPELINE_PLAN_FIELDS:
                data.pop(key)
        data["baselines"] = {
            name: {f.name: getattr(b, f.name) for f in fields(b)
                   if f.name != "ranks" and getattr(b, f.name) is not None and (f.name != "skipped" or b.skipped)}
            for name, b in self.baselines.items()
        }
        data["format_version"] = PLAN_FORMAT_VERSION if version_5 else 4
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan") -> Plan:
        """A plan from its JSON form; bad fields raise a PlanningError naming the field and the fix."""
        if not isinstance(data, Mapping):
            raise PlanningError(
                f"{where}: a plan must be a JSON object with 'global_batch_size' and 'ranks', got a "
                f"{type(data).__name__}; {REMAKE}")
        version = data.get("format_version")
        if type(version) is not int or version not in READ_VERSIONS:
            newer = type(version) is int and version > PLAN_FORMAT_VERSION
            raise PlanningError(
                f"{where}: format_version {version!r} is not one this version reads "
                f"({', '.join(map(str, READ_VERSIONS))}); {'upgrade cephalo-lightning or ' if newer else ''}{REMAKE}")
        new = set(PIPELINE_PLAN_FIELDS) if version == PLAN_FORMAT_VERSION else set()
        refuse_unknown(data, {f.name for f in fields(cls)} - set(PIPELINE_PLAN_FIELDS) | new | {"format_version"}, where)
        for key in ("global_batch_size", "ranks"):
            if key not in data:
                raise PlanningError(f"{where}: the field '{key}' is missing; {REMAKE}")
        ranks_data = data["ranks"]
        if not isinstance(ranks_data, list) or not ranks_data:
            raise PlanningError(f"{where}: 'ranks' must be a non-empty list of per-rank objects, got "
                                f"{shown(ranks_data)}; {REMAKE}")
        ranks = tuple(_rank_from_dict(r, i, where, version) for i, r in enumerate(ranks_data))
        baselines_data = data.get("baselines", {})
        if not isinstance(baselines_data, Mapping):
            raise PlanningError(f"{where}: 'baselines' must be an object, got {shown(baselines_data)}; {REMAKE}")
        baselines = {}
        for name, b in baselines_data.items():
            if not isinstance(b, Mapping):
                raise PlanningError(f"{where}: baselines.{name} must be an object, got {shown(b)}; {REMAKE}")
            refuse_unknown(b, {f.name for f in fields(BaselineResult)} - {"ranks"}, f"{where}: baselines.{name}")
            baselines[name] = BaselineResult(**{"predicted_samples_per_s": None, "feasible": False, **b})
        extra: dict[str, Any] = {}
        for key in ("predicted_step_s", "predicted_samples_per_s", "upper_bound_samples_per_s", "optimality_gap"):
            if data.get(key) is not None:
                extra[key] = finite(data[key], f"{where}: {key}")
        if "model" in data:
            extra["model"] = ModelSummary.from_dict(data["model"], where)
        for key, kind in (("planner", str), ("emulated", bool)):
            if key in data:
                if not isinstance(data[key], kind):
                    raise PlanningError(f"{where}: '{key}' must be a {kind.__name__}, got {shown(data[key])}; {REMAKE}")
                extra[key] = data[key]
        if "planner" in extra:
            extra["planner"] = field_member(Planner, extra["planner"], f"{where}: 'planner'")
        extra.update(pipeline_fields_from_dict(data, where))
        mode = data.get("mode", Schedule.LAYERED)
        if not isinstance(mode, str):
            raise PlanningError(f"{where}: 'mode' must be one of {values_of(Schedule)}, got {shown(mode)}; {REMAKE}")
        return cls(whole(data["global_batch_size"], f"{where}: global_batch_size", 1), mode, ranks,
                   baselines=baselines, **extra)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        data = read_document(path, "plan file", "make one with `python -m cephalo_lightning plan ... -o plan.json`",
                             json_only=True)
        return cls.from_dict(data, where=str(path))

    # ---------------------------------------------------------------- simple plans

    @classmethod
    def even(cls, world_size: int, global_batch_size: int, num_micro_batches: int = 1,
             mode: Schedule = Schedule.LAYERED) -> Plan:
        """Equal batches and shares, as plain FSDP would run: the default before anything is measured."""
        if world_size < 1:
            raise PlanningError(f"world size must be >= 1, got {world_size}; run on at least one device")
        if global_batch_size < world_size * num_micro_batches:
            raise PlanningError(
                f"global batch {global_batch_size} is too small for {world_size} ranks x "
                f"{num_micro_batches} micro-batches; raise the batch size to at least {world_size * num_micro_batches}"
            )
        q, rem = divmod(global_batch_size, world_size)
        ranks = []
        for rank in range(world_size):
            b = q + (1 if rank < rem else 0)
            # one micro-batch keeps its graph, as plain FSDP would (nothing is known to say it does not fit)
            keep = mode == Schedule.LAYERED and num_micro_batches == 1 and b > 0
            ranks.append(RankPlan(rank, UNPROFILED, b, num_micro_batches, -(-b // num_micro_batches), 1 / world_size,
                                  recompute=not keep))
        return cls(global_batch_size, mode, tuple(ranks), planner=Planner.EVEN)


def _rank_dict(r: RankPlan, version_5: bool) -> dict[str, Any]:
    """A rank's JSON form: a flat dataclass (vars() is asdict(), fast), the vocabularies as their strings;
    version 5's fields only in a version-5 file."""
    data = dict(vars(r))
    if not version_5:
        for key in PIPELINE_RANK_FIELDS:
            data.pop(key)
    data["source"] = r.source.value
    if r.binding is not None:
        data["binding"] = r.binding.value
    return data


_RANK_REQUIRED = ("rank", "device", "batch_size", "num_micro_batches", "micro_batch_size", "state_share")


def _rank_from_dict(data: Any, i: int, where: str, version: int) -> RankPlan:
    at = f"{where}: ranks[{i}]"
    if not isinstance(data, Mapping):
        raise PlanningError(f"{at} must be an object with {list(_RANK_REQUIRED)}, got {shown(data)}; {REMAKE}")
    new = set(PIPELINE_RANK_FIELDS) if version == PLAN_FORMAT_VERSION else set()
    refuse_unknown(data, {f.name for f in fields(RankPlan)} - set(PIPELINE_RANK_FIELDS) | new, at)
    missing = [k for k in _RANK_REQUIRED if k not in data]
    if missing:
        raise PlanningError(f"{at} (rank {data.get('rank', i)}) lacks {missing}; {REMAKE}")
    values: dict[str, Any] = {
        "rank": whole(data["rank"], f"{at}.rank", 0),
        "device": text_field(data["device"], f"{at}.device (rank {i})", "a100-40gb"),
        "batch_size": whole(data["batch_size"], f"{at}.batch_size (rank {i})", 0),
        "num_micro_batches": whole(data["num_micro_batches"], f"{at}.num_micro_batches (rank {i})", 1),
        "micro_batch_size": whole(data["micro_batch_size"], f"{at}.micro_batch_size (rank {i})", 0),
        "state_share": finite(data["state_share"], f"{at}.state_share (rank {i})", 0.0),
    }
    for key in ("predicted_step_s", "predicted_memory_gb", "memory_limit_gb", "memory_capacity_gb"):
        if data.get(key) is not None:
            values[key] = finite(data[key], f"{at}.{key} (rank {i})")
    if "source" in data:
        source = text_field(data["source"], f"{at}.source (rank {i})", ProfileSource.MEASURED)
        values["source"] = field_member(ProfileSource, source, f"{at}.source (rank {i})")
    if data.get("binding") is not None:
        names = list(values_of(Binding))
        if data["binding"] not in names:
            raise PlanningError(f"{at}.binding (rank {i}) must be one of {names}, got {shown(data['binding'])}; {REMAKE}")
        values["binding"] = Binding(data["binding"])
    if data.get("why") is not None:
        values["why"] = text_field(data["why"], f"{at}.why (rank {i})", "compute")
    for key in ("shard_group", "stage", "pipeline"):
        if key in data:
            values[key] = whole(data[key], f"{at}.{key} (rank {i})", 0)
    for key in ("recompute", "idle"):
        if key in data:
            if not isinstance(data[key], bool):
                raise PlanningError(f"{at}.{key} (rank {i}) must be true or false, got {shown(data[key])}; {REMAKE}")
            values[key] = data[key]
    return RankPlan(**values)


def validate_plan(plan: Plan) -> None:
    """Structural checks every plan must pass, whoever made it."""
    if plan.mode not in values_of(Schedule):
        raise PlanningError(f"plan mode must be one of {values_of(Schedule)}, got {plan.mode!r}; {REMAKE}")
    if not plan.ranks:
        raise PlanningError(f"a plan needs at least one rank; {REMAKE}")
    if [r.rank for r in plan.ranks] != list(range(len(plan.ranks))):
        raise PlanningError(f"plan ranks must be listed as 0, 1, 2, ... in order, got {[r.rank for r in plan.ranks][:8]}; "
                            f"{REMAKE}")
    validate_pipeline(plan)  # idle ranks, stages and pipelines; a pipelined plan's batch is its pipelines'
    total = sum(r.batch_size for r in plan.ranks)
    if not plan.pipelined and total != plan.global_batch_size:
        raise PlanningError(f"plan batch sizes sum to {total}, not the global batch {plan.global_batch_size}; {REMAKE}")
    for r in plan.ranks:
        if not math.isfinite(r.state_share):
            raise PlanningError(f"rank {r.rank}: state_share must be a finite number, got {r.state_share!r}; {REMAKE}")
        if r.batch_size < 0 or r.num_micro_batches < 1 or r.state_share < 0:
            raise PlanningError(f"rank {r.rank}: batch_size >= 0, num_micro_batches >= 1 and state_share >= 0 required; "
                                f"{REMAKE}")
        if not r.recompute and (plan.mode != Schedule.LAYERED or r.num_micro_batches != 1 or r.batch_size == 0):
            raise PlanningError(f"rank {r.rank}: recompute = false needs the layered mode and exactly one "
                                f"micro-batch of at least one sample (it keeps that micro-batch's graph); {REMAKE}")
        if r.batch_size and r.num_micro_batches > r.batch_size:
            raise PlanningError(f"rank {r.rank}: {r.num_micro_batches} micro-batches for only {r.batch_size} samples; "
                                f"give it at most {r.batch_size} micro-batches or {REMAKE}")
        expected = split_sizes(r.batch_size, r.num_micro_batches)[0] if r.batch_size else 0
        if r.micro_batch_size != expected:
            raise PlanningError(
                f"rank {r.rank}: micro_batch_size {r.micro_batch_size} does not match "
                f"ceil({r.batch_size} / {r.num_micro_batches}) = {expected}; set it to {expected} or {REMAKE}"
            )
    _validate_shard_groups(plan)
    if plan.mode == Schedule.UNIFORM:
        if len({r.num_micro_batches for r in plan.ranks}) > 1:
            raise PlanningError(f"a uniform plan must give every rank the same number of micro-batches; use the "
                                f"layered mode for per-rank counts or {REMAKE}")
        if any(r.batch_size == 0 for r in plan.ranks):
            raise PlanningError(f"a uniform plan must give every rank samples (b_i = 0 needs the layered mode); use "
                                f"the layered mode or {REMAKE}")


def _validate_shard_groups(plan: Plan) -> None:
    """Groups numbered 0, 1, ... in the order of their first rank; shares sum to 1 within each."""
    seen: list[int] = []
    for r in plan.active_ranks:
        if r.shard_group not in seen:
            if r.shard_group != len(seen):
                raise PlanningError(
                    f"rank {r.rank}: shard_group {r.shard_group} where {len(seen)} was expected: groups are "
                    f"numbered 0, 1, 2, ... in the order of their first rank; {REMAKE}")
            seen.append(r.shard_group)
    for index, ranks in enumerate(plan.shard_groups):
        total = sum(plan.ranks[k].state_share for k in ranks)
        if abs(total - 1.0) > 1e-6:
            if len(seen) == 1:
                raise PlanningError(f"plan state shares sum to {total:.6f}, not 1; {REMAKE}")
            raise PlanningError(f"the state shares of shard group {index} (ranks {list(ranks)}) sum to {total:.6f}, "
                                f"not 1 (each group holds one whole replica of the state); {REMAKE}")
