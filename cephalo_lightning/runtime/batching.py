"""Cutting a batch along its first dimension: micro-batches of a rank's local batch."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to every tensor of a (nested) batch; the structure and other leaves stay."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: map_tensors(v, fn) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a (nested) structure of lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from tensors_in(item)


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of every tensor in a (nested) batch; other leaves pass through."""
    return map_tensors(batch, lambda t: t[start:stop])


def index_batch(batch: Any, index: torch.Tensor) -> Any:
    """Rows ``index`` of every tensor in a (nested) batch (rows may repeat)."""
    return map_tensors(batch, lambda t: t[index.to(t.device)])


def leading_size(batch: Any) -> int | None:
    """The first dimension of the first tensor found in the batch."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        size = leading_size(value)
        if size is not None:
            return size
    return None


def micro_batches(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """Consecutive micro-batches of the given sizes (which must cover the batch exactly)."""
    found = leading_size(batch)
    if found is not None and found != sum(sizes):
        raise ValueError(f"the batch has {found} samples but the plan gives this rank {sum(sizes)}")
    out, start = [], 0
    for size in sizes:
        out.append(slice_batch(batch, start, start + size))
        start += size
    return out
