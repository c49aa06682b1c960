"""What the user's ``training_step`` must return under automatic optimization: the loss.

Lightning's contract is a one-element tensor, or a dict holding one under ``'loss'``; ``None``
means "skip this batch", which Lightning documents as unsupported on several devices and which
Cephalo cannot honour (every rank runs every micro-batch's backward and its collectives together).
:func:`user_loss` takes the loss out of such an output or refuses, naming what was returned and
what to return instead, before anything uses it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cephalo_lightning._common.errors import ConfigurationError

RETURN_THE_LOSS = (
    "under automatic optimization it must return the loss as a one-element tensor (return loss), or a dict with "
    "the loss tensor under 'loss' (return {'loss': loss, ...})"
)


def check_training_step_output(output: Any) -> None:
    """Refuse anything but the loss (see the module docstring), else the step fails deep inside."""
    if output is None:
        raise ConfigurationError(
            "training_step returned None, which Lightning takes as 'skip this batch'; Lightning documents skipping "
            "a batch as unsupported on several devices, and under Cephalo every rank runs every micro-batch's "
            f"forward and backward together, so no rank can skip. Return the loss: {RETURN_THE_LOSS}. The strategy "
            "skips a step whose loss or gradient is not finite on every rank by itself "
            "(CephaloStrategy(max_nonfinite_skips=...)); to leave samples out, filter them in the dataset"
        )
    loss = output.get("loss") if isinstance(output, dict) else output
    if torch.is_tensor(loss) and loss.numel() == 1:
        return
    if isinstance(output, dict):
        got = (f"a dict without a 'loss' key (keys: {sorted(map(str, output))})" if "loss" not in output
               else f"a dict whose 'loss' is {_described(loss)}")
    else:
        got = _described(output)
    raise ConfigurationError(
        f"training_step returned {got}; {RETURN_THE_LOSS}. Return the tensor itself, not loss.item() or float(loss): "
        "the backward pass needs its graph"
    )


def user_loss(output: Any) -> torch.Tensor:
    """The loss tensor of a ``training_step`` output, checked first (:func:`check_training_step_output`)."""
    check_training_step_output(output)
    return output["loss"] if isinstance(output, dict) else output


def loss_or_refusal(output: Any) -> tuple[float, str]:
    """The loss's value, or NaN and why the output is refused (a collective check gathers the
    refusal, so that every rank refuses together)."""
    try:
        return float(user_loss(output).detach()), ""
    except ConfigurationError as err:
        return math.nan, str(err)


def _described(value: Any) -> str:
    if torch.is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)} (reduce it to one value, e.g. .mean())"
    shown = repr(value)
    return f"{shown if len(shown) <= 60 else shown[:57] + '...'} (a {type(value).__name__})"
