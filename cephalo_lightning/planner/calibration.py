"""The cluster file's ``calibration:`` block: cost-model terms measured on a run, and how they apply.

The profile measures each layer alone; a training step also pays what no single layer shows: the
framework's per-step work, each extra micro-batch's overhead as run, the collectives as the run
issues them (and how much of them hides behind compute), and ranks competing for a shared host.
:func:`cephalo_lightning.planner.fit.fit_calibration` fits these from a run's measured spans; this
module holds the fitted terms and folds them into an ordinary cluster, so the cost model, the
solver (and its certified gap) and ``python -m cephalo_lightning plan`` all price the run as run::

    step_i = step_overhead_ms + host_contention x (cost model with, for rank i,
             F, B and the optimizer step scaled by compute_scale[i],
             c = micro_batch_overhead_ms, AG = allgather_ms, RS = reduce_scatter_ms, overlap = overlap)

``host_contention`` (>= 1) is measured, not fitted: the wall time of the ranks' compute regions per
second of their contention-free busy time (ranks of one host waiting for its cores); 1 on a GPU.

The collective terms (AG, RS, overlap) are a layer's collectives as run in one pass, the ranks'
wait for each other at the layer included: what a layer's first gather in a pass costs beyond the
profiled transfer is that wait, which comes once per pass whatever the mode (layered mode gathers a
layer once per pass, uniform mode once per micro-batch). A uniform micro-batch's later gathers of
the layer cost the profiled transfer (``settings.repeated_gather_fraction``, the profiled gather
over the fitted one, at most 1), so a calibration fitted on either mode's steps prices the other's.
The groupings differ in what they move and over which links (one group of every rank gathers and
reduce-scatters, groups of one rank all-reduce, a group per node gathers inside the node and reduces
across), so a calibration fitted under one grouping (``shard_groups``) prices that grouping's
collectives; a plan of another keeps the profile's, which no step of it corrected.

A cluster without the block is priced exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from cephalo_lightning.planner.errors import PlanningError

if TYPE_CHECKING:
    from cephalo_lightning.planner.cluster import Cluster, Settings

CALIBRATION_SOURCES = ("measured", "emulated")
FITTED_ZERO_MS = 1e-6  # a fitted collective time of 0 on a cluster of several nodes (see calibrated)
_TERMS = ("step_overhead_ms", "micro_batch_overhead_ms", "allgather_ms", "reduce_scatter_ms", "overlap")


@dataclass(frozen=True)
class Calibration:
    """Terms fitted on measured steps (times in ms; compute_scale per rank, 1 = as profiled)."""

    step_overhead_ms: float
    micro_batch_overhead_ms: float
    allgather_ms: float  # one layer, even shares, as run
    reduce_scatter_ms: float
    overlap: float
    compute_scale: tuple[float, ...]
    host_contention: float = 1.0  # wall per busy second while computing: ranks waiting for a shared host's cores
    steps: int = 0  # measured steps the fit used
    fitted_on: str = ""  # the plan(s) measured, e.g. "B=32 layered b=[20, 12]"
    source: str = "measured"
    mode: str | None = None  # the measured steps' mode (None: steps of both modes)
    shard_groups: tuple[int, ...] | None = None  # and their grouping, every rank's group (None: every grouping)

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {k: getattr(self, k) for k in _TERMS}
        data["compute_scale"] = list(self.compute_scale)
        data["host_contention"] = self.host_contention
        data.update(steps=self.steps, fitted_on=self.fitted_on, source=self.source)
        if self.mode is not None:
            data["mode"] = self.mode
        if self.shard_groups is not None:
            data["shard_groups"] = list(self.shard_groups)
        return data

    def prices_collectives_of(self, shard_groups: Sequence[int] | None = None) -> bool:
        """Whether the fitted collective terms price plans under ``shard_groups`` (every rank's group;
        None for either: the calibration's own)."""
        return self.shard_groups is None or shard_groups is None or same_grouping(shard_groups, self.shard_groups)


def same_grouping(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether two lists of every rank's group put the same ranks together (whatever the numbers)."""
    if len(a) != len(b):
        return False
    pairs = dict(zip(a, b))
    return len(pairs) == len(set(pairs.values())) and all(pairs[x] == y for x, y in zip(a, b))


def parse_calibration(data: Any, world_size: int) -> Calibration | None:
    """The block as written in a cluster file (None: absent)."""
    from cephalo_lightning.planner.cluster import _fraction, _integer, _mapping, _number, _reject_unknown, _series
    from cephalo_lightning.planner.cost import MODES

    if data is None:
        return None
    data = _mapping(data, "calibration")
    _reject_unknown(data, {*_TERMS, "compute_scale", "host_contention", "steps", "fitted_on", "source", "mode",
                           "shard_groups"}, "calibration")
    missing = [k for k in (*_TERMS, "compute_scale") if k not in data]
    if missing:
        raise PlanningError(f"calibration is missing {missing}; write the whole block as `fit_calibration` does, or "
                            "remove it to plan from the profile alone")
    values = {k: _number(data[k], f"calibration.{k}", strict=False) for k in _TERMS if k != "overlap"}
    scale = _series(data["compute_scale"], "calibration.compute_scale", strict=True)
    if len(scale) != world_size:
        raise PlanningError(f"calibration.compute_scale has {len(scale)} entries but the cluster has {world_size} ranks; "
                            "give one per rank (calibrate again after changing the devices)")
    contention = _number(data.get("host_contention", 1.0), "calibration.host_contention")
    if contention < 1:
        raise PlanningError(f"calibration.host_contention must be >= 1 (1: no rank waits for a core), got {contention}; "
                            "set it to 1 or more")
    source = str(data.get("source", "measured"))
    if source not in CALIBRATION_SOURCES:
        raise PlanningError(f"calibration.source must be one of {CALIBRATION_SOURCES}, got {source!r}; write one of those")
    mode = data.get("mode")
    if mode is not None and mode not in MODES:
        raise PlanningError(f"calibration.mode must be one of {MODES} (the mode of the steps it was fitted on), got "
                            f"{mode!r}; write one of those, or leave it out")
    groups = data.get("shard_groups")
    if groups is not None:
        if not isinstance(groups, list) or len(groups) != world_size:
            raise PlanningError(f"calibration.shard_groups must list every rank's group ({world_size} entries, e.g. "
                                f"{[0] * world_size} for one group), got {groups!r}; write the fitted plan's groups, or "
                                "leave it out to price every grouping's collectives with it")
        groups = tuple(_integer(g, f"calibration.shard_groups[{i}]", minimum=0) for i, g in enumerate(groups))
    return Calibration(
        **values, overlap=_fraction(data["overlap"], "calibration.overlap", "the overlap achieved"),
        compute_scale=scale, host_contention=contention, steps=_integer(data.get("steps", 0), "calibration.steps", minimum=0),
        fitted_on=str(data.get("fitted_on", "")), source=source, mode=mode, shard_groups=groups)


def calibrated(cluster: Cluster, shard_groups: Sequence[int] | None = None) -> Cluster:
    """The cluster with its calibration folded into profiles and settings (itself when it has none),
    to price plans under ``shard_groups`` (None: the calibration's own; another grouping keeps the
    profile's collective terms, see the module).

    Ranks with the same profile and the same scale keep one profile object, so the solver still
    groups them into one kind. The result carries no calibration: folding twice changes nothing.
    """
    cal = cluster.calibration
    if cal is None:
        return cluster
    s = cluster.settings
    folded: dict[tuple[Any, float], Any] = {}
    devices = []
    for device, scale in zip(cluster.devices, cal.compute_scale):
        key = (device, scale)
        if key not in folded:
            ns = device.optimizer_ns_per_param
            ns = s.optimizer_ns_per_param if ns is None else ns
            folded[key] = replace(
                device, layer_fwd_ms=tuple(v * scale for v in device.layer_fwd_ms),
                layer_bwd_ms=tuple(v * scale for v in device.layer_bwd_ms),
                optimizer_ns_per_param=None if ns is None else ns * scale)
        devices.append(folded[key])
    settings = replace(s, step_overhead_ms=cal.step_overhead_ms, micro_batch_overhead_ms=cal.micro_batch_overhead_ms,
                       host_contention=cal.host_contention)
    if cal.prices_collectives_of(shard_groups):
        settings = _fitted_collectives(cluster, settings, cal)
    return replace(cluster, devices=tuple(devices), settings=settings, calibration=None)


def _fitted_collectives(cluster: Cluster, settings: Settings, cal: Calibration) -> Settings:
    """``settings`` with the calibration's collective terms in place of the profile's (and a uniform
    micro-batch's later gathers at the profiled transfer, see the module)."""
    from cephalo_lightning.planner.cost import communication, link_prices  # the cost model builds on this module

    s = cluster.settings
    profile = replace(cluster, calibration=None)
    # The fitted AG / RS are the world's figures. On one node no bandwidth is wanted beside them (a
    # fitted 0 would read as "derive from the bandwidth"). Across nodes the bandwidths stay, so a group
    # inside a node is still priced on the faster link; a fitted 0 is kept as 1 ns, read as measured.
    # Both bandwidths scale by how the world's reduce-scatter ran against its profile, so the
    # cross-group reduction, priced on the inter-node bandwidth, follows the fit as the rest does.
    spans = cluster.num_nodes > 1
    floor = FITTED_ZERO_MS if spans else 0.0
    rs = max(cal.reduce_scatter_ms, floor)
    links = {"link_bandwidth_gbps": None}
    if spans:
        profiled = link_prices(profile).reduce_scatter_ms
        speed = profiled / rs if profiled > 0 else 1.0
        links = {name: None if value is None else value * speed
                 for name, value in (("link_bandwidth_gbps", s.link_bandwidth_gbps),
                                     ("inter_node_bandwidth_gbps", s.inter_node_bandwidth_gbps))}
    ag = max(cal.allgather_ms, floor)
    # the fit scales the world's gather as the profile prices it (communication), so does this ratio
    repeated = min(1.0, communication(profile).allgather_ms / ag) if ag > 0 else 1.0
    return replace(settings, allgather_ms=ag, reduce_scatter_ms=rs, overlap=cal.overlap,
                   repeated_gather_fraction=repeated, **links)


def with_calibration(cluster: Cluster, calibration: Calibration | None) -> Cluster:
    """The same profile with ``calibration`` (None: the profile alone)."""
    if calibration is not None and len(calibration.compute_scale) != cluster.world_size:
        raise PlanningError(f"a calibration of {len(calibration.compute_scale)} ranks cannot apply to a cluster of "
                            f"{cluster.world_size}; calibrate on this cluster")
    return replace(cluster, calibration=calibration)


def describe(calibration: Calibration, width: int = 3) -> str:
    """One line naming the fitted terms."""
    scales = ", ".join(f"{v:.{width - 1}f}" for v in calibration.compute_scale)
    groups = f" (the collectives of groups {list(calibration.shard_groups)})" if calibration.shard_groups is not None else ""
    return (f"per step +{calibration.step_overhead_ms:.1f} ms, per extra micro-batch {calibration.micro_batch_overhead_ms:.2f} "
            f"ms/layer, AG {calibration.allgather_ms:.3f} / RS {calibration.reduce_scatter_ms:.3f} ms/layer, overlap "
            f"{calibration.overlap:.2f}{groups}, compute x[{scales}], host contention x{calibration.host_contention:.2f} ({calibration.source}, {calibration.steps} steps)")

