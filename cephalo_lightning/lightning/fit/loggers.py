"""What Cephalo tells Lightning's loggers (W&B, CSV, TensorBoard) and the log: the plan, the run's
configuration, per-rank predicted vs measured, checkpoints as W&B artifacts, the summary.

Every logger gets scalars and the run's configuration as hyperparameters (``hparams.yaml`` for
CSV / TensorBoard). A ``WandbLogger`` (offline works, no account needed) also gets the plan and
the profile as tables and bar charts, ``plan.json`` and the cluster file as run files, and, with
``log_model``, checkpoint directories as model artifacts. wandb stays an optional import: nothing
here imports it unless such a logger is in use. Call on rank 0 only.
"""

from __future__ import annotations

import dataclasses
import inspect
import shutil
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from cephalo_lightning._common.vocabulary import Planner, ProfileSource
from cephalo_lightning.lightning import _private as _lightning_private
from cephalo_lightning.planner import Cluster, Plan, save_cluster
from cephalo_lightning.planner.schema.plan import UNPROFILED

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
             r.predicted_step_s, r.predicted_memory_gb, r.memory_capacity_gb, r.source.value] for r in plan.ranks]


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
                data=[[i, d.name, d.source.value, d.memory_gb, list(d.layer_fwd_ms), list(d.layer_bwd_ms), list(d.compute_memory_gb)]
                      for i, d in enumerate(cluster.devices)],
            )
        picture = plan_picture(plan, cluster)
        if picture is not None:
            charts[f"cephalo/{prefix}/picture"] = wandb.Image(picture)
            picture.clf()
        logger.experiment.log(charts)
        logger.experiment.summary.update({f"cephalo/{prefix}/json": plan.to_json()})


def plan_picture(plan: Plan, cluster: Cluster | None) -> Any:
    """The plan's picture beside the even plan (what ``plan --plot`` draws), or None without matplotlib."""
    from cephalo_lightning.planner.picture import MissingPlotting, even_plan, plan_figure, require_matplotlib

    try:
        plt = require_matplotlib()
    except MissingPlotting:
        return None
    figure = plan_figure(plan, *(even_plan(cluster, plan) if cluster is not None else (None, "no cluster given")))
    plt.close(figure)  # wandb.Image renders it; pyplot need not keep it
    return figure


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


# ----------------------------------------------------------------------------- the log


def terminal_width(default: int = 120) -> int:
    """Columns for tables: the terminal's, else ``COLUMNS``, else ``default`` (logs and pipes)."""
    return shutil.get_terminal_size((default, 24)).columns


def _gib(value: float | None) -> str:
    return "?" if value is None else f"{value:.3g}"


# why a plan's ranks carry no prediction: the plans made at setup before anything was measured, else a given plan
UNPRICED = {
    Planner.EVEN: "not priced (an even split, made before anything was measured)",
    Planner.PROVISIONAL: "not priced (a provisional layout by memory, until the profile's plan arrives)",
}
GIVEN_UNPRICED = "not priced (a plan given as it is, without a cluster file to predict it from)"


def rank_lines(plan: Plan) -> list[str]:
    """One line per rank: device, batch and micro-batches, state share, predicted time and memory."""
    lines = []
    for r in plan.ranks:
        count = f"{r.num_micro_batches} micro-batch" + ("es" if r.num_micro_batches > 1 else "")
        sizes = "-".join(map(str, sorted(set(r.micro_batch_sizes))))
        work = f"batch {r.batch_size} in {count} of {sizes}" if r.batch_size else "no samples (stores state only)"
        emulated = ", emulated" if r.source == ProfileSource.EMULATED else ""
        bound = f", bound by {r.binding}" if r.binding is not None else ""
        if r.predicted_step_s is None and r.predicted_memory_gb is None:
            predicted = UNPRICED.get(plan.planner, GIVEN_UNPRICED)
        else:
            step = f"{r.predicted_step_s:.4g} s/step" if r.predicted_step_s is not None else "? s/step"
            memory = f"{_gib(r.predicted_memory_gb)} GiB"
            if r.memory_limit_gb is not None:
                memory += f" of {_gib(r.memory_limit_gb)} usable"
            predicted = f"predicted {step} and {memory}"
        device = "device not profiled" if r.device == UNPROFILED else r.device
        lines.append(f"Cephalo rank {r.rank}: {device}: {work}, "
                     f"state share {100 * r.state_share:.1f}%, {predicted}{emulated}{bound}")
    return lines


