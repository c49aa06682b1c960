"""Process-group plumbing every multi-process Lightning strategy needs (ranks, launcher, collectives).

Lightning's own strategies each carry a copy of this (DDP, FSDP, ModelParallel); Cephalo's lives
here so that :mod:`.strategy` reads as what Cephalo does.

[Note: CPU threads] CPU ranks on one host share its cores, and torch's default (every core per
process) oversubscribes them: every rank slow and noisy. So when ``OMP_NUM_THREADS`` is unset,
:meth:`ProcessGroupStrategy._init_process_group` gives each CPU rank ``cores // ranks`` torch
threads (``torch.set_num_threads``, for the whole process) and says so once; set
``OMP_NUM_THREADS`` to choose otherwise. This acts on ranks started by SLURM or by hand: Lightning's own
launcher (``devices=N`` on one machine) has set ``OMP_NUM_THREADS`` to the same ``cores // ranks`` before
the process group starts, and torchrun sets 1 when it starts several ranks per node.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from cephalo_lightning.lightning._private import (
    SubprocessScriptLauncher,
    default_process_group_backend,
    distributed_is_initialized,
    init_dist_connection,
)


class ProcessGroupStrategy(ParallelStrategy):
    """A :class:`ParallelStrategy` over one torch process group (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._process_group_backend, self._timeout = process_group_backend, timeout
        self.num_nodes = 1

    def _init_process_group(self) -> None:
        """Ranks, CPU threads (see the module note), then the process group."""
        self.set_world_ranks()
        if self.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            cores, ranks = os.cpu_count() or 1, max(1, self.num_processes)
            threads = max(1, cores // ranks)
            torch.set_num_threads(threads)
            rank_zero_info(f"Cephalo: OMP_NUM_THREADS is unset; each of the {ranks} CPU rank(s) uses {threads} torch "
                           f"thread(s) ({cores} cores shared). Set OMP_NUM_THREADS to choose otherwise.")
        self._process_group_backend = self._process_group_backend or default_process_group_backend(self.root_device)
        init_dist_connection(self.cluster_environment, self._process_group_backend,
                             **({"timeout": self._timeout} if self._timeout is not None else {}))

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    @override
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)

    @override
    def barrier(self, name: str | None = None) -> None:
        if distributed_is_initialized():
            dist.barrier(device_ids=[self.root_device.index]) if dist.get_backend() == "nccl" else dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]
