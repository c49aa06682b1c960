"""The cluster file: what the planner knows about the model, the settings and every device.

One format, YAML or JSON (docs/cluster.md). Bandwidths may be written with units
(:mod:`cephalo_lightning.planner.bandwidth`). Devices are listed in rank order and
``count`` repeats an entry. A device entry either carries measured per-layer profiles or only a
catalog ``name``, in which case it is estimated from public datasheet figures and the model shape
(:mod:`cephalo_lightning.planner.catalog`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from cephalo_lightning._common.atomic_io import write_text_atomic
from cephalo_lightning.planner.bandwidth import per_rank_gbps, split_spelled
from cephalo_lightning.planner.calibration import Calibration, parse_calibration
from cephalo_lightning.planner.errors import PlanningError
from cephalo_lightning.planner.files import MAX_EXACT_INTEGER, read_document, shown_number
from cephalo_lightning.planner.limits import MAX_CLUSTER_RANKS, MAX_RANKS

COLLECTIVE_MODES = ("padded", "exact")
CLUSTER_FILE = " in the cluster file"
PROFILE_SOURCES = ("measured", "catalog", "emulated")


@dataclass(frozen=True)
class ModelSpec:
    """The model as the cost model sees it: a stack of identical layers and a parameter count.

    ``parameters`` counts every parameter (what the all-gathers move and the shards store);
    ``trainable_parameters`` (None: all of them) the ones with gradients and optimizer state. The
    sharded training state is::

        state_bytes = state_bytes_per_param * trainable + weight_bytes_per_param * (parameters - trainable)

    a trainable parameter holds its weight, gradient and optimizer moments (``state_bytes_per_param``,
    16 for fp32 AdamW), a frozen one (LoRA's base model, frozen embeddings) only its stored weight
    (``weight_bytes_per_param``: the shard's dtype, 4 for an fp32 master).
    """

    name: str
    num_layers: int
    parameters: int
    state_bytes_per_param: float = 16.0
    hidden_size: int | None = None
    seq_len: int | None = None
    compute_bytes_per_param: float = 2.0  # bytes of a gathered parameter (bf16)
    grad_bytes_per_param: float = 4.0  # bytes of a reduced gradient (fp32)
    stash_bytes_per_sample: float | None = None  # one sample's input to one layer (host offload copy)
    # device bytes one sample holds between the layered forward and backward passes while the stash
    # stays on the device (settings.stash_on_device): every layer's input and the last layer's output
    # (measured by the profiler; absent: estimated, see kept_bytes)
    kept_bytes_per_sample: float | None = None
    trainable_parameters: int | None = None  # None: every parameter trains
    weight_bytes_per_param: float = 4.0  # bytes of a frozen parameter's stored shard (the master dtype)

    def __post_init__(self) -> None:
        if self.trainable_parameters is not None and not 0 <= self.trainable_parameters <= self.parameters:
            raise PlanningError(f"model.trainable_parameters ({self.trainable_parameters:,}) must be between 0 and "
                                f"model.parameters ({self.parameters:,}, every parameter, frozen ones included); "
                                "fix it in the cluster file")

    @property
    def trainable(self) -> int:
        """The parameters with gradients and optimizer state."""
        return self.parameters if self.trainable_parameters is None else self.trainable_parameters

    @property
    def frozen(self) -> int:
        return self.parameters - self.trainable

    @property
    def state_bytes(self) -> float:
        """The whole sharded state: trainable parameters' full state, frozen ones' stored weights."""
        return self.state_bytes_per_param * self.trainable + self.weight_bytes_per_param * self.frozen

    @property
    def state_terms(self) -> str:
        """``state_bytes`` spelled out, for messages."""
        full = f"{self.trainable:,} parameters x {self.state_bytes_per_param:g} bytes"
        return full if not self.frozen else f"{full} + {self.frozen:,} frozen x {self.weight_bytes_per_param:g} bytes"

    @property
    def layer_parameters(self) -> float:
        return self.parameters / self.num_layers

    @property
    def stash_bytes(self) -> float | None:
        """Bytes of one sample's input to one layer: given, or seq_len x hidden_size in the compute dtype."""
        if self.stash_bytes_per_sample is not None:
            return self.stash_bytes_per_sample
        if self.hidden_size is not None and self.seq_len is not None:
            return float(self.hidden_size * self.seq_len * self.compute_bytes_per_param)
        return None

    @property
    def kept_bytes(self) -> float:
        """Device bytes one sample keeps between the layered passes when the stash stays on the device:
        measured, else ``num_layers x stash_bytes`` (every layer's input; the last output unknown), else 0."""
        if self.kept_bytes_per_sample is not None:
            return self.kept_bytes_per_sample
        stash = self.stash_bytes
        return 0.0 if stash is None else self.num_layers * stash


@dataclass(frozen=True)
class Settings:
    """Knobs of the cost model; the defaults are the reference implementation's."""

    usable_memory_fraction: float = 0.75
    reserved_memory_gb: float = 2.0
    micro_batch_overhead_ms: float = 10.0
    step_overhead_ms: float = 0.0  # fixed per-step time outside the layers (a calibration measures it)
    host_contention: float = 1.0  # wall time per compute second, ranks sharing host cores (a calibration measures it)
    allgather_ms: float = 0.0  # one layer, even shares; or priced from link_bandwidth_gbps
    reduce_scatter_ms: float = 0.0
    # GB/s per direction per rank between ranks (a file may write link_bandwidth: "16 GB/s per rank" instead)
    link_bandwidth_gbps: float | None = None
    collective: str = "padded"  # how the runtime moves uneven shards: padded | exact
    estimated_mfu: float = 0.4  # for catalog estimates only
    # None below: measured by the profiler when it writes the cluster, else the default in cost.py
    uneven_slope: float | None = None  # extra collective time per unit of imbalance (UNEVEN_SLOPE)
    overlap: float | None = None  # how much communication hides behind compute: 1 = max(AG, F), 0 = AG + F
    optimizer_ns_per_param: float | None = None  # for devices without their own figure (else 0)
    offload_stash: bool = False  # the layered stash is copied to host memory and back (CUDA's default)
    # the layered stash stays in device memory (the runtime's offload=False: a CPU rank without an emulated
    # capacity); memory then grows by batch x model.kept_bytes. False: on the host (CUDA, emulated memory)
    stash_on_device: bool = False
    host_copy_gbps: float = 12.0  # device <-> pinned host GB/s, for devices without their own figure
    # the link between nodes (``DeviceProfile.node``), GB/s per direction per rank (a file may write
    # inter_node_bandwidth: "25 Gbit/s per link" instead); None: as fast as link_bandwidth_gbps
    inter_node_bandwidth_gbps: float | None = None
    inter_node_latency_ms: float = 0.0  # per collective that crosses nodes
    # cores of the one host every rank runs on (CPU ranks, emulated clusters; the profiler fills it);
    # None: every rank has a device of its own. With it the step is at least the ranks' real compute
    # (their compute without emulated waits) spread over these cores (cost.shared_host_floor_ms)
    host_cores: float | None = None
    # ranks of one shard group end every layer's pass together (each pass's per-layer collectives wait
    # for the group's slowest rank), so a group's step is L x (its slowest forward + its slowest
    # backward), not its slowest rank's sum (cost.synced_group_ms); the profiler sets it. False: the
    # per-rank sum alone (files written before it price as before)
    sync_passes: bool = False
    # uniform mode gathers every layer once per micro-batch; a gather after the first of a layer's pass
    # costs this fraction of the first, which also holds the ranks' wait for each other at the layer
    # (a calibration sets it: the profiled gather over the fitted one). 1: every gather as the first
    repeated_gather_fraction: float = 1.0


@dataclass(frozen=True)
class Emulation:
    """CPU emulation of a slower or smaller device (see ``cephalo_lightning.runtime.emulation.emulator``),
    optionally on an emulated node whose links to the other nodes are slowed
    (``cephalo_lightning.runtime.emulation.links``)."""

    slowdown: float = 1.0
    memory_gb: float | None = None
    node: int | None = None  # the emulated node this rank is in (None: the links are not emulated)
    inter_node_gbps: float | None = None  # GB/s per direction per rank over the link between emulated nodes


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
            f"{where}: unknown key(s) {unknown}; an emulation spec has 'slowdown' (>= 1), 'memory_gb' (GiB), "
            "'node' (an int >= 0) and 'inter_node_gbps' (GB/s per direction between emulated nodes)")
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


@dataclass(frozen=True)
class DeviceProfile:
    """One rank's device: capacity and one layer's measured (or estimated) costs at sizes 1..k."""

    name: str
    memory_gb: float
    layer_fwd_ms: tuple[float, ...]
    layer_bwd_ms: tuple[float, ...]
    compute_memory_gb: tuple[float, ...]
    source: str = "measured"
    emulate: Emulation | None = None
    # GiB the autograd graph of the WHOLE model's forward holds at micro-batch sizes 1..k, beyond
    # compute_memory_gb: what a rank keeping its graph (no recompute, the uniform mode) also holds
    activation_memory_gb: tuple[float, ...] | None = None
    optimizer_ns_per_param: float | None = None  # optimizer step time per state parameter owned
    host_copy_gbps: float | None = None  # device <-> pinned host copy bandwidth
    node: int | None = None  # the node (host) it is in; None on every device: one node


@dataclass(frozen=True)
class Cluster:
    model: ModelSpec
    devices: tuple[DeviceProfile, ...]
    settings: Settings = field(default_factory=Settings)
    calibration: Calibration | None = None  # terms measured on a run (planner.calibration)

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def emulated(self) -> bool:
        return any(d.source == "emulated" for d in self.devices)

    @property
    def nodes(self) -> tuple[int, ...]:
        """Every rank's node (0 everywhere when no device names one)."""
        return tuple(0 if d.node is None else d.node for d in self.devices)

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))


