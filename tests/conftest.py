"""Shared test hygiene: no test leaks a process group or Lightning's rendezvous variables."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "PL_GLOBAL_SEED")


@pytest.fixture(autouse=True)
def _isolated_process_group():
    before = {k: os.environ.get(k) for k in _RENDEZVOUS}
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess that launches its own ranks."""
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    return {**env, "WANDB_MODE": "disabled", **extra}
