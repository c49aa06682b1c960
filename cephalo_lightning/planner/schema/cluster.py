"""The cluster file: what the planner knows about the model, the settings and every device.

One format, YAML or JSON (docs/cluster.md). Bandwidths may be written with units
(:mod:`cephalo_lightning.planner.schema.bandwidth`). Devices are listed in rank order and
``count`` repeats an entry. A device entry either carries measured per-layer profiles or only a
catalog ``name``, in which case it is estimated from public datasheet figures and the model shape
(:mod:`cephalo_lightning.planner.schema.catalog`). This module reads, validates and writes the file; the
values it holds are :mod:`cephalo_lightning.planner.schema.cluster_spec`'s.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from cephalo_lightning._common.atomic_io import write_text_atomic
from cephalo_lightning._common.vocabulary import Collective, ProfileSource, Schedule, values_of
from cephalo_lightning.planner.schema.bandwidth import SPELLED_KEYS, per_rank_gbps, split_spelled
from cephalo_lightning.planner.schema.calibration_terms import CALIBRATION_TERMS, Calibration
from cephalo_lightning.planner.schema.catalog import estimate_profile
from cephalo_lightning.planner.schema.cluster_fields import (
    CLUSTER_FILE,
    checked_flag,
    checked_fraction,
    checked_integer,
    checked_mapping,
    checked_number,
    checked_series,
    nearest_keys,
    reject_unknown_keys,
)
from cephalo_lightning.planner.schema.cluster_spec import Cluster, DeviceProfile, Emulation, ModelSpec, Settings
from cephalo_lightning.planner.schema.files import read_document
from cephalo_lightning.planner.schema.limits import MAX_CLUSTER_RANKS, MAX_RANKS
from cephalo_lightning.planner.schema.planning_error import PlanningError

CALIBRATION_SOURCES = (ProfileSource.MEASURED.value, ProfileSource.EMULATED.value)


class EmulationSpecError(PlanningError):
    """A per-rank emulation spec (of a cluster file or the strategy's ``emulate=``) is malformed; the
    message names the rank or entry and the fix."""


EMULATION_KEYS = ("slowdown", "memory_gb", "node", "inter_node_gbps")
EMULATION_EXAMPLE = "{slowdown: 3, memory_gb: 0.5, node: 1, inter_node_gbps: 1.25}"


def _spec_number(value: Any, where: str, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EmulationSpecError(f"{where} must be a finite number, got {value!r}. {fix}")
    return float(value)


def parse_emulation_spec(data: Any, where: str = "emulate") -> Emulation | None:
    """One rank's emulation spec (``None``, a mapping or an :class:`Emulation`), validated.

    ``None`` means "a real device, not emulated"; ``{}`` means "emulated, at full speed and with
    unlimited memory" (a CPU rank that stands in for the fastest GPU of the cluster). Whether the
    ranks' ``node`` / ``inter_node_gbps`` agree with each other is checked over all ranks
    (``cephalo_lightning.runtime.emulation.links.links_from_emulation``).
    """
    if data is None:
        return None
    if isinstance(data, Emulation):
        data = asdict(data)
    if not isinstance(data, Mapping):
        raise EmulationSpecError(
            f"{where} must be null or a mapping like {EMULATION_EXAMPLE}, got {type(data).__name__} {data!r}")
    unknown = sorted(map(str, set(data) - set(EMULATION_KEYS)))
    if unknown:
        raise EmulationSpecError(
            f"{where}: unknown key(s) {unknown}{nearest_keys(unknown, EMULATION_KEYS)}; an emulation spec has "
            "'slowdown' (>= 1), 'memory_gb' (GiB), 'node' (an int >= 0) and 'inter_node_gbps' (GB/s per direction between emulated nodes)")
    slowdown = _spec_number(data.get("slowdown", 1.0), f"{where}.slowdown",
                            "Use 1 for full speed, 3 for three times slower.")
    if slowdown < 1.0:
        raise EmulationSpecError(
            f"{where}.slowdown must be >= 1 (1 = full speed; a CPU process cannot be made faster), got {slowdown:g}; "
            "set 1 for full speed or k > 1 for k times slower, and express the cluster relative to its fastest device, "
            "which gets slowdown 1.")
    memory = data.get("memory_gb")
    if memory is not None:
        memory = _spec_number(memory, f"{where}.memory_gb", "Give the emulated capacity in GiB, or null for unlimited.")
        if memory <= 0:
            raise EmulationSpecError(f"{where}.memory_gb must be > 0 GiB (or null for unlimited), got {memory:g}")
    node = data.get("node")
    if node is not None and (isinstance(node, bool) or not isinstance(node, int) or node < 0):
        raise EmulationSpecError(
            f"{where}.node must be a whole number >= 0 (the emulated node's index: 0, 1, ...), got {node!r}")
    gbps = data.get("inter_node_gbps")
    if gbps is not None:
        gbps = _spec_number(gbps, f"{where}.inter_node_gbps",
                            "Give the emulated inter-node bandwidth in GB/s per direction per rank, e.g. 1.25.")
        if gbps <= 0:
            raise EmulationSpecError(
                f"{where}.inter_node_gbps must be > 0 GB/s, got {gbps:g}; give the link's bandwidth per direction")
    return Emulation(slowdown=slowdown, memory_gb=memory, node=node, inter_node_gbps=gbps)



def parse_model(data: Any) -> ModelSpec:
    data = checked_mapping(data, "model")
    allowed = {f.name for f in fields(ModelSpec)}
    reject_unknown_keys(data, allowed, "model")
    for key in ("num_layers", "parameters"):
        if key not in data:
            raise PlanningError(f"model.{key} is required (the cost model is per layer); add it to the cluster file's "
                                "model: section")
    optional_ints = {k: checked_integer(data[k], f"model.{k}") for k in ("hidden_size", "seq_len") if data.get(k) is not None}
    return ModelSpec(
        name=str(data.get("name", "model")),
        num_layers=checked_integer(data["num_layers"], "model.num_layers"),
        parameters=checked_integer(data["parameters"], "model.parameters"),
        state_bytes_per_param=checked_number(data.get("state_bytes_per_param", 16), "model.state_bytes_per_param"),
        compute_bytes_per_param=checked_number(data.get("compute_bytes_per_param", 2), "model.compute_bytes_per_param"),
        grad_bytes_per_param=checked_number(data.get("grad_bytes_per_param", 4), "model.grad_bytes_per_param"),
        stash_bytes_per_sample=None if data.get("stash_bytes_per_sample") is None else
        checked_number(data["stash_bytes_per_sample"], "model.stash_bytes_per_sample"),
        kept_bytes_per_sample=None if data.get("kept_bytes_per_sample") is None else
        checked_number(data["kept_bytes_per_sample"], "model.kept_bytes_per_sample", strict=False),
        trainable_parameters=None if data.get("trainable_parameters") is None else
        checked_integer(data["trainable_parameters"], "model.trainable_parameters", minimum=0),
        weight_bytes_per_param=checked_number(data.get("weight_bytes_per_param", 4), "model.weight_bytes_per_param"),
        largest_unit_parameters=None if data.get("largest_unit_parameters") is None else
        checked_integer(data["largest_unit_parameters"], "model.largest_unit_parameters"),
        largest_reduced_parameters=None if data.get("largest_reduced_parameters") is None else
        checked_integer(data["largest_reduced_parameters"], "model.largest_reduced_parameters", minimum=0),
        **optional_ints,
    )


def parse_settings(data: Any) -> Settings:
    if data is None:
        return Settings()
    data = checked_mapping(data, "settings")
    reject_unknown_keys(data, {f.name for f in fields(Settings)}, "settings")
    values: dict[str, Any] = {}
    for key in ("allgather_ms", "reduce_scatter_ms", "micro_batch_overhead_ms", "step_overhead_ms", "reserved_memory_gb"):
        if key in data:
            values[key] = checked_number(data[key], f"settings.{key}", strict=False)
    if "usable_memory_fraction" in data:
        frac = checked_number(data["usable_memory_fraction"], "settings.usable_memory_fraction")
        if frac > 1:
            raise PlanningError(f"settings.usable_memory_fraction must be <= 1, got {frac}: it is the share of each "
                                f"device's memory the plan may fill (e.g. 0.9)")
        values["usable_memory_fraction"] = frac
    for key in ("link_bandwidth_gbps", "inter_node_bandwidth_gbps"):
        if data.get(key) is not None:
            values[key] = checked_number(data[key], f"settings.{key}")
    if "inter_node_latency_ms" in data:
        values["inter_node_latency_ms"] = checked_number(data["inter_node_latency_ms"], "settings.inter_node_latency_ms",
                                                  strict=False)
    if "host_contention" in data:
        values["host_contention"] = checked_number(data["host_contention"], "settings.host_contention")
        if values["host_contention"] < 1:
            raise PlanningError(f"settings.host_contention must be >= 1 (1: no waiting for a core), got "
                                f"{values['host_contention']}; set it to 1 or more{CLUSTER_FILE}")
    if "estimated_mfu" in data:
        values["estimated_mfu"] = checked_number(data["estimated_mfu"], "settings.estimated_mfu")
    for key in ("uneven_slope", "optimizer_ns_per_param"):
        if data.get(key) is not None:
            values[key] = checked_number(data[key], f"settings.{key}", strict=False)
    if data.get("overlap") is not None:
        values["overlap"] = checked_fraction(data["overlap"], "settings.overlap",
                                      "1 = communication hidden behind compute, 0 = not at all")
    if "offload_stash" in data:
        values["offload_stash"] = checked_flag(data["offload_stash"], "settings.offload_stash")
    if "stash_on_device" in data:
        values["stash_on_device"] = checked_flag(data["stash_on_device"], "settings.stash_on_device")
    if "sync_passes" in data:
        values["sync_passes"] = checked_flag(data["sync_passes"], "settings.sync_passes")
    if "free_links" in data:
        values["free_links"] = checked_flag(data["free_links"], "settings.free_links")
    if "repeated_gather_fraction" in data:
        values["repeated_gather_fraction"] = checked_fraction(
            data["repeated_gather_fraction"], "settings.repeated_gather_fraction",
            "a uniform micro-batch's gather after the first, per the first's time (1: every gather alike)")
    if values.get("offload_stash") and values.get("stash_on_device"):
        raise PlanningError("settings.offload_stash and settings.stash_on_device are both true, but the stash is "
                            "either copied to the host or kept on the device; set one of them to false")
    if data.get("host_cores") is not None:
        values["host_cores"] = checked_number(data["host_cores"], "settings.host_cores")
    if "host_copy_gbps" in data:
        values["host_copy_gbps"] = checked_number(data["host_copy_gbps"], "settings.host_copy_gbps")
    if "collective" in data:
        if data["collective"] not in values_of(Collective):
            raise PlanningError(f"settings.collective must be one of {values_of(Collective)}, got {data['collective']!r}: "
                                f"write collective: padded or collective: exact (the runtime's CephaloStrategy(collective=...))")
        values["collective"] = Collective(data["collective"])
    return Settings(**values)


_PROFILE_KEYS = ("layer_fwd_ms", "layer_bwd_ms", "compute_memory_gb")
_EXTRA_KEYS = ("activation_memory_gb", "optimizer_ns_per_param", "host_copy_gbps")  # optional with either
_DEVICE_KEYS = {"name", "count", "memory_gb", "source", "emulate", "node", *_PROFILE_KEYS, *_EXTRA_KEYS}


def _device_extras(entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The optional cost terms a device entry may carry, measured or estimated alike."""
    extras: dict[str, Any] = {}
    if entry.get("activation_memory_gb") is not None:
        extras["activation_memory_gb"] = checked_series(entry["activation_memory_gb"], f"{where}.activation_memory_gb",
                                                 strict=False)
    if entry.get("optimizer_ns_per_param") is not None:
        extras["optimizer_ns_per_param"] = checked_number(entry["optimizer_ns_per_param"],
                                                   f"{where}.optimizer_ns_per_param", strict=False)
    if entry.get("host_copy_gbps") is not None:
        extras["host_copy_gbps"] = checked_number(entry["host_copy_gbps"], f"{where}.host_copy_gbps")
    return extras


def _check_rank_count(entries: Sequence[Any]) -> None:
    """The ranks the entries' counts add up to stay within the planner's limit, checked before any entry
    is expanded (a count of 10**9 would otherwise fill the memory before the limit is seen)."""
    total = 0
    for i, entry in enumerate(entries):
        if isinstance(entry, Mapping):
            total += checked_integer(entry.get("count", 1), f"devices[{i}].count")
    if total > MAX_CLUSTER_RANKS:
        raise PlanningError(
            f"the cluster file's device counts add up to {total:,} ranks, {total / MAX_RANKS:,.0f}x the "
            f"planner's limit of {MAX_RANKS:,} (a plan file lists every rank); plan a sub-cluster with the same "
            f"kinds in proportion (e.g. every count and the global batch divided by {-(-total // MAX_RANKS):,})")


def _node_entries(data: Any) -> list[tuple[str, Any, int]]:
    """The ``nodes:`` form as (where, device entry, node) in rank order: node i lists its devices."""
    if isinstance(data, (str, bytes)) or not isinstance(data, Sequence) or len(data) == 0:
        raise PlanningError("nodes must be a non-empty list, one entry per node in rank order, each with its "
                            "devices, e.g. nodes: [{devices: [{name: a100, count: 8}]}, {devices: [...]}]")
    out = []
    for n, node in enumerate(data):
        node = checked_mapping(node, f"nodes[{n}]")
        reject_unknown_keys(node, {"devices"}, f"nodes[{n}]")
        entries = node.get("devices")
        if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence) or len(entries) == 0:
            raise PlanningError(f"nodes[{n}].devices must be a non-empty list of device entries, got {entries!r}; "
                                "list the node's GPUs, e.g. devices: [{name: a100, count: 8}]")
        for i, entry in enumerate(entries):
            where = f"nodes[{n}].devices[{i}]"
            if isinstance(entry, Mapping) and "node" in entry and entry["node"] != n:
                raise PlanningError(f"{where}.node is {entry['node']!r} inside nodes[{n}]: under nodes: a device's "
                                    "node is its position; drop the key")
            out.append((where, entry, n))
    return out