# --------------------------------------------------------------------------------------------
# parsing and validation


def _number(value: Any, where: str, *, minimum: float = 0.0, strict: bool = True) -> float:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_EXACT_INTEGER:
        raise PlanningError(f"{where} must be a number of at most {MAX_EXACT_INTEGER:,}, got {shown_number(value)}; "
                            "fix it in the cluster file")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PlanningError(f"{where} must be a number, got {value!r}; write a finite number in the cluster file")
    if value < minimum or (strict and value == minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise PlanningError(f"{where} must be {bound}, got {value!r}; set it to a number {bound}{CLUSTER_FILE}")
    return float(value)


def _integer(value: Any, where: str, *, minimum: int = 1) -> int:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > MAX_EXACT_INTEGER:
        raise PlanningError(f"{where} must be at most {MAX_EXACT_INTEGER:,}, got {shown_number(value)}; "
                            "fix it in the cluster file")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value):
        raise PlanningError(f"{where} must be a whole number, got {value!r}; write one in the cluster file")
    if value < minimum:
        raise PlanningError(f"{where} must be >= {minimum}, got {value!r}; raise it in the cluster file")
    return int(value)


def _fraction(value: Any, where: str, meaning: str) -> float:
    number = _number(value, where, strict=False)
    if number > 1:
        raise PlanningError(f"{where} must be in [0, 1] ({meaning}), got {value!r}; set it between 0 and 1"
                            f"{CLUSTER_FILE}")
    return number


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise PlanningError(f"{where} must be true or false, got {value!r}; write true or false, unquoted{CLUSTER_FILE}")
    return value


