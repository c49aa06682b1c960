"""The first step's check of a discovered block sequence (:mod:`cephalo_lightning.models.discovery`).

On the first micro-batch of each rank, collectively: an ordinary forward (the user's
``training_step``, every unit gathered as a plain forward gathers it) with hooks on the blocks
shows whether they form a sequence; then the layered pass (the schedule's forward) computes the
loss of the same micro-batch, which must equal the ordinary one to round-off. Every rank learns every rank's
verdict, so all keep the layered mode or all fall back to the uniform one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning.lightning._private import LoggedValue, captured_logs, logged_values, logging_as
from cephalo_lightning.lightning.steps.step_output import loss_or_refusal
from cephalo_lightning.models.discovery import routed_model, router_aux_reason
from cephalo_lightning.runtime.distributed import Group, gather_objects
from cephalo_lightning.runtime.layered import Layer, LayeredSchedule

# the layered pass runs the same operations as the ordinary forward, in the same order: its loss
# differs by round-off only; a block output used elsewhere changes it by far more
ROUND_OFF = {4: 1e-5, 8: 1e-10}  # relative, by the parameters' element size; 16-bit: 1e-2


class _Guarded:
    """The layered pass's calls, each failure kept instead of raised: the later calls pass their input
    through, so every rank still gathers and frees every layer (the collectives stay aligned)."""

    def __init__(self) -> None:
        self.failure = ""

    def _failed(self, error: Exception) -> None:
        if not self.failure:
            self.failure = f"the layered pass failed on the first micro-batch ({type(error).__name__}: {error})"

    def prepare(self, prepare: Callable[[Any], tuple[torch.Tensor, Any]]) -> Callable[[Any], tuple[torch.Tensor, Any]]:
        def call(micro_batch: Any) -> tuple[torch.Tensor, Any]:
            try:
                return prepare(micro_batch)
            except Exception as error:  # noqa: BLE001 - any failure of the layered pass: fall back
                self._failed(error)
                return torch.zeros(()), None
        return call

    def layer(self, layer: Layer) -> Layer:
        def call(hidden: torch.Tensor, side: Any) -> torch.Tensor:
            if self.failure:
                return hidden
            try:
                return layer(hidden, side)
            except Exception as error:  # noqa: BLE001 - any failure of the layered pass: fall back
                self._failed(error)
                return hidden
        return Layer(layer.modules, call, layer.name)


def _layered_loss(steps: Any, micro_batch: Any, compute: bool) -> tuple[float, str]:
    """The layered pass's loss of ``micro_batch``, run by the schedule's forward, or why it failed."""
    model, guarded = steps.model, _Guarded()
    schedule = LayeredSchedule(steps.schedule.sharded, [guarded.layer(layer) for layer in model.layers], offload=False)
    parts = [micro_batch] if compute else []

    def loss(k: int, out: torch.Tensor, side: Any) -> torch.Tensor:
        return torch.zeros(()) if guarded.failure else model.loss(out, micro_batch, side)

    value = schedule.evaluate(parts, guarded.prepare(model.prepare), loss, [1.0] * len(parts))
    if guarded.failure or not compute:
        return math.nan, guarded.failure
    return float(value), ""


def _first(verdicts: list[str]) -> str:
    return next((f"{v} (rank {r})" for r, v in enumerate(verdicts) if v), "")


def discovered_check(steps: Any, micro_batch: Any, has_samples: bool, batch_idx: int) -> str:
    """Collective: why the discovered sequence does not hold on some rank (the first such rank's
    reason), or ''. A rank without samples this step takes the structure another rank saw."""
    sharded, discovery = steps.schedule.sharded, steps.model.discovery
    group = sharded.world_group
    routed = routed_model(steps.module)  # turned on after setup: the layered loss pass cannot reproduce it
    if routed is not None:
        return router_aux_reason(routed)
    dtype = sharded.units[-1].compute_dtype
    tolerance = ROUND_OFF.get(torch.empty((), dtype=dtype).element_size(), 1e-2)
    structure, why = None, ""
    with user_code(steps.module):  # the check's own self.log calls are dropped
        sharded.gather_root()  # every rank runs the forward: it gathers the units as a plain forward does
        try:
            with discovery.observe() as seen, torch.enable_grad():
                output = steps.module.training_step(micro_batch, batch_idx)
        finally:
            sharded.free_all()
        ordinary, refusal = loss_or_refusal(output)  # every rank learns a refusal at the gather below
        if has_samples and not refusal:  # an empty batch shows nothing reliable
            structure, why = seen.structure()
        seen_by_all = gather_objects((why, structure, refusal), group)
        refused = _first([r for _, _, r in seen_by_all])
        if refused:
            raise ConfigurationError(refused)
        why = _first([w for w, _, _ in seen_by_all])
        if why:
            return why
        discovery.structure = structure or next((s for _, s, _ in seen_by_all if s is not None), None)
        layered, why = _layered_loss(steps, micro_batch, compute=has_samples)
    if not why and has_samples and not math.isclose(layered, ordinary, rel_tol=tolerance, abs_tol=tolerance * 1e-3):
        why = (f"the layered pass gives the loss {layered:.9g} where the model's forward gives {ordinary:.9g} on the "
               "same micro-batch (a block's output is used outside the block sequence, or the loss depends on "
               "every block's internals)")
    return _first(gather_objects(why, group))

@contextlib.contextmanager
def user_code(module: pl.LightningModule) -> Iterator[None]:
    """The user's ``training_step`` run by a discovered model's layers: its ``self.log`` calls land
    in a collection of their own (dropped unless :class:`LossPassLogs` keeps them)."""
    with logging_as(module, "training_step"), captured_logs(module.trainer):
        yield


class LossPassLogs:
    """What the user's ``training_step`` logs in the forward's loss pass of a discovered model (once
    per micro-batch, as the uniform mode runs it), to be logged once per step with the weighted
    global value. Tensor values with a mean or sum reduction; their names are agreed between the
    ranks on the first step (a rank may train no micro-batch), and a name first logged later is
    not relayed."""

    def __init__(self, module: pl.LightningModule) -> None:
        self.module = module
        self.recording = False
        self.logged: list[list[LoggedValue]] = []
        self.specs: list[LoggedValue] | None = None

    def wrap(self, layers: Sequence[Layer]) -> tuple[Layer, ...]:
        last = layers[-1]

        def call(hidden: torch.Tensor, side: Any) -> torch.Tensor:
            with captured_logs(self.module.trainer) as capture:
                out = last(hidden, side)
            if self.recording:
                self.logged.append(logged_values(capture))
            return out

        return (*layers[:-1], Layer(last.modules, call, last.name))

    @contextlib.contextmanager
    def recorded(self) -> Iterator[None]:
        self.logged, self.recording = [], True
        try:
            yield
        finally:
            self.recording = False

    def sums(self, weights: Sequence[float], group: Group) -> tuple[list[LoggedValue], list[torch.Tensor]]:
        """The agreed names and, per name, sum_k w_k v_k (mean) or sum_k v_k (sum) over this rank's micro-batches."""
        relayed = [v for values in self.logged for v in values
                   if torch.is_tensor(v.value) and v.reduction in ("mean", "sum")]
        if self.specs is None:
            mine = list({v.name: dataclasses.replace(v, value=None) for v in relayed}.values())
            agreed: dict[str, LoggedValue] = {}
            for specs in gather_objects(mine, group):
                for spec in specs:
                    agreed.setdefault(spec.name, spec)
            self.specs = list(agreed.values())
        sums = []
        for spec in self.specs:
            total = torch.zeros((), dtype=torch.float64)
            for weight, values in zip(weights, self.logged):
                for v in values:
                    if v.name == spec.name and torch.is_tensor(v.value) and (weight or spec.reduction == "sum"):
                        total = total + (weight if spec.reduction == "mean" else 1.0) * v.value.detach().double().cpu()
            sums.append(total)
        return self.specs, sums
