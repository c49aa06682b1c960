"""Profiling (torch level, no Lightning): measure every rank's device and build the planner's cluster.

* :func:`profile_layer` - one layer's forward / backward time and compute memory at sizes 1..k;
* :func:`profile_model` - the whole model, distinct layers measured once, per-average-layer figures;
* :class:`ProfileOptions` - how to profile, passed whole from the cluster down to every layer;
* :class:`ModelDescription` - what the caller says of the model (name, parameter counts, state bytes),
  completed by the measurement into the planner's ``ModelSpec``;
* :func:`time_collectives` - all-gather / reduce-scatter of one unit over the process group;
* :func:`find_nodes` / :func:`time_links` - every rank's node, and the links within and between nodes;
* :func:`profile_cluster` / :class:`ClusterProfiler` - all of it on every rank, gathered into a
  :class:`~cephalo_lightning.planner.Cluster` and cached as a cluster file.

Emulated devices (:class:`~cephalo_lightning.runtime.emulation.emulator.DeviceEmulator`) are measured like
real ones and marked ``source: emulated``.
"""

from cephalo_lightning.profiling.cache import cache_path, fingerprint
from cephalo_lightning.profiling.collective_timing import CollectiveProfile, time_collectives
from cephalo_lightning.profiling.devices import default_settings, device_name
from cephalo_lightning.profiling.layer import LayerProfile, profile_layer
from cephalo_lightning.profiling.model import (
    LayerKind,
    ModelHooks,
    ModelProfile,
    Pacing,
    layer_signature,
    profile_model,
    take_rows,
)
from cephalo_lightning.profiling.model_description import ModelDescription
from cephalo_lightning.profiling.options import ProfileOptions
from cephalo_lightning.profiling.profiler import ClusterProfiler, ProfileReport, ProfilingError, profile_cluster
from cephalo_lightning.profiling.topology import LinkProfile, Topology, find_nodes, time_links
from cephalo_lightning.profiling.turns import TurnTaker

__all__ = [
    "ClusterProfiler", "CollectiveProfile", "LayerKind", "LayerProfile", "LinkProfile", "ModelDescription", "ModelHooks",
    "ModelProfile", "Pacing", "ProfileOptions", "ProfileReport", "ProfilingError", "Topology", "TurnTaker", "cache_path",
    "default_settings", "device_name", "find_nodes", "fingerprint", "layer_signature", "profile_cluster",
    "profile_layer", "profile_model", "take_rows", "time_collectives", "time_links",
]