def _entry_nodes(data: Sequence[Any]) -> list[int | None]:
    """Each ``devices:`` entry's ``node:`` (all given or none)."""
    nodes = []
    for i, entry in enumerate(data):
        value = entry.get("node") if isinstance(entry, Mapping) else None
        nodes.append(None if value is None else checked_integer(value, f"devices[{i}].node", minimum=0))
    given = [i for i, n in enumerate(nodes) if n is not None]
    missing = [i for i, n in enumerate(nodes) if n is None and isinstance(data[i], Mapping)]
    if given and missing:
        raise PlanningError(f"devices{given} name a node but devices{missing} do not: give every entry a node: "
                            "(its host, 0, 1, ...) or none (one node)")
    return nodes


def parse_devices(data: Any, model: ModelSpec, settings: Settings, *, nodes: Any = None) -> tuple[DeviceProfile, ...]:
    """Devices from a ``devices:`` list (each entry may name its ``node``) or from a ``nodes:`` list."""
    if nodes is not None:
        listed = _node_entries(nodes)
    else:
        if isinstance(data, (str, bytes)) or not isinstance(data, Sequence) or len(data) == 0:
            raise PlanningError("devices must be a non-empty list (one entry per GPU kind, in rank order); list at "
                                "least one, e.g. devices: [{name: a100, count: 2}]")
        listed = [(f"devices[{i}]", entry, node) for i, (entry, node) in enumerate(zip(data, _entry_nodes(data)))]
    _check_rank_count([entry for _, entry, _ in listed])
    devices: list[DeviceProfile] = []
    for where, entry, node in listed:
        entry = checked_mapping(entry, where)
        reject_unknown_keys(entry, _DEVICE_KEYS, where)
        if "name" not in entry:
            raise PlanningError(f"{where}.name is required; name a catalog GPU (e.g. a100) or your device, with its "
                                "measured figures")
        name = str(entry["name"])
        count = checked_integer(entry.get("count", 1), f"{where}.count")
        emulate = parse_emulation_spec(entry.get("emulate"), f"{where}.emulate")
        given = [k for k in _PROFILE_KEYS if k in entry]
        if given and len(given) != len(_PROFILE_KEYS):
            missing = sorted(set(_PROFILE_KEYS) - set(given))
            raise PlanningError(f"{where} ({name}) gives {given} but not {missing}: give all three or none")
        if given:
            # each series may cover its own sizes 1..k and is extrapolated on its own (compute_curves.PiecewiseLinear)
            fwd = checked_series(entry["layer_fwd_ms"], f"{where}.layer_fwd_ms", strict=True)
            bwd = checked_series(entry["layer_bwd_ms"], f"{where}.layer_bwd_ms", strict=True)
            mem = checked_series(entry["compute_memory_gb"], f"{where}.compute_memory_gb", strict=False)
            if "memory_gb" not in entry:
                raise PlanningError(f"{where} ({name}).memory_gb is required with a measured profile; add the device's "
                                    "memory in GiB, e.g. memory_gb: 80")
            source = str(entry.get("source", ProfileSource.EMULATED if emulate else ProfileSource.MEASURED))
            if source not in values_of(ProfileSource):
                raise PlanningError(f"{where}.source must be one of {values_of(ProfileSource)}, got {source!r}; write one of "
                                    "those or drop the key")
            device = DeviceProfile(
                name, checked_number(entry["memory_gb"], f"{where}.memory_gb"), fwd, bwd, mem, ProfileSource(source), emulate
            )
        else:
            device = estimate_profile(name, model, settings, where=where)
            if "memory_gb" in entry:
                device = replace(device, memory_gb=checked_number(entry["memory_gb"], f"{where}.memory_gb"))
            device = replace(device, emulate=emulate)
        if node is not None and emulate is not None and emulate.node is not None and emulate.node != node:
            raise PlanningError(f"{where} ({name}) is in node {node} but its emulate.node is {emulate.node}: the "
                                "planner would price one topology while the emulation slows the links of another; "
                                "make them equal (node: is what the planner prices, emulate.node the links the emulation slows)")
        device = replace(device, **_device_extras(entry, where), node=node)
        devices.extend([device] * count)
    return tuple(devices)


