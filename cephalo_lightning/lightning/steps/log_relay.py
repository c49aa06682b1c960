"""What the user logs per micro-batch, logged once per step as single-process training on the
global batch would log it: per name ``sum_k w_k v_k`` over every rank's micro-batches (mean) or
``sum_k v_k`` (sum), all-reduced with the step's loss (:mod:`.step_sync`); max/min values and
metrics objects as the last micro-batch logged them.

The relayed values are global on every rank already: they are logged with the
:class:`AlreadyGlobal` group, which Lightning takes as synchronised and the strategy's ``reduce``
passes through without a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch

from cephalo_lightning.lightning._private import LoggedValue, logging_as


@dataclass(frozen=True)
class AlreadyGlobal:
    """The ``sync_dist_group`` of values every rank already holds in their global form (the step's
    all-reduce made them): Lightning treats them as synchronised (no "use sync_dist=True" warning at
    the epoch's end) and the strategy's ``reduce`` passes them through unchanged (no collective).
    Every rank logs the same value with the same batch size, so the epoch's mean is the global one."""


ALREADY_GLOBAL = AlreadyGlobal()


def log_scalar(module: pl.LightningModule, name: str, value: float, batch_size: int, hook: str = "training_step",
               **options: Any) -> None:
    """Log an already-global value from inside the strategy's ``hook`` (synchronised already, see
    :class:`AlreadyGlobal`); to the loggers unless ``logger`` says otherwise, when there are any (else
    Lightning warns of none)."""
    options.setdefault("logger", module.trainer.logger is not None)
    with logging_as(module, hook):
        module.log(name, torch.tensor(value, dtype=torch.float32), sync_dist=True, sync_dist_group=ALREADY_GLOBAL,
                   batch_size=batch_size, **options)


def relayed(names: list[LoggedValue], values: list[torch.Tensor]) -> list[tuple[str, torch.Tensor, dict[str, Any]]]:
    """The user's values as ``(name, value, log options)``: their weighted global combination (already all-reduced)."""
    return [(spec.name, value, {"prog_bar": spec.prog_bar, "logger": spec.logger, "on_step": spec.on_step,
                                "on_epoch": spec.on_epoch, "reduce_fx": spec.reduction})
            for spec, value in zip(names, values)]


def log_all(module: pl.LightningModule, entries: list[tuple[str, Any, dict[str, Any]]], batch_size: int) -> None:
    """Log every ``(name, value, options)`` as an already-global value (:func:`log_scalar`)."""
    for name, value, options in entries:
        log_scalar(module, name, float(value), batch_size, **options)


def relog(module: pl.LightningModule, names: list[LoggedValue], values: list[torch.Tensor], batch_size: int) -> None:
    """Log the user's values with their weighted global combination (already all-reduced)."""
    log_all(module, relayed(names, values), batch_size)


def relog_last(module: pl.LightningModule, logged: list[tuple[float, list[LoggedValue]]], done: set[str]) -> None:
    """Log the values not relayed (names outside ``done``: metrics objects, max/min values) as the
    last micro-batch logged them."""
    last: dict[str, LoggedValue] = {}
    for _, values in logged:
        for v in values:
            if v.name not in done:
                last[v.name] = v
    for v in last.values():
        with logging_as(module, "training_step"):
            kwargs = {"metric_attribute": v.metric_attribute} if not torch.is_tensor(v.value) else {}
            module.log(v.name, v.value, prog_bar=v.prog_bar, logger=v.logger, on_step=v.on_step,
                       on_epoch=v.on_epoch, sync_dist=torch.is_tensor(v.value),
                       reduce_fx=v.reduction if v.reduction != "custom" else "mean", **kwargs)


def weighted_logs(logged: list[tuple[float, list[LoggedValue]]]) -> tuple[list[LoggedValue], list[torch.Tensor]]:
    """Per logged name: sum_k w_k v_k (mean), or sum_k v_k (sum); max/min and metrics as they are."""
    first = {v.name: v for _, values in logged for v in values}
    names, sums = [], []
    for name, spec in first.items():
        if not torch.is_tensor(spec.value) or spec.reduction not in ("mean", "sum"):
            continue
        total = torch.zeros((), dtype=torch.float64)
        for weight, values in logged:
            for v in values:
                if v.name == name and (weight or spec.reduction == "sum"):
                    total = total + (weight if spec.reduction == "mean" else 1.0) * v.value.detach().double().cpu()
        names.append(spec)
        sums.append(total)
    return names, sums