def _series(value: Any, where: str, *, strict: bool) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) == 0:
        raise PlanningError(
            f"{where} must be a non-empty list of numbers (micro-batch sizes 1, 2, ...), got {value!r}; list the "
            f"figure at each size, e.g. [1.2, 2.3, 3.5]{CLUSTER_FILE}"
        )
    return tuple(_number(v, f"{where}[{i}]", strict=strict) for i, v in enumerate(value))


def _reject_unknown(data: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(map(str, set(data) - allowed))  # str: YAML keys may be numbers, dates, ...
    if unknown:
        raise PlanningError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}. Fix or remove them")


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise PlanningError(f"{where} must be a mapping, got {type(value).__name__}; write it as key: value pairs, "
                            "as docs/cluster.md shows")
    return value


def parse_model(data: Any) -> ModelSpec:
    data = _mapping(data, "model")
    allowed = {f.name for f in fields(ModelSpec)}
    _reject_unknown(data, allowed, "model")
    for key in ("num_layers", "parameters"):
        if key not in data:
            raise PlanningError(f"model.{key} is required (the cost model is per layer); add it to the cluster file's "
                                "model: section")
    optional_ints = {k: _integer(data[k], f"model.{k}") for k in ("hidden_size", "seq_len") if data.get(k) is not None}
    return ModelSpec(
        name=str(data.get("name", "model")),
        num_layers=_integer(data["num_layers"], "model.num_layers"),
        parameters=_integer(data["parameters"], "model.parameters"),
        state_bytes_per_param=_number(data.get("state_bytes_per_param", 16), "model.state_bytes_per_param"),
        compute_bytes_per_param=_number(data.get("compute_bytes_per_param", 2), "model.compute_bytes_per_param"),
        grad_bytes_per_param=_number(data.get("grad_bytes_per_param", 4), "model.grad_bytes_per_param"),
        stash_bytes_per_sample=None if data.get("stash_bytes_per_sample") is None else
        _number(data["stash_bytes_per_sample"], "model.stash_bytes_per_sample"),
        kept_bytes_per_sample=None if data.get("kept_bytes_per_sample") is None else
        _number(data["kept_bytes_per_sample"], "model.kept_bytes_per_sample", strict=False),
        trainable_parameters=None if data.get("trainable_parameters") is None else
        _integer(data["trainable_parameters"], "model.trainable_parameters", minimum=0),
        weight_bytes_per_param=_number(data.get("weight_bytes_per_param", 4), "model.weight_bytes_per_param"),
        **optional_ints,
    )


