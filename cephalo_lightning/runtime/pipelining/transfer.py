"""Point-to-point transfers between consecutive stages: hidden states forward, their gradients back.

    forward   stage s  --hidden of micro-batch k  (tag 2k)-->      stage s + 1
    backward  stage s  <--gradient of that hidden (tag 2k + 1)--   stage s + 1

A tensor goes as a header (its dtype and shape, 10 int64s) and then its data, so the receiver needs
to know nothing in advance (micro-batches differ in size, padded batches in length). Sends do not
wait (``isend``; :meth:`Transfers.flush` waits for them once the step's work is done); receives do.
Gloo carries CPU tensors, NCCL the device's.

[Note: emulated links] With ``links`` (:class:`~cephalo_lightning.runtime.collectives.Links`), a
tensor sent at ``t0`` is not handed to the receiver before ``t0 + links.seconds(sender, {receiver:
bytes})``: the header carries that arrival time (monotonic clock, one host) and the receiver sleeps
until it. The sender does not wait, as a send over a real link overlaps the sender's compute.

[Note: every transfer is logged] Each send and receive is recorded (:class:`Transfer`: which way, the
peer, forward or backward, the micro-batch, the shape), so a test can match every send with its
receive and see that no micro-batch was lost or sent twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cephalo_lightning.runtime.collectives import Links
from cephalo_lightning.runtime.pipelining.schedule import Pass

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_DIMS = 8
_HEADER = 3 + _DIMS  # dtype, ndim, up to 8 dimensions, arrival time (microseconds)


@dataclass(frozen=True)
class Transfer:
    sent: bool  # True: this rank sent it; False: received
    peer: int
    kind: Pass  # FORWARD: a hidden state; BACKWARD: its gradient
    micro_batch: int
    shape: tuple[int, ...]


def _tag(kind: Pass, micro_batch: int) -> int:
    return 2 * micro_batch + (kind is Pass.BACKWARD)


class Transfers:
    """This rank's sends and receives for one pipeline, logged ([Note: every transfer is logged])."""

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None, links: Links | None = None) -> None:
        self.device = device
        self.group = group
        self.links = links
        self.rank = dist.get_rank()
        self.log: list[Transfer] = []
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, peer: int, kind: Pass, micro_batch: int) -> None:
        if tensor.dtype not in _DTYPES or tensor.dim() > _DIMS:
            raise TypeError(f"a stage sends floating tensors of at most {_DIMS} dimensions, got {tensor.dtype} "
                            f"of shape {tuple(tensor.shape)}: make the layer return its hidden state")
        data = tensor.detach().contiguous()
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[0], header[1] = _DTYPES.index(data.dtype), data.dim()
        header[2:2 + data.dim()] = torch.tensor(data.shape, dtype=torch.int64)
        if self.links is not None:
            delay = self.links.seconds(self.rank, {peer: data.numel() * data.element_size()})
            header[-1] = int((time.monotonic() + delay) * 1e6)
        tag = _tag(kind, micro_batch)
        for t in (header, data):
            self._pending.append((dist.isend(t, peer, group=self.group, tag=tag), t))
        self.log.append(Transfer(True, peer, kind, micro_batch, tuple(data.shape)))

    def recv(self, peer: int, kind: Pass, micro_batch: int) -> torch.Tensor:
        tag = _tag(kind, micro_batch)
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, peer, group=self.group, tag=tag)
        code, ndim, *dims, arrival = header.tolist()
        shape = tuple(dims[:ndim])
        data = torch.empty(shape, dtype=_DTYPES[code], device=self.device)
        dist.recv(data, peer, group=self.group, tag=tag)
        if arrival:
            time.sleep(max(0.0, arrival / 1e6 - time.monotonic()))
        self.log.append(Transfer(False, peer, kind, micro_batch, shape))
        return data

    def flush(self) -> None:
        """Wait for every send in flight (the receivers have them; their buffers may go)."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []
