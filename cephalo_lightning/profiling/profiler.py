"""Profile every rank's device and gather the results into the planner's :class:`Cluster`.

Run :func:`profile_cluster` (or :class:`ClusterProfiler`) on every rank, with collectives working
and before the model is sharded. Each rank:

1. tells the others its device name, host and emulation spec;
2. looks for a cached cluster file keyed by a fingerprint of the model and the cluster
   (:mod:`.cache`); rank 0 reads it and shares it, so a restart does not profile again;
3. measures its device (:func:`~.model.profile_model`): every distinct layer's forward and
   backward time and compute memory at micro-batch sizes 1..k, under its emulator. Ranks with the
   same device name and emulation spec (and, on CPU, the same host) may share one measurement;
   on CPU the measuring ranks take turns by default, step by step (:mod:`.turns`), because they
   share the host's cores and would otherwise measure each other;
4. times one unit's all-gather and reduce-scatter with every rank (:mod:`.collectives`) and, when
   the ranks span nodes (:mod:`.topology`: emulated nodes, the launcher's node ranks, host names),
   the links within and between nodes;
5. gathers the device profiles and returns the cluster, identical on every rank; rank 0 writes it
   to the cache (the planner's cluster file format, for offline re-planning).

Capacities: the emulated ``memory_gb``; else the CUDA device's total memory; else (CPU, no
emulation) the host's RAM divided by the ranks on that host. Figures from an emulated rank are
marked ``source: emulated`` and carry the spec, so everything downstream can say so.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cephalo_lightning._common.errors import ConfigurationError, UnsupportedError
from cephalo_lightning.planner.schema.cluster import cluster_from_dict, cluster_to_dict
from cephalo_lightning.planner.schema.cluster_spec import Cluster, Settings
from cephalo_lightning.profiling.cache import cache_path, fingerprint, read_cached, structure, write_cached
from cephalo_lightning.profiling.collective_timing import (
    CollectiveProfile,
    skewed_shares,
    time_collectives,
    time_overlap,
)
from cephalo_lightning.profiling.devices import (
    RankIdentity,
    _cuda_total_gb,
    capacity_gb,
    default_device,
    default_settings,
    device_name,
    device_profiles,
    host_memory_gb,
    measured_settings,
    shared_host_cores,
)
from cephalo_lightning.profiling.model import ModelHooks, ModelProfile, Pacing, profile_model
from cephalo_lightning.profiling.model_description import ModelDescription
from cephalo_lightning.profiling.optimizer import time_optimizer_step
from cephalo_lightning.profiling.options import ProfileOptions
from cephalo_lightning.profiling.profiling_error import ProfilingError
from cephalo_lightning.profiling.progress import ProfileProgress
from cephalo_lightning.profiling.topology import LinkProfile, Topology, find_nodes, node_clue, time_links
from cephalo_lightning.profiling.turns import TurnTaker
from cephalo_lightning.runtime.distributed import broadcast_object, gather_objects, rank_and_size
from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator, EmulationSpec, parse_emulation_specs
from cephalo_lightning.runtime.emulation.links import EmulatedLinks, links_from_emulation
from cephalo_lightning.runtime.layered import Layer

log = logging.getLogger(__name__)

@dataclass
class ProfileReport:
    """What a profiling run produced, for logs and the callback."""

    cluster: Cluster
    cache_file: Path | None  # where the cluster file is (rank 0 wrote or read it); None without a cache
    from_cache: bool
    seconds: float
    measured_by: tuple[int, ...]  # for every rank, the rank whose measurement it uses
    local: ModelProfile | None = None  # this rank's own measurement, if it measured
    collectives: CollectiveProfile | None = None
    topology: Topology | None = None  # every rank's node and what told it
    links: LinkProfile | None = None  # the links within and between nodes, when the ranks span nodes


# --------------------------------------------------------------------------------------------
# the profiler


class _LayerTurns:
    """A fresh :class:`TurnTaker` per layer of a sharded model: ``with turns() as step``."""

    def __init__(self, rank: int, measuring: Sequence[int], group: dist.ProcessGroup | None) -> None:
        self.rank, self.measuring, self.group = rank, list(measuring), group

    def __call__(self) -> Any:
        import contextlib

        @contextlib.contextmanager
        def layer() -> Any:
            turns = TurnTaker(self.rank, self.measuring, self.group)
            try:
                yield turns if self.rank in self.measuring else None
            finally:
                turns.finish()

        return layer()


class ClusterProfiler:
    """Profiles this rank's device, gathers every rank's, and builds the planner's cluster.

    Args:
        layers: the model as its ordered layers (each takes and returns one tensor), e.g. a
            LightningModule's ``cephalo_layers()``; not modified (copies are profiled).
        sample_input: the first layer's input for a sample batch (e.g. ``cephalo_input(batch)``).
        model: what the layers cannot tell of the model (:class:`ModelDescription`: its name, whole
            parameter count, trainable ones, state bytes per parameter, hidden size, sequence length).
        hooks: how the model is driven beyond its layers (:class:`~cephalo_lightning.profiling.model.ModelHooks`):
            for a layered model (:class:`~cephalo_lightning.models.protocol.LayeredModel`) ``sample_input``
            is a sample batch, ``prepare(micro_batch) -> (first input, side)`` and ``loss(output,
            micro_batch, side)`` the model's own; ``unit_context(i)`` gathers layer i's unit of a sharded
            model (every rank takes part; the layers are then measured in place, one unit at a time);
            ``loss_fn(last_layer_output) -> loss`` measures the last layer with the loss behind it.
        emulator: this rank's :class:`DeviceEmulator`; and/or ``emulate``: every rank's spec (one
            per rank, all validated), from which this rank's emulator is built when none is given
            (when both are given they must agree).
        options: :class:`ProfileOptions`.
        settings: the cost model's settings (default :func:`default_settings`); the measured
            collective times replace ``allgather_ms`` / ``reduce_scatter_ms``.
        group: the process group (default: the world); single process works without one.
        device: where to compute (default: the current CUDA device, else the CPU).
        cache_dir: where cluster files are cached (``None``: no cache); ``force``: profile again.
        quiet: no progress bar and no log lines.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        sample_input: Any,
        model: ModelDescription = ModelDescription(),
        hooks: ModelHooks = ModelHooks(),
        *,
        emulator: DeviceEmulator | None = None,
        emulate: Sequence[EmulationSpec] | None = None,
        options: ProfileOptions | None = None,
        settings: Settings | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        cache_dir: str | Path | None = None,
        force: bool = False,
        quiet: bool = False,
    ) -> None:
        self.layers = list(layers)
        self.model = model
        self.hooks = hooks
        if not self.layers:
            raise ConfigurationError("ClusterProfiler needs the model's layers (e.g. cephalo_layers()); got none")
        if hooks.prepare is None and not isinstance(sample_input, torch.Tensor):
            raise UnsupportedError(f"sample_input must be a tensor (the first layer's input), got {type(sample_input).__name__}")
        self.sample_input = sample_input
        self.group = group
        self.rank, self.world_size = rank_and_size(group)
        if emulate is not None:
            specs = parse_emulation_specs(emulate, self.world_size)  # every rank's, so all fail alike
            if emulator is None:
                emulator = DeviceEmulator.from_spec(specs[self.rank], label=f"rank {self.rank}")
            elif emulator.spec != specs[self.rank]:
                raise ConfigurationError(
                    f"rank {self.rank}: the emulator given ({emulator.describe()}) does not match "
                    f"emulate[{self.rank}] = {specs[self.rank]}; pass one of them, or the same spec"
                )
        self.emulator = emulator or DeviceEmulator()
        self.options = options or ProfileOptions()
        self.device = torch.device(device) if device is not None else default_device()
        self.settings = settings if settings is not None else default_settings(self.device)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.force = force
        self.quiet = quiet

    # ------------------------------------------------------------------ pieces

    def _identity(self) -> RankIdentity:
        return RankIdentity(
            rank=self.rank, host=socket.gethostname(), name=device_name(self.device, self.emulator),
            emulate=self.emulator.spec, device_type=self.device.type, cuda_total_gb=_cuda_total_gb(self.device),
            host_memory_gb=host_memory_gb(),
        )

    def _compute_dtype(self) -> torch.dtype:
        if self.options.compute_dtype is not None:
            return self.options.compute_dtype
        for layer in self.layers:
            for module in (layer.modules if isinstance(layer, Layer) else (layer,)):
                for p in module.parameters():
                    if p.is_floating_point():
                        return p.dtype
        return torch.float32

    def _fingerprint(self, ids: Sequence[RankIdentity], topology: Topology) -> str:
        opts = self.options
        nodes = {"nodes": list(topology.nodes), "link_probe_bytes": opts.link_probe_bytes} \
            if topology.num_nodes > 1 else {}  # one node: the keys of files written before nodes existed
        return fingerprint({
            **nodes,
            "model": structure(self.layers, self.sample_input, opts.batch_dim),
            "sizes": list(range(1, opts.max_micro_batch + 1)),
            "world_size": self.world_size,
            "devices": [[i.name, i.host if i.device_type == "cpu" else ""] for i in ids],
            "emulation": [None if i.emulate is None else asdict(i.emulate) for i in ids],
            "options": {
                "compute_dtype": str(self._compute_dtype()), "prefetch": opts.prefetch,
                "resident_bytes": opts.resident_bytes, "measure_memory": opts.measure_memory,
                "batch_dim": opts.batch_dim, "collectives": opts.collectives, "modes": list(opts.collective_modes),
                "with_loss": self.hooks.loss_fn is not None,
            },
            "spec": self.model.cache_key(),
            "settings": asdict(self.settings),
        })

    def _leaders(self, ids: Sequence[RankIdentity]) -> list[int]:
        """For every rank, the rank that measures for it."""
        if not self.options.share_measurements:
            return list(range(len(ids)))
        first: dict[tuple[Any, ...], int] = {}
        leaders = []
        for i in ids:
            # an emulated node or link changes no compute: the same device on another node measures alike
            compute = i.emulate if i.emulate is None else replace(i.emulate, node=None, inter_node_gbps=None)
            key = (i.name, compute, i.host if i.device_type == "cpu" else "")
            leaders.append(first.setdefault(key, i.rank))
        return leaders

    def _measure(self, progress: ProfileProgress, turns: TurnTaker | None, layer_turns: _LayerTurns | None = None,
                 measure: bool = True) -> ModelProfile | None:
        pacing = Pacing(run_step=turns, layer_turns=layer_turns, on_progress=progress.rounds, measure=measure)
        return profile_model(self.layers, self.sample_input, self.options, device=self.device, emulator=self.emulator,
                             hooks=self.hooks, pacing=pacing)

    # ------------------------------------------------------------------ run

    def run(self) -> ProfileReport:
        """Profile (or reuse the cache) and return the report; every rank must call it."""
        started = time.perf_counter()
        ids: list[RankIdentity] = gather_objects(self._identity(), self.group)
        links = links_from_emulation([i.emulate for i in ids])  # every rank checks every rank's spec alike
        clues = gather_objects(node_clue(self.emulator.spec, os.environ, ids[self.rank].host), self.group)
        topology = find_nodes(clues)
        key = self._fingerprint(ids, topology)
        path = cache_path(self.cache_dir, key) if self.cache_dir is not None else None
        leaders = self._leaders(ids)
        talk = self.rank == 0 and not self.quiet

        if path is not None and not self.force:
            capacities = [capacity_gb(i, ids) for i in ids]
            cached = read_cached(path, self.world_size, capacities) if self.rank == 0 else None
            data = broadcast_object(cluster_to_dict(cached) if cached is not None else None, self.group)
            if data is not None:
                cluster = cluster_from_dict(data)
                if talk:
                    ProfileProgress.info("Cephalo: reusing the device profile %s (force=True profiles again)", path)
                return ProfileReport(cluster, path, True, time.perf_counter() - started, tuple(leaders),
                                     topology=topology)

        measuring = sorted(set(leaders))
        serialize = self.options.serialize if self.options.serialize is not None else self.device.type == "cpu"
        serialize = serialize and len(measuring) > 1
        with_comm = self.options.collectives and self.world_size > 1
        local: ModelProfile | None = None
        optimizer_ns: float | None = None
        failure: str | None = None
        with_links = with_comm and topology.num_nodes > 1
        link_profile: LinkProfile | None = None
        with ProfileProgress(enabled=talk, phases=1 + int(with_comm) + int(with_links)) as progress:
            progress.phase(
                f"profiling {len(measuring)} device(s) in turn" if serialize
                else f"profiling {len(measuring)} device(s)"
            )
            sharded = self.hooks.unit_context is not None
            # a sharded model: every rank follows the unit gathers; measuring ranks take turns per layer
            layer_turns = _LayerTurns(self.rank, measuring, self.group) if serialize and sharded else None
            turns = TurnTaker(self.rank, measuring, self.group) if serialize and not sharded else None
            try:
                if self.rank in measuring or sharded:
                    local = self._measure(progress, turns, layer_turns, measure=self.rank in measuring)
                    optimizer_ns = self._time_optimizer(turns, layer_turns, self.rank in measuring)
            except Exception as err:  # reported on every rank below, not left to hang the others
                failure = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
            finally:
                if turns is not None:
                    turns.finish()
            progress.phase_done()
            failures = gather_objects(failure, self.group)
            bad = [(r, f) for r, f in enumerate(failures) if f is not None]
            if bad:
                rank, message = bad[0]
                raise ProfilingError(f"profiling failed on rank {rank} ({ids[rank].name}): {message}")
            profiles: list[ModelProfile | None] = gather_objects(local, self.group)
            optimizer: list[float | None] = gather_objects(optimizer_ns, self.group)
            comm, overlap = None, None
            if with_comm:
                progress.phase("timing all-gather / reduce-scatter")
                comm, overlap = self._time_collectives(profiles[leaders[0]], links)
                progress.phase_done()
            if with_links:
                progress.phase(f"timing the links within and between {topology.num_nodes} nodes ({topology.source})")
                backend = dist.get_backend(self.group)
                link_profile = time_links(
                    topology, group=self.group, device=self.device if backend == "nccl" else torch.device("cpu"),
                    probe_bytes=self.options.link_probe_bytes, links=links, repeats=self.options.collective_repeats)
                progress.phase_done()

        cluster = self._cluster(ids, leaders, profiles, comm, optimizer, overlap, topology, link_profile)
        if path is not None and self.rank == 0:
            write_cached(cluster, path)
        seconds = time.perf_counter() - started
        if talk:
            ProfileProgress.info(
                "Cephalo: profiled %d rank(s) (%d measurement(s)) in %.1f s%s", self.world_size, len(measuring),
                seconds,
                f"; cluster file {path}" if path is not None else "",
            )
        return ProfileReport(cluster, path, False, seconds, tuple(leaders), local, comm, topology, link_profile)

    def _time_optimizer(self, turns: TurnTaker | None, layer_turns: _LayerTurns | None, measure: bool) -> float | None:
        """The optimizer step's time per state parameter, measured in turn like the layers."""
        def run(step: Any) -> float | None:
            return step(lambda: time_optimizer_step(self.device, self.emulator).ns_per_param) if measure else None

        if layer_turns is not None:  # every rank takes part in the turns; measuring ranks measure
            with layer_turns() as step:
                return run(step)
        return run(turns or (lambda fn: fn()))

    def _time_collectives(self, profile: ModelProfile | None, links: EmulatedLinks | None
                          ) -> tuple[CollectiveProfile, float]:
        """The even times, the uneven ones (for the slope), and the overlap with compute, over the
        world's links (emulated ones included: the planner scales the world's figures by link class)."""
        assert profile is not None  # rank 0 always measures or shares a leader's profile
        numel = math.ceil(sum(profile.layer_numels) / profile.num_layers)
        numel = max(self.world_size, math.ceil(numel / self.world_size) * self.world_size)  # an even unit
        backend = dist.get_backend(self.group)
        device = self.device if backend == "nccl" else torch.device("cpu")
        comm = time_collectives(
            numel, group=self.group, device=device, compute_dtype=self._compute_dtype(),
            modes=self.options.collective_modes, shares=skewed_shares(self.world_size),
            repeats=self.options.collective_repeats, links=links,
        )
        overlap = time_overlap(numel, group=self.group, device=self.device, emulator=self.emulator, links=links,
                               compute_dtype=self._compute_dtype(), mode=self.options.collective_modes[0],
                               repeats=self.options.collective_repeats)
        return comm, overlap

    def _cluster(
        self, ids: Sequence[RankIdentity], leaders: Sequence[int], profiles: Sequence[ModelProfile | None],
        comm: CollectiveProfile | None, optimizer: Sequence[float | None] | None = None,
        overlap: float | None = None, topology: Topology | None = None, link_profile: LinkProfile | None = None,
    ) -> Cluster:
        smooth = self.options.smooth if self.options.smooth is not None else self.device.type == "cpu"
        devices = device_profiles(ids, leaders, profiles, optimizer, smooth)
        if topology is not None and topology.num_nodes > 1:
            devices = tuple(replace(d, node=n) for d, n in zip(devices, topology.nodes))
        first = next(p for p in profiles if p is not None)
        model = self.model.spec(first, float(torch.empty((), dtype=self._compute_dtype()).element_size()))
        settings = measured_settings(self.settings, comm, self.options.collective_modes[0], overlap, link_profile)
        if settings.host_cores is None:  # ranks on one host's CPU cores compete for them
            settings = replace(settings, host_cores=shared_host_cores(ids))
        return Cluster(model=model, devices=devices, settings=settings)

def profile_cluster(layers: Sequence[nn.Module], sample_input: Any, model: ModelDescription = ModelDescription(),
                    hooks: ModelHooks = ModelHooks(), **kwargs: Any) -> Cluster:
    """Profile every rank and return the planner's :class:`Cluster`; call it on every rank.

    Takes :class:`ClusterProfiler`'s arguments (its ``run()`` gives the full report).
    """
    return ClusterProfiler(layers, sample_input, model, hooks, **kwargs).run().cluster