def parse_settings(data: Any) -> Settings:
    if data is None:
        return Settings()
    data = _mapping(data, "settings")
    _reject_unknown(data, {f.name for f in fields(Settings)}, "settings")
    values: dict[str, Any] = {}
    for key in ("allgather_ms", "reduce_scatter_ms", "micro_batch_overhead_ms", "step_overhead_ms", "reserved_memory_gb"):
        if key in data:
            values[key] = _number(data[key], f"settings.{key}", strict=False)
    if "usable_memory_fraction" in data:
        frac = _number(data["usable_memory_fraction"], "settings.usable_memory_fraction")
        if frac > 1:
            raise PlanningError(f"settings.usable_memory_fraction must be <= 1, got {frac}: it is the share of each "
                                f"device's memory the plan may fill (e.g. 0.9)")
        values["usable_memory_fraction"] = frac
    for key in ("link_bandwidth_gbps", "inter_node_bandwidth_gbps"):
        if data.get(key) is not None:
            values[key] = _number(data[key], f"settings.{key}")
    if "inter_node_latency_ms" in data:
        values["inter_node_latency_ms"] = _number(data["inter_node_latency_ms"], "settings.inter_node_latency_ms",
                                                  strict=False)
    if "host_contention" in data:
        values["host_contention"] = _number(data["host_contention"], "settings.host_contention")
        if values["host_contention"] < 1:
            raise PlanningError(f"settings.host_contention must be >= 1 (1: no waiting for a core), got "
                                f"{values['host_contention']}; set it to 1 or more{CLUSTER_FILE}")
    if "estimated_mfu" in data:
        values["estimated_mfu"] = _number(data["estimated_mfu"], "settings.estimated_mfu")
    for key in ("uneven_slope", "optimizer_ns_per_param"):
        if data.get(key) is not None:
            values[key] = _number(data[key], f"settings.{key}", strict=False)
    if data.get("overlap") is not None:
        values["overlap"] = _fraction(data["overlap"], "settings.overlap",
                                      "1 = communication hidden behind compute, 0 = not at all")
    if "offload_stash" in data:
        values["offload_stash"] = _flag(data["offload_stash"], "settings.offload_stash")
    if "stash_on_device" in data:
        values["stash_on_device"] = _flag(data["stash_on_device"], "settings.stash_on_device")
    if "sync_passes" in data:
        values["sync_passes"] = _flag(data["sync_passes"], "settings.sync_passes")
    if "repeated_gather_fraction" in data:
        values["repeated_gather_fraction"] = _fraction(
            data["repeated_gather_fraction"], "settings.repeated_gather_fraction",
            "a uniform micro-batch's gather after the first, per the first's time (1: every gather alike)")
    if values.get("offload_stash") and values.get("stash_on_device"):
        raise PlanningError("settings.offload_stash and settings.stash_on_device are both true, but the stash is "
                            "either copied to the host or kept on the device; set one of them to false")
    if data.get("host_cores") is not None:
        values["host_cores"] = _number(data["host_cores"], "settings.host_cores")
    if "host_copy_gbps" in data:
        values["host_copy_gbps"] = _number(data["host_copy_gbps"], "settings.host_copy_gbps")
    if "collective" in data:
        if data["collective"] not in COLLECTIVE_MODES:
            raise PlanningError(f"settings.collective must be one of {COLLECTIVE_MODES}, got {data['collective']!r}: "
                                f"write collective: padded or collective: exact (the runtime's CephaloStrategy(collective=...))")
        values["collective"] = data["collective"]
    return Settings(**values)