def parse_calibration(data: Any, world_size: int) -> Calibration | None:
    """The block as written in a cluster file (None: absent)."""
    if data is None:
        return None
    data = checked_mapping(data, "calibration")
    reject_unknown_keys(data, {*CALIBRATION_TERMS, "compute_scale", "host_contention", "steps", "fitted_on", "source", "mode",
                           "shard_groups"}, "calibration")
    missing = [k for k in (*CALIBRATION_TERMS, "compute_scale") if k not in data]
    if missing:
        raise PlanningError(f"calibration is missing {missing}; write the whole block as `fit_calibration` does, or "
                            "remove it to plan from the profile alone")
    values = {k: checked_number(data[k], f"calibration.{k}", strict=False) for k in CALIBRATION_TERMS if k != "overlap"}
    scale = checked_series(data["compute_scale"], "calibration.compute_scale", strict=True)
    if len(scale) != world_size:
        raise PlanningError(f"calibration.compute_scale has {len(scale)} entries but the cluster has {world_size} ranks; "
                            "give one per rank (calibrate again after changing the devices)")
    contention = checked_number(data.get("host_contention", 1.0), "calibration.host_contention")
    if contention < 1:
        raise PlanningError(f"calibration.host_contention must be >= 1 (1: no rank waits for a core), got {contention}; "
                            "set it to 1 or more")
    source = str(data.get("source", ProfileSource.MEASURED))
    if source not in CALIBRATION_SOURCES:
        raise PlanningError(f"calibration.source must be one of {CALIBRATION_SOURCES}, got {source!r}; write one of those")
    mode = data.get("mode")
    if mode is not None and mode not in values_of(Schedule):
        raise PlanningError(f"calibration.mode must be one of {values_of(Schedule)} (the mode of the steps it was fitted on), got "
                            f"{mode!r}; write one of those, or leave it out")
    mode = Schedule(mode) if mode is not None else None
    groups = data.get("shard_groups")
    if groups is not None:
        if not isinstance(groups, list) or len(groups) != world_size:
            raise PlanningError(f"calibration.shard_groups must list every rank's group ({world_size} entries, e.g. "
                                f"{[0] * world_size} for one group), got {groups!r}; write the fitted plan's groups, or "
                                "leave it out to price every grouping's collectives with it")
        groups = tuple(checked_integer(g, f"calibration.shard_groups[{i}]", minimum=0) for i, g in enumerate(groups))
    return Calibration(
        **values, overlap=checked_fraction(data["overlap"], "calibration.overlap", "the overlap achieved"),
        compute_scale=scale, host_contention=contention, steps=checked_integer(data.get("steps", 0), "calibration.steps", minimum=0),
        fitted_on=str(data.get("fitted_on", "")), source=ProfileSource(source), mode=mode, shard_groups=groups)


