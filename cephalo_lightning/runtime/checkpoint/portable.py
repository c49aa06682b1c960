"""A consolidated checkpoint any Lightning strategy resumes from: the sampler's position set aside.

Lightning saves the position of every stateful training loader under
``loops.fit_loop.state_dict.combined_loader`` and, on resume, refuses a checkpoint whose count of
such states differs from the loaders it has. Cephalo's loader is stateful (its position is the
truth, see :mod:`cephalo_lightning.runtime.sampler`); a user's plain ``DataLoader`` under another
strategy is not. So a consolidated file keeps the position under ``cephalo.sampler_states``, where
only Cephalo reads it back (:func:`restore_sampler_states`), and a plain ``Trainer`` resumes with
the weights, the optimizer state, the step and epoch counters, schedulers and callbacks, on its own
sample order.
"""

from __future__ import annotations

from typing import Any

SAMPLER_STATES_KEY = "sampler_states"


def _fit_loop_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict")
    return state if isinstance(state, dict) else None


def set_aside_sampler_states(checkpoint: dict[str, Any]) -> str | None:
    """Move the training loaders' saved positions from Lightning's loops to ``checkpoint["cephalo"]``;
    returns a line saying what another strategy resumes from, or None when there was none."""
    loop = _fit_loop_state(checkpoint)
    states = loop.pop("combined_loader", None) if loop is not None else None
    if not states:
        return None
    checkpoint.setdefault("cephalo", {})[SAMPLER_STATES_KEY] = states
    first = states[0] if isinstance(states[0], dict) else {}
    where = ""
    if {"epoch", "consumed", "global_batch_size", "num_samples"} <= set(first):
        per_epoch = int(first["num_samples"]) // max(1, int(first["global_batch_size"]))
        where = f" (data epoch {first['epoch']}, {first['consumed']} of its {per_epoch} steps taken)"
    return ("Cephalo: the sampler's position" + where + " is kept under checkpoint['cephalo']['sampler_states'], "
            "which only CephaloStrategy reads back. Another strategy (Trainer(strategy='auto'), DDP, FSDP) resumes "
            "this file with the weights, optimizer state, step and epoch counters, LR schedulers and callbacks, but "
            "on its own sampler's order: an unshuffled DataLoader continues on the same global batches from an epoch "
            "boundary; mid-epoch, Lightning restarts that epoch's data from its first batch, and a shuffled one "
            "draws its own permutation (docs/checkpoints.md, 'Moving a run off Cephalo').")


def restore_sampler_states(checkpoint: dict[str, Any]) -> None:
    """The inverse of :func:`set_aside_sampler_states`, for a Cephalo fit resuming from the file."""
    states = checkpoint.get("cephalo", {}).get(SAMPLER_STATES_KEY) if isinstance(checkpoint.get("cephalo"), dict) else None
    loop = _fit_loop_state(checkpoint)
    if states and loop is not None and "combined_loader" not in loop:
        loop["combined_loader"] = states