_PROFILE_KEYS = ("layer_fwd_ms", "layer_bwd_ms", "compute_memory_gb")
_EXTRA_KEYS = ("activation_memory_gb", "optimizer_ns_per_param", "host_copy_gbps")  # optional with either
_DEVICE_KEYS = {"name", "count", "memory_gb", "source", "emulate", "node", *_PROFILE_KEYS, *_EXTRA_KEYS}


def _device_extras(entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The optional cost terms a device entry may carry, measured or estimated alike."""
    extras: dict[str, Any] = {}
    if entry.get("activation_memory_gb") is not None:
        extras["activation_memory_gb"] = _series(entry["activation_memory_gb"], f"{where}.activation_memory_gb",
                                                 strict=False)
    if entry.get("optimizer_ns_per_param") is not None:
        extras["optimizer_ns_per_param"] = _number(entry["optimizer_ns_per_param"],
                                                   f"{where}.optimizer_ns_per_param", strict=False)
    if entry.get("host_copy_gbps") is not None:
        extras["host_copy_gbps"] = _number(entry["host_copy_gbps"], f"{where}.host_copy_gbps")
    return extras


def _check_rank_count(entries: Sequence[Any]) -> None:
    """The ranks the entries' counts add up to stay within the planner's limit, checked before any entry
    is expanded (a count of 10**9 would otherwise fill the memory before the limit is seen)."""
    total = 0
    for i, entry in enumerate(entries):
        if isinstance(entry, Mapping):
            total += _integer(entry.get("count", 1), f"devices[{i}].count")
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
        node = _mapping(node, f"nodes[{n}]")
        _reject_unknown(node, {"devices"}, f"nodes[{n}]")
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
        nodes.append(None if value is None else _integer(value, f"devices[{i}].node", minimum=0))
    given = [i for i, n in enumerate(nodes) if n is not None]
    missing = [i for i, n in enumerate(nodes) if n is None and isinstance(data[i], Mapping)]
    if given and missing:
        raise PlanningError(f"devices{given} name a node but devices{missing} do not: give every entry a node: "
                            "(its host, 0, 1, ...) or none (one node)")
    return nodes


def parse_devices(data: Any, model: ModelSpec, settings: Settings, *, nodes: Any = None) -> tuple[DeviceProfile, ...]:
    """Devices from a ``devices:`` list (each entry may name its ``node``) or from a ``nodes:`` list."""
    from cephalo_lightning.planner.catalog import estimate_profile  # catalog needs parse-free types

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
        entry = _mapping(entry, where)
        _reject_unknown(entry, _DEVICE_KEYS, where)
        if "name" not in entry:
            raise PlanningError(f"{where}.name is required; name a catalog GPU (e.g. a100) or your device, with its "
                                "measured figures")
        name = str(entry["name"])
        count = _integer(entry.get("count", 1), f"{where}.count")
        emulate = parse_emulation_spec(entry.get("emulate"), f"{where}.emulate")
        given = [k for k in _PROFILE_KEYS if k in entry]
        if given and len(given) != len(_PROFILE_KEYS):
            missing = sorted(set(_PROFILE_KEYS) - set(given))
            raise PlanningError(f"{where} ({name}) gives {given} but not {missing}: give all three or none")
        if given:
            # each series may cover its own sizes 1..k and is extrapolated on its own (cost.PiecewiseLinear)
            fwd = _series(entry["layer_fwd_ms"], f"{where}.layer_fwd_ms", strict=True)
            bwd = _series(entry["layer_bwd_ms"], f"{where}.layer_bwd_ms", strict=True)
            mem = _series(entry["compute_memory_gb"], f"{where}.compute_memory_gb", strict=False)
            if "memory_gb" not in entry:
                raise PlanningError(f"{where} ({name}).memory_gb is required with a measured profile; add the device's "
                                    "memory in GiB, e.g. memory_gb: 80")
            source = str(entry.get("source", "emulated" if emulate else "measured"))
            if source not in PROFILE_SOURCES:
                raise PlanningError(f"{where}.source must be one of {PROFILE_SOURCES}, got {source!r}; write one of "
                                    "those or drop the key")
            device = DeviceProfile(
                name, _number(entry["memory_gb"], f"{where}.memory_gb"), fwd, bwd, mem, source, emulate
            )
        else:
            device = estimate_profile(name, model, settings, where=where)
            if "memory_gb" in entry:
                device = replace(device, memory_gb=_number(entry["memory_gb"], f"{where}.memory_gb"))
            device = replace(device, emulate=emulate)
        if node is not None and emulate is not None and emulate.node is not None and emulate.node != node:
            raise PlanningError(f"{where} ({name}) is in node {node} but its emulate.node is {emulate.node}: the "
                                "planner would price one topology while the emulation slows the links of another; "
                                "make them equal (node: is what the planner prices, emulate.node the links the emulation slows)")
        device = replace(device, **_device_extras(entry, where), node=node)
        devices.extend([device] * count)
    return tuple(devices)


def cluster_from_dict(data: Any) -> Cluster:
    data = _mapping(data, "cluster file")
    _reject_unknown(data, {"model", "settings", "devices", "nodes", "calibration"}, "cluster file")
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
        "source": device.source,
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
    if not settings.get("step_overhead_ms"):
        settings.pop("step_overhead_ms", None)  # files written before the terms existed read the same
    for term in ("host_contention", "repeated_gather_fraction"):
        if settings.get(term) == 1.0:
            settings.pop(term, None)
    if not settings.get("inter_node_latency_ms"):
        settings.pop("inter_node_latency_ms", None)
    for flag in ("stash_on_device", "sync_passes"):
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
