"""The plan: what every rank computes and stores. The JSON file the strategy loads."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cephalo_lightning.atomic_io import write_text_atomic
from cephalo_lightning.planner.cost import split_sizes
from cephalo_lightning.planner.errors import PlanningError

PLAN_MODES = ("layered", "uniform")
PLAN_FORMAT_VERSION = 1


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
    source: str = "measured"  # where the device's figures came from: measured | catalog | emulated
    memory_limit_gb: float | None = None  # usable_memory_fraction * capacity: what memory must stay under
    memory_capacity_gb: float | None = None  # the device's total memory

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


@dataclass(frozen=True)
class Plan:
    global_batch_size: int
    mode: str
    ranks: tuple[RankPlan, ...]
    predicted_step_s: float | None = None
    predicted_samples_per_s: float | None = None
    upper_bound_samples_per_s: float | None = None
    model: dict[str, Any] = field(default_factory=dict)  # name, parameters, num_layers
    baselines: dict[str, BaselineResult] = field(default_factory=dict)
    strategy: str = "cephalo"  # which planner made it: cephalo | even | proportional
    emulated: bool = False
    optimality_gap: float | None = None  # certified: predicted step / proven lower bound - 1

    def __post_init__(self) -> None:
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
    def fraction_of_upper_bound(self) -> float | None:
        if not self.predicted_samples_per_s or not self.upper_bound_samples_per_s:
            return None
        return self.predicted_samples_per_s / self.upper_bound_samples_per_s

    # ---------------------------------------------------------------- JSON round trip

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ranks"] = [asdict(r) for r in self.ranks]
        data["baselines"] = {
            name: {k: v for k, v in asdict(b).items() if k != "ranks" and v is not None}
            for name, b in self.baselines.items()
        }
        data["format_version"] = PLAN_FORMAT_VERSION
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        try:
            ranks = tuple(RankPlan(**r) for r in data["ranks"])
            baselines = {name: BaselineResult(**{"predicted_samples_per_s": None, **b})  # None is not written
                         for name, b in data.get("baselines", {}).items()}
            extra = {k: data[k] for k in ("predicted_step_s", "predicted_samples_per_s",
                                          "upper_bound_samples_per_s", "model", "strategy", "emulated",
                                          "optimality_gap")
                     if k in data}
            return cls(int(data["global_batch_size"]), str(data.get("mode", "layered")), ranks,
                       baselines=baselines, **extra)
        except (KeyError, TypeError) as err:
            raise PlanningError(f"not a cephalo plan ({err}); make one with `python -m cephalo_lightning plan`") from err

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        if not path.is_file():
            raise PlanningError(f"plan file {str(path)!r} does not exist; make one with `python -m cephalo_lightning plan`")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise PlanningError(f"{path}: not valid JSON ({err})") from err
        return cls.from_dict(data)

    # ---------------------------------------------------------------- simple plans

    @classmethod
    def even(cls, world_size: int, global_batch_size: int, num_micro_batches: int = 1,
             mode: str = "layered") -> Plan:
        """Equal batches and shares, as plain FSDP would run: the default before anything is measured."""
        if world_size < 1:
            raise PlanningError(f"world size must be >= 1, got {world_size}")
        if global_batch_size < world_size * num_micro_batches:
            raise PlanningError(
                f"global batch {global_batch_size} is too small for {world_size} ranks x "
                f"{num_micro_batches} micro-batches; raise the batch size to at least {world_size * num_micro_batches}"
            )
        q, rem = divmod(global_batch_size, world_size)
        ranks = []
        for rank in range(world_size):
            b = q + (1 if rank < rem else 0)
            ranks.append(RankPlan(rank, "unprofiled", b, num_micro_batches, -(-b // num_micro_batches), 1 / world_size))
        return cls(global_batch_size, mode, tuple(ranks), strategy="even")


def validate_plan(plan: Plan) -> None:
    """Structural checks every plan must pass, whoever made it."""
    if plan.mode not in PLAN_MODES:
        raise PlanningError(f"plan mode must be one of {PLAN_MODES}, got {plan.mode!r}")
    if not plan.ranks:
        raise PlanningError("a plan needs at least one rank")
    if [r.rank for r in plan.ranks] != list(range(len(plan.ranks))):
        raise PlanningError("plan ranks must be listed as 0, 1, 2, ... in order")
    total = sum(r.batch_size for r in plan.ranks)
    if total != plan.global_batch_size:
        raise PlanningError(f"plan batch sizes sum to {total}, not the global batch {plan.global_batch_size}")
    for r in plan.ranks:
        if r.batch_size < 0 or r.num_micro_batches < 1 or r.state_share < 0:
            raise PlanningError(f"rank {r.rank}: batch_size >= 0, num_micro_batches >= 1 and state_share >= 0 required")
        if r.batch_size and r.num_micro_batches > r.batch_size:
            raise PlanningError(f"rank {r.rank}: {r.num_micro_batches} micro-batches for only {r.batch_size} samples")
        expected = split_sizes(r.batch_size, r.num_micro_batches)[0] if r.batch_size else 0
        if r.micro_batch_size != expected:
            raise PlanningError(
                f"rank {r.rank}: micro_batch_size {r.micro_batch_size} does not match "
                f"ceil({r.batch_size} / {r.num_micro_batches}) = {expected}"
            )
    if abs(sum(r.state_share for r in plan.ranks) - 1.0) > 1e-6:
        raise PlanningError(f"plan state shares sum to {sum(plan.state_shares):.6f}, not 1")
    if plan.mode == "uniform":
        if len({r.num_micro_batches for r in plan.ranks}) > 1:
            raise PlanningError("a uniform plan must give every rank the same number of micro-batches")
        if any(r.batch_size == 0 for r in plan.ranks):
            raise PlanningError("a uniform plan must give every rank samples (b_i = 0 needs the layered mode)")