def log_rank_lines(plan: Plan) -> None:
    """The :func:`rank_lines` through Lightning's rank-zero logger (plain logs show them)."""
    for line in rank_lines(plan):
        rank_zero_info(line)


# ----------------------------------------------------------------------------- the run's configuration

TRAINER_FIELDS = ("num_devices", "num_nodes", "world_size", "precision", "max_epochs", "max_steps", "min_steps",
                  "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm", "val_check_interval",
                  "check_val_every_n_epoch", "limit_train_batches", "limit_val_batches", "log_every_n_steps",
                  "num_sanity_val_steps", "default_root_dir")
PLAN_RANK_FIELDS = ("device", "batch_size", "num_micro_batches", "micro_batch_size", "state_share",
                    "predicted_step_s", "predicted_memory_gb", "memory_limit_gb", "memory_capacity_gb", "source",
                    "binding", "why")


def _plain(value: Any) -> Any:
    """A value a config file and W&B can hold: dataclasses, paths, classes and dtypes as text."""
    if isinstance(value, Enum):
        return value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if dataclasses.is_dataclass(value):
        return _plain(dataclasses.asdict(value))
    return str(value)


def _class_path(obj: Any) -> str:
    return _plain(type(obj))


def init_arguments(obj: Any, skip: Sequence[str] = (), held_by: Any = None) -> dict[str, Any]:
    """The object's ``__init__`` arguments as it holds them (same-named attributes of ``held_by``,
    default the object itself), plus its class."""
    holder = obj if held_by is None else held_by
    out: dict[str, Any] = {"class_path": _class_path(obj)}
    for name, parameter in inspect.signature(type(obj).__init__).parameters.items():
        if name == "self" or name in skip or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if hasattr(holder, name):
            out[name] = _plain(getattr(holder, name))
    return out


def plan_config(plan: Plan) -> dict[str, Any]:
    """The plan with one entry per rank (``rank0``, ...), so runs can be filtered by any rank's figure."""
    return {
        **{k: _plain(getattr(plan, k)) for k in ("global_batch_size", "mode", "planner", "world_size", "emulated",
                                                 "predicted_step_s", "predicted_samples_per_s",
                                                 "upper_bound_samples_per_s", "optimality_gap")},
        "baselines": {name: b.predicted_samples_per_s if b.feasible else f"infeasible: {b.reason or 'no plan fits'}"
                      for name, b in plan.baselines.items()},
        "ranks": {f"rank{r.rank}": {k: _plain(getattr(r, k)) for k in PLAN_RANK_FIELDS} for r in plan.ranks},
    }


def cluster_config(cluster: Cluster) -> dict[str, Any]:
    """The cluster in brief: the model, the settings and every rank's device (no profile arrays)."""
    return {
        "model": _plain(cluster.model),
        "settings": _plain(cluster.settings),
        "world_size": cluster.world_size,
        "devices": {f"rank{i}": {"name": d.name, "memory_gb": d.memory_gb, "source": d.source.value,
                                 "emulate": _plain(d.emulate)} for i, d in enumerate(cluster.devices)},
    }


def run_config(trainer: pl.Trainer, plan: Plan, cluster: Cluster | None = None, callback: Any = None) -> dict[str, Any]:
    """The resolved configuration of a Cephalo run: trainer, strategy, callback, plan, cluster, emulation."""
    strategy = trainer.strategy
    config: dict[str, Any] = {
        "trainer": {
            "accelerator": _class_path(trainer.accelerator),
            **{k: _plain(getattr(trainer, k)) for k in TRAINER_FIELDS if hasattr(trainer, k)},
            "callbacks": [_class_path(c) for c in trainer.callbacks],
            "loggers": [_class_path(lg) for lg in trainer.loggers],
        },
        "strategy": init_arguments(strategy, skip=("plan", "cluster")),
        "plan": plan_config(plan),
    }
    if callback is not None:
        config["callback"] = init_arguments(callback, held_by=getattr(callback, "config", None))  # a CallbackConfig
    if cluster is not None:
        config["cluster"] = cluster_config(cluster)
    config["emulated"] = bool(plan.emulated or getattr(strategy, "emulate", None)
                              or (cluster is not None and any(d.source == ProfileSource.EMULATED for d in cluster.devices)))
    return config


