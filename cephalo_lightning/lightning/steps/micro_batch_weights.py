"""Each micro-batch's share of the global mean loss: ``w_k = items_k / items(global batch)``.

Both modes cut the rank's local batch (b_i samples) into its n_i micro-batches and weight
micro-batch k's mean loss by its items over the items of the whole global batch
(:mod:`.models.protocol`: samples for per-sample means, counted with no communication; tokens for
per-token means, counted with one small all-reduce before the forward), so that the gradients
summed by the reduce-scatter equal the gradient of the mean loss over the global batch, whatever
the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cephalo_lightning.models.protocol import LossWeighting
from cephalo_lightning.runtime.batching import leading_size
from cephalo_lightning.runtime.distributed import Group, all_reduce_


def micro_batch_weights(parts: Sequence[Any], weighting: LossWeighting, global_batch: int,
                        device: torch.device, group: Group = None,
                        global_items: float | None = None) -> tuple[list[float], float]:
    """Each micro-batch's share of the global mean loss, and the global batch's items (see the
    module docstring; ``global_items``: already known, counted without the all-reduce)."""
    samples = [leading_size(p) or 0 for p in parts]
    if weighting.kind == "samples":
        return [s / global_batch for s in samples], float(global_batch)
    counts = torch.tensor([float(weighting.items(p, s)) for p, s in zip(parts, samples)] + [0.0], dtype=torch.float64)
    total = float(all_reduce_(counts.sum().to(device), group=group)) if global_items is None else global_items
    return [float(c) / total if total > 0 else 0.0 for c in counts[:-1].tolist()], total
