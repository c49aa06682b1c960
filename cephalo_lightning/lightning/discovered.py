"""The first step's check of a discovered block sequence (:mod:`cephalo_lightning.models.discovery`).

On the first micro-batch of each rank, collectively: an ordinary forward (the user's
``training_step``, every unit gathered as a plain forward gathers it) with hooks on the blocks
shows whether they form a sequence; then the layered pass computes the loss of the same
micro-batch, which must equal the ordinary one to round-off. Every rank learns every rank's
verdict, so all keep the layered mode or all fall back to the uniform one.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cephalo_lightning.lightning._private import captured_logs
from cephalo_lightning.runtime.distributed import gather_objects

# the layered pass runs the same operations as the ordinary forward, in the same order: its loss
# differs by round-off only; a block output used elsewhere changes it by far more
ROUND_OFF = {4: 1e-5, 8: 1e-10}  # relative, by the parameters' element size; 16-bit: 1e-2


def _loss_value(output: Any) -> float:
    loss = output["loss"] if isinstance(output, dict) else output
    return float(loss.detach()) if torch.is_tensor(loss) else math.nan


def _layered_loss(steps: Any, micro_batch: Any) -> tuple[float, str]:
    """The layered pass's loss of ``micro_batch``, or why it failed; every layer is gathered and
    freed on every rank whatever happens (the collectives stay aligned)."""
    sharded, model = steps.schedule.sharded, steps.model
    x = side = None
    failure = ""
    with sharded.scheduled(), torch.no_grad():
        sharded.gather_root()
        try:
            for index, layer in enumerate(model.layers, start=1):
                sharded.gather(index, prefetch=index + 1)
                try:
                    if not failure:
                        if index == 1:
                            x, side = model.prepare(micro_batch)
                        x = layer(x, side)
                except Exception as error:  # noqa: BLE001 - any failure of the layered pass: fall back
                    failure = f"the layered pass failed on the first micro-batch ({type(error).__name__}: {error})"
                sharded.units[index].free()
        finally:
            sharded.free_all()
    return (math.nan, failure) if failure else (float(model.loss(x, micro_batch, side)), "")


def _first(verdicts: list[str]) -> str:
    return next((f"{v} (rank {r})" for r, v in enumerate(verdicts) if v), "")


def discovered_check(steps: Any, micro_batch: Any, has_samples: bool, batch_idx: int) -> str:
    """Collective: why the discovered sequence does not hold on some rank (the first such rank's
    reason), or ''."""
    sharded, discovery = steps.schedule.sharded, steps.model.discovery
    group = sharded.comm.group
    dtype = sharded.units[-1].compute_dtype
    tolerance = ROUND_OFF.get(torch.empty((), dtype=dtype).element_size(), 1e-2)
    with captured_logs(steps.module.trainer):  # the check's own self.log calls are dropped
        sharded.gather_root()
        try:
            with discovery.observe() as seen, torch.enable_grad():
                ordinary = _loss_value(steps.module.training_step(micro_batch, batch_idx))
        finally:
            sharded.free_all()
        structure, why = seen.structure()
        why = _first(gather_objects(why, group))
        if why:
            return why
        discovery.structure = structure
        layered, why = _layered_loss(steps, micro_batch)
    if not why and has_samples and not math.isclose(layered, ordinary, rel_tol=tolerance, abs_tol=tolerance * 1e-3):
        why = (f"the layered pass gives the loss {layered:.9g} where the model's forward gives {ordinary:.9g} on the "
               "same micro-batch (a block's output is used outside the block sequence, or the loss depends on "
               "every block's internals, e.g. a router's auxiliary loss)")
    return _first(gather_objects(why, group))
