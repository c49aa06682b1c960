"""Cluster files for TinyLayered on emulated CPUs, which the elastic and fault-tolerance tests re-plan
from: three devices of 3, 2 and 1 GiB, each profile ``ms`` per sample and layer forward
(``[ms, 2 ms, 3 ms]``), twice that backward."""

from __future__ import annotations

from tests.lightning_models import TinyLayered

BIG, MID, SMALL = "cpu (emulated x1.0, 3 GiB)", "cpu (emulated x1.0, 2 GiB)", "cpu (emulated x1.0, 1 GiB)"


def layered_device(name: str, memory: float, ms: float) -> dict:
    """A measured-style profile: ``ms`` per sample and layer forward, twice that backward."""
    return {"name": name, "memory_gb": memory, "layer_fwd_ms": [ms, 2 * ms, 3 * ms],
            "layer_bwd_ms": [2 * ms, 4 * ms, 6 * ms], "compute_memory_gb": [0.01, 0.02, 0.03]}


def layered_cluster(devices: list[dict]) -> dict:
    """A cluster file (as a dict) of TinyLayered on ``devices``."""
    parameters = sum(p.numel() for p in TinyLayered().parameters())
    return {"model": {"name": "tiny-layered", "num_layers": 4, "parameters": parameters},
            "settings": {"reserved_memory_gb": 0.0, "free_links": True}, "devices": devices}


CLUSTER3 = layered_cluster([layered_device(BIG, 3.0, 1.0), layered_device(MID, 2.0, 2.0), layered_device(SMALL, 1.0, 6.0)])
BIG_AND_SMALL = layered_cluster([layered_device(BIG, 3.0, 1.0), layered_device(SMALL, 1.0, 6.0)])  # MID gone