def save_run_files(loggers: Sequence[Logger], plan: Plan, cluster: Cluster | None = None, suffix: str = "") -> None:
    """``plan.json`` and ``cluster.yaml`` (``plan{suffix}.json`` ...) as files of every W&B run."""
    for logger in _wandb_loggers(loggers):
        run = logger.experiment
        files = Path(run.dir)
        written = [files / f"plan{suffix}.json"]
        plan.save(written[0])
        if cluster is not None:
            written.append(files / f"cluster{suffix}.yaml")
            save_cluster(cluster, written[-1])
        for path in written:  # already in the run's directory: saved as is, uploaded now or by `wandb sync`
            run.save(str(path), base_path=str(files), policy="now")


def log_run(trainer: pl.Trainer, plan: Plan, cluster: Cluster | None = None, callback: Any = None) -> dict[str, Any]:
    """:func:`run_config` under ``cephalo`` in every logger's hyperparameters (the W&B run config,
    ``hparams.yaml``), and the plan and cluster files on W&B. Returns the configuration."""
    config = run_config(trainer, plan, cluster, callback)
    for logger in trainer.loggers:
        logger.log_hyperparams({"cephalo": config})
    save_run_files(trainer.loggers, plan, cluster)
    return config


# ----------------------------------------------------------------------------- checkpoints as W&B artifacts


def _checkpoint_directories(callback: Any, logged: Mapping[str, float]) -> list[tuple[float, str, Any]]:
    """Lightning's scan of a checkpoint callback's paths (``_scan_checkpoints``), for directories:
    last, best and top-k that are new or changed since logged, oldest first, with their scores."""
    scores: dict[str, Any] = {}
    if getattr(callback, "last_model_path", ""):
        scores[callback.last_model_path] = getattr(callback, "current_score", None)
    if getattr(callback, "best_model_path", ""):
        scores[callback.best_model_path] = getattr(callback, "best_model_score", None)
    scores.update(getattr(callback, "best_k_models", {}) or {})
    found = sorted((Path(p).stat().st_mtime, p, s) for p, s in scores.items() if p and Path(p).is_dir())
    return [c for c in found if c[1] not in logged or logged[c[1]] < c[0]]


def log_checkpoint_artifacts(trainer: pl.Trainer, final: bool = False) -> list[str]:
    """Upload checkpoint DIRECTORIES as W&B model artifacts, as ``WandbLogger(log_model=...)``
    does for checkpoint files (its own scan skips directories).

    Call on every rank after a checkpoint directory is published (``final=False``) and once after
    a successful fit (``final=True``); only rank 0 uploads. Per ``WandbLogger`` and checkpoint
    callback, like Lightning: ``log_model="all"`` (or ``True`` with ``save_top_k=-1``) uploads every
    new or rewritten checkpoint at once, ``log_model=True`` only at the final call, ``False``
    nothing. The artifact is ``model-<run id>`` (or the logger's ``checkpoint_name``), type
    ``model``, the directory under ``model.ckpt/``, aliases ``latest`` (and ``best`` for the
    callback's best path), metadata as Lightning's. Returns the uploaded paths.
    """
    if not trainer.is_global_zero:
        return []
    uploaded: list[str] = []
    for logger in _wandb_loggers(trainer.loggers):
        log_model = _lightning_private.wandb_log_model(logger)
        for callback in trainer.checkpoint_callbacks:
            every_save = log_model == "all" or (log_model is True and getattr(callback, "save_top_k", None) == -1)
            if not log_model or not (every_save or final):
                continue
            uploaded += _upload_directories(logger, callback)
    return uploaded


def _upload_directories(logger: Any, callback: Any) -> list[str]:
    import wandb

    logged = _lightning_private.wandb_logged_model_times(logger)
    settings = _lightning_private.checkpoint_callback_settings(callback)
    name = _lightning_private.wandb_checkpoint_name(logger) or f"model-{logger.experiment.id}"
    uploaded = []
    for mtime, path, score in _checkpoint_directories(callback, logged):
        metadata = {"score": score.item() if hasattr(score, "item") else score, "original_filename": Path(path).name,
                    type(callback).__name__: settings}
        artifact = wandb.Artifact(name=name, type="model", metadata=metadata)
        artifact.add_dir(path, name="model.ckpt")
        aliases = ["latest", "best"] if path == getattr(callback, "best_model_path", None) else ["latest"]
        logger.experiment.log_artifact(artifact, aliases=aliases)
        logged[path] = mtime
        uploaded.append(path)
    return uploaded
