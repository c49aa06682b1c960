"""What the callback tells the loggers: the plan, per-rank predicted vs measured, the summary.

Every logger gets scalars. A ``WandbLogger`` (offline works, no account needed) also gets the plan
and the profile as tables and bar charts of per-rank batch, state share and memory. wandb stays an
optional import: nothing here imports it unless such a logger is in use. Call on rank 0 only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning.pytorch.loggers import Logger

from cephalo_lightning.planner import Cluster, Plan

PLAN_COLUMNS = ["rank", "device", "batch", "micro_batches", "micro_batch_size", "state_share",
                "predicted_step_s", "predicted_memory_gb", "memory_capacity_gb", "source"]


def _wandb_loggers(loggers: Sequence[Logger]) -> list[Any]:
    try:
        from lightning.pytorch.loggers import WandbLogger
    except ImportError:  # pragma: no cover - lightning always ships it; wandb itself may be absent
        return []
    return [lg for lg in loggers if isinstance(lg, WandbLogger)]


def plan_rows(plan: Plan) -> list[list[Any]]:
    return [[r.rank, r.device, r.batch_size, r.num_micro_batches, r.micro_batch_size, round(r.state_share, 6),
             r.predicted_step_s, r.predicted_memory_gb, r.memory_capacity_gb, r.source] for r in plan.ranks]


def plan_scalars(plan: Plan, prefix: str = "plan") -> dict[str, float]:
    out: dict[str, float] = {}
    for key in ("predicted_step_s", "predicted_samples_per_s", "upper_bound_samples_per_s"):
        value = getattr(plan, key)
        if value is not None:
            out[f"cephalo/{prefix}/{key}"] = float(value)
    for name, baseline in plan.baselines.items():
        if baseline.predicted_samples_per_s is not None:
            out[f"cephalo/{prefix}/{name}_predicted_samples_per_s"] = float(baseline.predicted_samples_per_s)
    for r in plan.ranks:
        out[f"cephalo/{prefix}/rank{r.rank}/batch_size"] = float(r.batch_size)
        out[f"cephalo/{prefix}/rank{r.rank}/num_micro_batches"] = float(r.num_micro_batches)
        out[f"cephalo/{prefix}/rank{r.rank}/state_share"] = float(r.state_share)
    return out


def log_plan(loggers: Sequence[Logger], plan: Plan, cluster: Cluster | None, prefix: str = "plan") -> None:
    """The plan as scalars everywhere, and as tables and bar charts on W&B."""
    scalars = plan_scalars(plan, prefix)
    for logger in loggers:
        logger.log_metrics(scalars, step=0)
    for logger in _wandb_loggers(loggers):
        import wandb

        table = wandb.Table(columns=PLAN_COLUMNS, data=plan_rows(plan))
        charts = {f"cephalo/{prefix}/table": table}
        for column, title in (("batch", "samples per step"), ("state_share", "share of the training state"),
                              ("predicted_memory_gb", "predicted memory (GiB)")):
            charts[f"cephalo/{prefix}/{column}_chart"] = wandb.plot.bar(table, "rank", column, title=f"{title} per rank")
        if cluster is not None:
            charts[f"cephalo/{prefix}/profile"] = wandb.Table(
                columns=["rank", "device", "source", "memory_gb", "layer_fwd_ms", "layer_bwd_ms", "compute_memory_gb"],
                data=[[i, d.name, d.source, d.memory_gb, list(d.layer_fwd_ms), list(d.layer_bwd_ms), list(d.compute_memory_gb)]
                      for i, d in enumerate(cluster.devices)],
            )
        logger.experiment.log(charts)
        logger.experiment.summary.update({f"cephalo/{prefix}/json": plan.to_json()})


def rank_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """One watch window as flat scalars: per rank predicted vs measured, and the global rate."""
    out = {"cephalo/step_s": record["step_s"], "cephalo/samples_per_s": record["samples_per_s"]}
    if record.get("predicted_samples_per_s"):
        out["cephalo/predicted_samples_per_s"] = record["predicted_samples_per_s"]
    for row in record["ranks"]:
        for key in ("measured_busy_s", "predicted_busy_s", "peak_memory_gb", "predicted_memory_gb"):
            if row.get(key) is not None:
                out[f"cephalo/rank{row['rank']}/{key}"] = float(row[key])
    return out


def log_rank_series(loggers: Sequence[Logger], record: Mapping[str, Any], throughput: Mapping[str, float], step: int) -> None:
    metrics = {**rank_metrics(record), **{f"cephalo/throughput/{k}": float(v) for k, v in throughput.items()}}
    for logger in loggers:
        logger.log_metrics(metrics, step=step)


def log_summary(loggers: Sequence[Logger], summary: Mapping[str, Any]) -> None:
    scalars = {f"cephalo/summary/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for logger in loggers:
        logger.log_metrics(scalars)
    for logger in _wandb_loggers(loggers):
        logger.experiment.summary.update(scalars)
