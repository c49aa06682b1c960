"""Gloo ranks for tests: see :mod:`cephalo_lightning.testing.local_ranks`.

The suite starts ranks a few hundred times; spawning each would import torch, Lightning and
transformers afresh (about 6 s of CPU per rank). Ranks fork from one forkserver that imported them
once instead.
"""

from __future__ import annotations

from typing import Any

from cephalo_lightning.testing.local_ranks import free_port, run_local_ranks

PRELOAD = ("torch", "lightning.pytorch", "transformers", "cephalo_lightning.lightning.strategy.cephalo_strategy", "cephalo_lightning.lightning.callback.cephalo_callback", "tests.helpers")


def run_distributed(fn: Any, world_size: int, *args: Any, threads: int = 1) -> list[Any]:
    return run_local_ranks(fn, world_size, *args, threads=threads, start_method="forkserver", preload=PRELOAD)


__all__ = ["free_port", "run_distributed"]
