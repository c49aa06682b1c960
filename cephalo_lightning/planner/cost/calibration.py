"""A cluster's calibration folded into it: cost-model terms measured on a run, and how they apply.

The profile measures each layer alone; a training step also pays what no single layer shows: the
framework's per-step work, each extra micro-batch's overhead as run, the collectives as the run
issues them (and how much of them hides behind compute), and ranks competing for a shared host.
:func:`cephalo_lightning.planner.cost.calibration_fit.fit_calibration` fits these from a run's measured spans
(:class:`~cephalo_lightning.planner.schema.calibration_terms.Calibration`); this module folds them into an
ordinary cluster, so the cost model, the solver (and its certified gap) and
``python -m cephalo_lightning plan`` all price the run as run::

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
from dataclasses import replace
from typing import Any

from cephalo_lightning.planner.cost.collective_prices import check_priced, communication, link_prices
from cephalo_lightning.planner.schema.calibration_terms import Calibration
from cephalo_lightning.planner.schema.cluster_spec import Cluster, Settings
from cephalo_lightning.planner.schema.planning_error import PlanningError

FITTED_ZERO_MS = 1e-6  # a fitted collective time of 0 on a cluster of several nodes (see calibrated)


def calibrated(cluster: Cluster, shard_groups: Sequence[int] | None = None) -> Cluster:
    """The cluster with its calibration folded into profiles and settings (itself when it has none),
    once its collectives have a price (:func:`.check_priced`), to price plans under ``shard_groups`` (None: the calibration's own; another grouping keeps the
    profile's collective terms, see the module).

    Ranks with the same profile and the same scale keep one profile object, so the solver still
    groups them into one kind. The result carries no calibration: folding twice changes nothing.
    """
    check_priced(cluster)
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
    # the fitted terms are the collectives' price as run: a profile planned with free links is priced now
    return replace(settings, allgather_ms=ag, reduce_scatter_ms=rs, overlap=cal.overlap,
                   repeated_gather_fraction=repeated, free_links=False, **links)


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