def cluster_from_dict(data: Any) -> Cluster:
    data = checked_mapping(data, "cluster file")
    reject_unknown_keys(data, {"model", "settings", "devices", "nodes", "calibration"}, "cluster file")
    if "model" not in data:
        raise PlanningError("the cluster file needs a 'model:' section (num_layers, parameters); add one, e.g. "
                            "model: {num_layers: 32, parameters: 2700000000}")
    if "devices" in data and "nodes" in data:
        raise PlanningError("the cluster file gives both 'devices:' and 'nodes:'; keep one: a devices: list (each "
                            "entry may say node: i) or a nodes: list of {devices: [...]}")
    if "devices" not in data and "nodes" not in data:
        raise PlanningError("the cluster file needs a 'devices:' list; add one in rank order, e.g. "
                            "devices: [{name: a100, count: 2}] (or a nodes: list, one {devices: [...]} per node)")
    model = parse_model(data["model"])
    if isinstance(data.get("settings"), Mapping):  # a file's settings: the spelled bandwidths are its documented keys
        reject_unknown_keys(data["settings"], {f.name for f in fields(Settings)} | set(SPELLED_KEYS), "settings")
    settings_data, spelled = split_spelled(data.get("settings"))  # "25 Gbit/s per link" (planner/bandwidth.py)
    settings = parse_settings(settings_data)
    devices = parse_devices(data.get("devices"), model, settings, nodes=data.get("nodes"))
    cluster = Cluster(model=model, devices=devices, settings=settings,
                      calibration=parse_calibration(data.get("calibration"), len(devices)))
    if spelled:
        cluster = replace(cluster, settings=replace(settings, **per_rank_gbps(spelled, cluster.nodes)))
    return cluster


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster file (YAML or JSON)."""
    return cluster_from_dict(read_document(
        path, "cluster file", "write one as docs/cluster.md shows, or with "
        "`python -m cephalo_lightning profile` / `plan convert`"))


def _device_entry(device: DeviceProfile) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": device.name,
        "memory_gb": device.memory_gb,
        "layer_fwd_ms": list(device.layer_fwd_ms),
        "layer_bwd_ms": list(device.layer_bwd_ms),
        "compute_memory_gb": list(device.compute_memory_gb),
        "source": device.source.value,
    }
    if device.emulate is not None:
        entry["emulate"] = {k: v for k, v in asdict(device.emulate).items() if v is not None}
    if device.activation_memory_gb is not None:
        entry["activation_memory_gb"] = list(device.activation_memory_gb)
    for key in ("optimizer_ns_per_param", "host_copy_gbps", "node"):
        if getattr(device, key) is not None:
            entry[key] = getattr(device, key)
    return entry


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """The cluster file form, with runs of identical devices folded into ``count``."""
    entries: list[dict[str, Any]] = []
    previous: DeviceProfile | None = None
    for device in cluster.devices:
        if device == previous:
            entries[-1]["count"] += 1
            continue
        entries.append({**_device_entry(device), "count": 1})
        previous = device
    model = {k: v for k, v in asdict(cluster.model).items() if v is not None}
    settings = {k: v for k, v in asdict(cluster.settings).items() if v is not None}
    settings["collective"] = cluster.settings.collective.value  # YAML's safe dumper writes no str subclass
    if not settings.get("step_overhead_ms"):
        settings.pop("step_overhead_ms", None)  # files written before the terms existed read the same
    for term in ("host_contention", "repeated_gather_fraction"):
        if settings.get(term) == 1.0:
            settings.pop(term, None)
    if not settings.get("inter_node_latency_ms"):
        settings.pop("inter_node_latency_ms", None)
    for flag in ("stash_on_device", "sync_passes", "free_links"):
        if not settings.get(flag):
            settings.pop(flag, None)
    data = {"model": model, "settings": settings, "devices": entries}
    if cluster.calibration is not None:
        data["calibration"] = cluster.calibration.as_dict()
    return data


def save_cluster(cluster: Cluster, path: str | Path) -> None:
    """Write a cluster file; the format follows the suffix (.json, else YAML)."""
    path = Path(path)
    data = cluster_to_dict(cluster)
    if path.suffix.lower() == ".json":
        text = json.dumps(data, indent=2)
    else:
        import yaml

        text = yaml.safe_dump(data, sort_keys=False)
    write_text_atomic(path, text)
