"""The cluster as the planner sees it: the model, the cost model's settings and every rank's device.

Value types only (frozen dataclasses); reading, validating and writing them as a cluster file is
:mod:`cephalo_lightning.planner.schema.cluster`. A device either carries measured per-layer profiles or
an estimate from the GPU catalog (:mod:`cephalo_lightning.planner.schema.catalog`); devices are listed in
rank order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cephalo_lightning._common.vocabulary import Collective, ProfileSource, hold_member
from cephalo_lightning.planner.schema.calibration_terms import Calibration
from cephalo_lightning.planner.schema.planning_error import PlanningError

# The overlap the cost model assumes where none was measured (no profile, no calibration):
# collectives serial with compute, ``AG + F``.
# [Note: an unmeasured overlap] comb(comm, compute) = max + (1 - overlap) min grows as the overlap
# falls, so pricing an unmeasured overlap at 0 makes every predicted step an upper bound over the
# overlaps a runtime may reach: a plan never looks faster than it runs for want of a measurement.
# 0 is also the only overlap measured here (gloo on CPU: docs/fidelity.md); NCCL's side streams hide
# more, which the profiler measures (``time_overlap``) and writes as ``settings.overlap``.
UNMEASURED_OVERLAP = 0.0


@dataclass(frozen=True)
class ModelSpec:
    """The model as the cost model sees it: a stack of identical layers and a parameter count.

    ``parameters`` counts every parameter (what the all-gathers move and the shards store);
    ``trainable_parameters`` (None: all of them) the ones with gradients and optimizer state. The
    sharded training state is::

        state_bytes = state_bytes_per_param * trainable + weight_bytes_per_param * (parameters - trainable)

    a trainable parameter holds its weight, gradient and optimizer moments (``state_bytes_per_param``,
    16 for fp32 AdamW), a frozen one (LoRA's base model, frozen embeddings) only its stored weight
    (``weight_bytes_per_param``: what its storage holds, 2 for a base in bf16, 4 in fp32). Only the
    trainable parameters are reduced: a reduce-scatter moves and holds the trainable part of a unit.
    """

    name: str
    # the layers the layered schedule runs, as profiling counts them (a Hugging Face causal LM: the
    # embedding, every block, the norm with the head); a pipelined plan's stage_layers cover them
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
    weight_bytes_per_param: float = 4.0  # bytes of a frozen parameter's stored shard (its storage's: bf16 2, fp32 4)
    # the largest unit's parameters, frozen ones included (measured by the profiler; absent:
    # parameters / num_layers)
    largest_unit_parameters: int | None = None
    # the largest unit's trainable parameters: the part its reduce-scatter moves and holds this rank's
    # share of (measured by the profiler; absent: largest_unit_parameters, a unit reduced whole)
    largest_reduced_parameters: int | None = None

    def __post_init__(self) -> None:
        if self.trainable_parameters is not None and not 0 <= self.trainable_parameters <= self.parameters:
            raise PlanningError(f"model.trainable_parameters ({self.trainable_parameters:,}) must be between 0 and "
                                f"model.parameters ({self.parameters:,}, every parameter, frozen ones included); "
                                "fix it in the cluster file")
        if self.largest_reduced_parameters is not None and not 0 <= self.largest_reduced_parameters <= self.parameters:
            raise PlanningError(f"model.largest_reduced_parameters ({self.largest_reduced_parameters:,}) must be between "
                                f"0 and model.parameters ({self.parameters:,}); fix it in the cluster file or leave it "
                                "out (the largest unit's parameters are used)")
        if self.largest_unit_parameters is not None and not 0 < self.largest_unit_parameters <= self.parameters:
            raise PlanningError(f"model.largest_unit_parameters ({self.largest_unit_parameters:,}) must be between 1 and "
                                f"model.parameters ({self.parameters:,}); fix it in the cluster file or leave it out "
                                "(the layers' mean is used)")

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
    def share_terms(self) -> str:
        """What one whole share costs (``state_bytes + reduction_bytes_per_share``) spelled out, for messages."""
        return (f"{self.state_terms} + the reduce-scatter's 2 x {self.reduced_unit_parameters:,.0f} parameters x "
                f"{self.grad_bytes_per_param:g} bytes")

    @property
    def gathered_bytes_per_param(self) -> float:
        """Bytes an all-gather moves per parameter, the mean over the model: a trainable one in the
        compute dtype, a frozen one as stored where that is smaller (an NF4 base's 4-bit bytes and
        scales), else in the compute dtype."""
        frozen_bytes = min(self.weight_bytes_per_param, self.compute_bytes_per_param)
        return (self.compute_bytes_per_param * self.trainable + frozen_bytes * self.frozen) / self.parameters

    @property
    def layer_parameters(self) -> float:
        return self.parameters / self.num_layers

    @property
    def layer_trainable_parameters(self) -> float:
        """A layer's trainable parameters (the layers' mean): what its reduce-scatter moves."""
        return self.trainable / self.num_layers

    @property
    def reduced_unit_parameters(self) -> float:
        """The unit whose reduction the memory model prices: the largest trainable part, measured, else
        the largest unit whole, else the layers' mean."""
        if self.largest_reduced_parameters is not None:
            return self.largest_reduced_parameters
        return self.largest_unit_parameters or self.layer_parameters

    @property
    def reduction_bytes_per_share(self) -> float:
        """Bytes a unit's reduce-scatter holds per unit of a rank's share, beside the unit's flat gradient
        (which compute memory counts), of the largest unit: two shards, the exact one's receive buffer and
        sum, the padded one's sum and the copy of this rank's range (a shard more than the exact one
        holds where every parameter trains: its sum is then the rank's gradient, in ``state_bytes``)."""
        return 2 * self.reduced_unit_parameters * self.grad_bytes_per_param

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
    collective: Collective = Collective.PADDED  # how the runtime moves uneven shards
    estimated_mfu: float = 0.4  # for catalog estimates only
    # None below: measured by the profiler when it writes the cluster, else the cost model's default (collective_prices, device_cost)
    uneven_slope: float | None = None  # extra collective time per unit of imbalance (UNEVEN_SLOPE)
    # how much communication hides behind compute: 1 = max(AG, F), 0 = AG + F; None: not measured,
    # priced at UNMEASURED_OVERLAP (0, an upper bound on the step); the profiler measures it
    overlap: float | None = None
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
    # (their compute without emulated waits) spread over these cores (cluster_cost.shared_host_floor_ms)
    host_cores: float | None = None
    # ranks of one shard group end every layer's pass together (each pass's per-layer collectives wait
    # for the group's slowest rank), so a group's step is L x (its slowest forward + its slowest
    # backward), not its slowest rank's sum (cluster_cost.synced_group_ms); the profiler sets it. False: the
    # per-rank sum alone (files written before it price as before)
    sync_passes: bool = False
    # uniform mode gathers every layer once per micro-batch; a gather after the first of a layer's pass
    # costs this fraction of the first, which also holds the ranks' wait for each other at the layer
    # (a calibration sets it: the profiled gather over the fitted one). 1: every gather as the first
    repeated_gather_fraction: float = 1.0
    # collectives cost nothing: a what-if of compute and memory alone, chosen by a person (the plan's
    # output says so). A cluster whose collectives have no price (no link bandwidth, no measured
    # allgather_ms / reduce_scatter_ms, no calibration) is refused unless this says so
    free_links: bool = False

    def __post_init__(self) -> None:
        hold_member(self, "collective", Collective, PlanningError, "write collective: padded or collective: exact")

    @property
    def priced_overlap(self) -> float:
        """The overlap the cost model prices: the measured one, else :data:`UNMEASURED_OVERLAP`."""
        return UNMEASURED_OVERLAP if self.overlap is None else self.overlap


