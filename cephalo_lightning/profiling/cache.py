"""The profile cache: a cluster file keyed by a fingerprint of everything the profile depends on.

A restart (or a second run with the same model on the same devices) reuses the cluster file
instead of profiling again. The key covers the model's structure (module tree, parameter shapes
and dtypes, the sample input's shape), the micro-batch sizes, the world size, every rank's device
name and emulation spec, and the options that change the figures (compute dtype, prefetch, ...).
Weights do not enter it: they do not change the cost. The file is the planner's ordinary cluster
file, so it can also be edited and re-planned offline (``load_cluster``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cephalo_lightning.planner.schema.cluster import load_cluster, save_cluster
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.planning_error import PlanningError
from cephalo_lightning.runtime.batching import tensors_in
from cephalo_lightning.runtime.layered import Layer
from cephalo_lightning.runtime.sharding.flat_unit import full_shape

log = logging.getLogger(__name__)

CACHE_FORMAT = 3  # bump when what a cached figure means changes (2: graph memory, optimizer step; 3: the
# flat gradient in compute memory, the largest unit)


def structure(layers: Sequence[Any], sample_input: Any, batch_dim: int = 0) -> list[Any]:
    """What the model's cost depends on, as plain JSON-able data (no weights).

    ``layers``: modules or :class:`~cephalo_lightning.runtime.layered.Layer` objects; parameters
    count with their full shapes (also when the model is sharded); ``sample_input``: a tensor or a
    nested batch of them."""
    inputs = []
    for tensor in tensors_in(sample_input):
        shape = list(tensor.shape)
        if len(shape) > batch_dim:
            shape[batch_dim] = -1
        inputs.append([shape, str(tensor.dtype)])
    described: list[Any] = [{"input": inputs[0] if len(inputs) == 1 else inputs}]
    for layer in layers:
        for module in (layer.modules if isinstance(layer, Layer) else (layer,)):
            described.append({
                "modules": [
                    [name, type(m).__module__ + "." + type(m).__qualname__, m.extra_repr()]
                    for name, m in module.named_modules()
                ],
                "params": [[n, list(full_shape(p)), str(p.dtype), p.requires_grad] for n, p in module.named_parameters()],
                "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in module.named_buffers()],
            })
    return described


def fingerprint(parts: Mapping[str, Any]) -> str:
    """A short stable digest of JSON-able ``parts``."""
    text = json.dumps({"format": CACHE_FORMAT, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cache_path(cache_dir: str | Path, key: str) -> Path:
    return Path(cache_dir) / f"cluster-{key}.yaml"


CAPACITY_TOLERANCE = 0.01  # relative: a cached capacity further from the device's is not trusted


def read_cached(path: Path, world_size: int, capacities: Sequence[float] | None = None) -> Cluster | None:
    """The cached cluster at ``path``, or ``None`` when absent or unusable (then it is re-profiled).

    ``capacities``: every rank's actual memory (GiB); a cached device whose ``memory_gb`` differs
    from its rank's by more than :data:`CAPACITY_TOLERANCE` (a hand edit, another GPU behind the
    same name) is not trusted: the profile is measured again, with a warning that says so.
    """
    if not path.is_file():
        return None
    try:
        cluster = load_cluster(path)
    except (PlanningError, OSError) as err:
        log.warning("ignoring the profile cache %s (%s); profiling again", path, err)
        return None
    if cluster.world_size != world_size:
        log.warning(
            "ignoring the profile cache %s: it has %d devices, the world has %d", path, cluster.world_size, world_size
        )
        return None
    for rank, (device, actual) in enumerate(zip(cluster.devices, capacities or ())):
        if abs(device.memory_gb - actual) > CAPACITY_TOLERANCE * actual:
            log.warning(
                "ignoring the profile cache %s: rank %d (%s) has %.3g GiB of memory but the cache says %.3g GiB "
                "(%.1fx); profiling again", path, rank, device.name, actual, device.memory_gb,
                device.memory_gb / actual if actual else float("inf"),
            )
            return None
    return cluster


def write_cached(cluster: Cluster, path: Path) -> None:
    """Write atomically, so a crash never leaves a half-written cache for the next start."""
    save_cluster(cluster, path)
