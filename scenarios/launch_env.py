"""The environment a started process gets: the parent's, less the rendezvous variables of the rank
that starts it (a child that inherited them would join its parent's process group instead of
launching its own ranks), with W&B off; for torchrun, also without the store it shares with its ranks.

[Note: torchrun's c10d rendezvous hands its ranks the agent's own TCPStore (``TORCHELASTIC_USE_AGENT_STORE``)
and keeps that store, keys and all, across restarts. The restarted ranks' gloo rendezvous writes and reads
the same keys as the lives before (each rank's address under the group's name), so a restarted rank can
read a dead rank's address: ``connectFullMesh`` is refused (a restart spent) or waits on a peer that is
not there (the restart hangs). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` makes each round's rank 0 host a
fresh store on a fresh port instead.]"""

from __future__ import annotations

import os

RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "PL_GLOBAL_SEED")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess that launches its own ranks."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARIABLES}
    return {**env, "WANDB_MODE": "disabled", **extra}


def torchrun_env(**extra: str) -> dict[str, str]:
    """The environment for a torchrun launcher whose ranks may be restarted (see the module note)."""
    return clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **extra)