@dataclass(frozen=True)
class Emulation:
    """CPU emulation of a slower or smaller device (see ``cephalo_lightning.runtime.emulation.emulator``),
    optionally on an emulated node whose links to the other nodes are slowed
    (``cephalo_lightning.runtime.emulation.links``)."""

    slowdown: float = 1.0
    memory_gb: float | None = None
    node: int | None = None  # the emulated node this rank is in (None: the links are not emulated)
    inter_node_gbps: float | None = None  # GB/s per direction per rank over the link between emulated nodes


@dataclass(frozen=True)
class DeviceProfile:
    """One rank's device: capacity and one layer's measured (or estimated) costs at sizes 1..k."""

    name: str
    memory_gb: float
    layer_fwd_ms: tuple[float, ...]
    layer_bwd_ms: tuple[float, ...]
    compute_memory_gb: tuple[float, ...]
    source: ProfileSource = ProfileSource.MEASURED
    emulate: Emulation | None = None
    # GiB the autograd graph of the WHOLE model's forward holds at micro-batch sizes 1..k, beyond
    # compute_memory_gb: what a rank keeping its graph (no recompute, the uniform mode) also holds
    activation_memory_gb: tuple[float, ...] | None = None
    optimizer_ns_per_param: float | None = None  # optimizer step time per state parameter owned
    host_copy_gbps: float | None = None  # device <-> pinned host copy bandwidth
    node: int | None = None  # the node (host) it is in; None on every device: one node

    def __post_init__(self) -> None:
        hold_member(self, "source", ProfileSource, PlanningError, "write one of those")


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
        return any(d.source == ProfileSource.EMULATED for d in self.devices)

    @property
    def nodes(self) -> tuple[int, ...]:
        """Every rank's node (0 everywhere when no device names one)."""
        return tuple(0 if d.node is None else d.node for d in self.devices)

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))
