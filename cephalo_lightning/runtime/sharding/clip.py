"""Gradient-norm clipping of a model whose gradients are every rank's disjoint shards."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from cephalo_lightning.runtime.collectives import Collectives


@torch.no_grad()
def local_grad_norm(parameters: Iterable[nn.Parameter], norm_type: float = 2.0,
                    device: torch.device | None = None) -> torch.Tensor:
    """sum |g|^p over the gradients of ``parameters`` (max |g| for ``inf``), in fp64."""
    grads = [p.grad for p in parameters if p.grad is not None and p.grad.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    if norm_type == math.inf:
        return torch.stack([g.abs().max().double() for g in grads]).max()
    return sum((g.double().abs().pow(norm_type).sum() for g in grads), torch.zeros((), dtype=torch.float64, device=grads[0].device))


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0,
                    comm: Collectives | None = None, contributes: bool = True) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters that are every rank's disjoint shards.

    Each element of the model is owned by exactly one rank, so the global norm is the all-reduce
    (sum, or max for ``inf``) of every rank's local figure over ``comm``'s group: pass the model's
    (``ShardedModel.comm``, as :meth:`ShardedModel.clip_grad_norm_` does); ``None`` reduces over the
    default (world) group. With several replicas (shard groups) ``comm`` spans all of them and only
    one replica's ranks contribute (``contributes``; the others add zeros, or take part in the max
    with zeros): every replica then scales by the same norm, to the bit.
    """
    params = [p for p in parameters]
    comm = comm if comm is not None else Collectives()
    # a rank whose pieces are all empty (share 0) still reduces a tensor on the collective's device
    local = local_grad_norm(params, norm_type, params[0].device if params else None).clone()
    if not contributes:
        local.zero_()
    if norm_type == math.inf:
        total = comm.all_reduce_max(local)
    else:
        total = comm.all_reduce_sum(local).pow(1.0 / norm_type)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
    return total
