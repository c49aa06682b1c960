"""The environment a started process gets: the parent's, less the rendezvous variables of the rank
that starts it (a child that inherited them would join its parent's process group instead of
launching its own ranks), with W&B off."""

from __future__ import annotations

import os

RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "PL_GLOBAL_SEED")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess that launches its own ranks."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARIABLES}
    return {**env, "WANDB_MODE": "disabled", **extra}
