"""What identifies the frozen base a trainable-only checkpoint was trained over: where it was read
from, and a fingerprint of its tensors that no plan, world size or grouping changes.

    sum(t) = sum over the 32-bit words w_k of tensor t (k from its first word) of
             (w_k mod P) x ((k mod P) x A + B mod P)                         mod P,   P = 2**31 - 1
    fingerprint = the first 16 hex digits of the SHA-256 of json.dumps([[name, shape, dtype, sum(t)], ...])
                  over the frozen parameters in name order (dtype: the master's, e.g. "float32"; a
                  frozen parameter stored in bf16 is summed as its values in the master dtype)

A checkpoint saved with ``CephaloStrategy(checkpoint_frozen=False)`` holds the trainable
parameters, their optimizer state and the loops, and this record (``cephalo.json``'s
``frozen_base``); a resume reads the frozen parameters from ``pretrained=`` again and is refused
when their fingerprint is not the recorded one, naming both bases.

[Note: a fingerprint any layout gives] Each rank sums over the words of its own pieces of the
frozen parameters (in the master dtype, whose elements are whole 32-bit words), weighted by each
word's position in the whole parameter; sums modulo ``P`` add up in any order, so the ranks' parts
(one replica's: the shard groups hold bitwise the same tensors) give the same ``sum(t)`` however the
parameter is cut. It is a check against resuming on the wrong weights (a changed word moves
``sum(t)`` unless the change is a multiple of ``P`` in weighted sum: about one chance in 2**31 per
tensor), not a cryptographic hash. Computing it reads each rank's frozen pieces once, on their device.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from cephalo_lightning.runtime.checkpoint.format import CheckpointError
from cephalo_lightning.runtime.distributed import gather_objects
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

P = 2**31 - 1
A, B = 48271, 11  # the weight of word k: (k x A + B) mod P (A: the minimal standard generator's multiplier)
CHUNK = 1 << 20  # words summed at once (each product < 2**62; a chunk's sum < 2**51)
INFO_KEY = "frozen_base"  # in cephalo.json


@dataclass(frozen=True)
class FrozenBase:
    """The frozen parameters a run holds: read from ``source``, ``tensors`` of them, ``numel`` elements."""

    source: str
    fingerprint: str
    tensors: int
    numel: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FrozenBase:
        return cls(str(data["source"]), str(data["fingerprint"]), int(data["tensors"]), int(data["numel"]))


def identify_frozen(sharded: ShardedModel, source: str | Path) -> FrozenBase:
    """Collective over the model's process group: the fingerprint of its frozen parameters."""
    sums: dict[str, int] = {}
    described: dict[str, tuple[list[int], str]] = {}
    for unit in sharded.units:
        for index, (span, piece, trainable) in enumerate(zip(unit.spans, unit.local_values(), unit.requires_grad)):
            if trainable:
                continue
            described[span.name] = (list(span.shape), str(unit.master_dtype).removeprefix("torch."))
            if sharded.group_index == 0:  # one replica's pieces, as values in the master dtype whatever stores them
                values = piece.detach().to(unit.master_dtype)
                start = unit.local_range(index)[0] * values.element_size() // 4
                sums[span.name] = _weighted_sum(values, start)
    total: dict[str, int] = {}
    for part in gather_objects(sums, sharded.world_group):
        for name, value in part.items():
            total[name] = (total.get(name, 0) + value) % P
    rows = [[name, *described[name], total.get(name, 0)] for name in sorted(described)]
    fingerprint = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]
    numel = sum(math.prod(shape) for shape, _ in described.values())
    return FrozenBase(str(source), fingerprint, len(rows), numel)


def _weighted_sum(piece: torch.Tensor, first_word: int) -> int:
    """This piece's part of ``sum(t)``: its words from word ``first_word`` of the parameter on."""
    flat = piece.detach().reshape(-1)
    if flat.element_size() % 4:
        raise CheckpointError(f"a frozen parameter's master dtype {flat.dtype} is not made of 32-bit words")
    words = flat.view(torch.int32)
    total = 0
    for lo in range(0, words.numel(), CHUNK):
        w = (words[lo : lo + CHUNK].to(torch.int64) & 0xFFFFFFFF) % P
        k = torch.arange(first_word + lo, first_word + lo + w.numel(), dtype=torch.int64, device=w.device) % P
        total = (total + int(((w * ((k * A + B) % P)) % P).sum())) % P
    return total


def check_same_base(path: str | Path, saved: dict[str, Any], frozen: Callable[[], FrozenBase | None]) -> None:
    """Collective: refuse to resume a trainable-only checkpoint over frozen parameters other than
    those it was trained over (``frozen()``: this run's, None when it read no ``pretrained=``)."""
    recorded = FrozenBase.from_dict(saved)
    if recorded.tensors == 0:
        return
    current = frozen()
    if current is None:
        raise CheckpointError(
            f"checkpoint {path} holds the trainable parameters only (checkpoint_frozen=False); its {recorded.tensors} "
            f"frozen parameters come from pretrained={recorded.source!r}, which this run does not read: give "
            f"CephaloStrategy(pretrained={recorded.source!r})")
    if current.fingerprint != recorded.fingerprint:
        raise CheckpointError(
            f"refusing to resume from {path}: it holds the trainable parameters only, trained over the frozen base "
            f"{recorded.source} ({recorded.tensors} tensors, fingerprint {recorded.fingerprint}), but this run's "
            f"frozen parameters, read from {current.source} ({current.tensors} tensors), have fingerprint "
            f"{current.fingerprint}: resume with pretrained={recorded.source!r}, or from a checkpoint saved with "
            "checkpoint_frozen=True")


def refuse_without_base(path: str | Path, info: dict[str, Any], what: str) -> None:
    """Refuse ``what`` (a whole model out of the checkpoint) where the checkpoint lacks its frozen base."""
    saved = info.get(INFO_KEY)
    if saved is None or not saved.get("tensors"):
        return
    recorded = FrozenBase.from_dict(saved)
    raise CheckpointError(
        f"cannot {what} from {path}: it holds the trainable parameters only (checkpoint_frozen=False); its "
        f"{recorded.tensors} frozen parameters are in {recorded.source}. Resume it with "
        f"CephaloStrategy(pretrained={recorded.source!r}) and save with checkpoint_frozen=True (the default), or "
        "use the adapters as they are (a peft model's save_pretrained after the fit)")
