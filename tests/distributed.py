"""Gloo ranks for tests: see :mod:`cephalo_lightning.testing.local_ranks`."""

from __future__ import annotations

from cephalo_lightning.testing.local_ranks import free_port, run_local_ranks

run_distributed = run_local_ranks

__all__ = ["free_port", "run_distributed"]
