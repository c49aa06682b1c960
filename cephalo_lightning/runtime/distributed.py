"""The one home of the process-group helpers every layer uses (objects, flags, barriers).

Each helper takes the process group it works over (``None``: the default, world group) and is the
identity in a single process, so a caller never branches on "is this distributed?" itself. Pass
the group the model spans (``ShardedModel.world_group``, every replica's ranks; ``comm.group`` is
only this rank's shard group): a helper that silently used the default group while the model lives
on a subgroup would mix ranks that do not share the model.

Tensor collectives of the sharded state (all-gather, reduce-scatter, their CUDA streams and
padding) live in :mod:`.collectives`; this module is for the small agreements around them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None

__all__ = ["Group", "all_reduce_", "barrier", "broadcast_object", "gather_objects", "is_distributed", "rank_and_size",
           "start_all_reduce_"]


def is_distributed(group: Group = None) -> bool:
    """True when a process group is up and ``group`` has more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank_and_size(group: Group = None) -> tuple[int, int]:
    """This process's rank within ``group`` and the group's size; ``(0, 1)`` in a single process."""
    return (dist.get_rank(group), dist.get_world_size(group)) if is_distributed(group) else (0, 1)


def gather_objects(obj: Any, group: Group = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), in group-rank order, on every rank."""
    if not is_distributed(group):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, group: Group = None) -> Any:
    """The group's first rank's ``obj`` on every rank of ``group``."""
    if not is_distributed(group):
        return obj
    box = [obj]
    source = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=source, group=group)
    return box[0]


def barrier(group: Group = None) -> None:
    if is_distributed(group):
        dist.barrier(group)


def start_all_reduce_(tensor: torch.Tensor, group: Group = None) -> dist.Work | None:
    """Begin summing ``tensor`` in place over ``group``; it holds the sum once the returned work
    is waited for (None in a single process: nothing to wait for)."""
    return dist.all_reduce(tensor, group=group, async_op=True) if is_distributed(group) else None


def all_reduce_(tensor: torch.Tensor, op: str = "sum", group: Group = None) -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group`` (``"sum"`` or ``"max"``) and return it."""
    if is_distributed(group):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return tensor
