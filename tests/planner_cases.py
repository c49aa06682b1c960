"""The planner's test cases, shared by its test files: random small clusters (a measured-style profile
with noise; grouped ones on one node or two), the shipped example clusters, a small valid cluster to
break one field of, the calibration tests' three-rank cluster and the terms they inject, and
:func:`check_plan`, which checks a plan against the independent formulas of ``tests/planner_reference.py``."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from cephalo_lightning.planner import Cluster, Plan, cluster_from_dict, evaluate
from cephalo_lightning.planner.schema.calibration_terms import Calibration
from tests.planner_reference import memory_ok, rank_times

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = ROOT / "configs" / "clusters"
FULL = ("full",)  # one shard group of every rank, which brute_force enumerates


PRICES = ("link_bandwidth", "link_bandwidth_gbps", "inter_node_bandwidth", "inter_node_bandwidth_gbps", "allgather_ms",
          "reduce_scatter_ms")


def free_unless_priced(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with ``free_links`` where no key prices the links: the brute-force cases weigh
    compute and memory alone unless they give the collectives a price, and say so."""
    return settings if any(settings.get(key) for key in PRICES) else {**settings, "free_links": True}


def random_device(rng: random.Random) -> dict[str, Any]:
    """A measured-style profile with noise (sometimes non-monotone, to exercise the running max)."""
    k = rng.randint(1, 4)
    first = rng.uniform(2, 20)
    fwd, v = [], first
    for _ in range(k):
        fwd.append(v)
        v += rng.uniform(-0.3, 1.2) * first
    bwd = [x * rng.uniform(1.5, 2.5) for x in fwd]
    per = rng.uniform(0.3, 3)
    mem, v = [], rng.uniform(0.2, 2) + per
    for _ in range(k):
        mem.append(v)
        v += per * rng.uniform(0.5, 1.5)
    return {"name": f"gpu{rng.randint(0, 99)}", "memory_gb": rng.choice([8, 12, 16, 24, 40]), "layer_fwd_ms": fwd,
            "layer_bwd_ms": bwd, "compute_memory_gb": mem, "count": rng.choice([1, 1, 1, 2])}


def random_cluster(rng: random.Random, world: int) -> Cluster:
    devices: list[dict[str, Any]] = []
    while sum(d["count"] for d in devices) < world:
        devices.append(random_device(rng))
    devices[-1]["count"] -= sum(d["count"] for d in devices) - world
    return random_around(rng, devices)


def random_around(rng: random.Random, devices: list[dict[str, Any]], collectives: float = 0.5) -> Cluster:
    """``devices`` in a cluster of random settings and model (measured collectives with chance ``collectives``)."""
    settings: dict[str, Any] = {"usable_memory_fraction": rng.uniform(0.7, 1.0),
                                "reserved_memory_gb": rng.uniform(0, 2),
                                "micro_batch_overhead_ms": rng.choice([0, 2, 10])}
    if rng.random() < collectives:  # collectives that matter, and that grow with the largest share
        settings["allgather_ms"] = rng.uniform(0, 30)
        settings["reduce_scatter_ms"] = rng.uniform(0, 30)
    model = {"name": "m", "num_layers": rng.randint(1, 8), "parameters": int(rng.uniform(0.05, 2.0) * 1e9)}
    return cluster_from_dict({"model": model, "settings": free_unless_priced(settings), "devices": devices})


def check_plan(cluster: Cluster, p: Plan, global_batch: int) -> None:
    """Sums, every rank's memory (by the independent formulas), and the recorded predictions."""
    assert sum(p.batch_sizes) == global_batch
    assert abs(sum(p.state_shares) - 1) < 1e-9
    assert all(r.state_share >= 0 and r.batch_size >= 0 for r in p.ranks)
    keep = [not r.recompute for r in p.ranks]
    assert all(memory_ok(cluster, p.batch_sizes, p.num_micro_batches, p.state_shares, keep, p.mode))
    assert all(c.fits for c in evaluate(cluster, p.batch_sizes, p.num_micro_batches, p.state_shares,
                                        [r.recompute for r in p.ranks], p.mode))
    times = rank_times(cluster, p.batch_sizes, p.num_micro_batches, p.state_shares, keep, p.mode)
    assert p.predicted_step_s == pytest.approx(max(times), rel=1e-9)
    for r, t in zip(p.ranks, times):
        assert r.predicted_step_s == pytest.approx(t, rel=1e-9)
        assert r.predicted_memory_gb <= r.memory_limit_gb * (1 + 1e-9)


def small_cluster(**changes: Any) -> dict[str, Any]:
    data = {"model": {"name": "m", "num_layers": 4, "parameters": 100_000_000},
            "devices": [{"name": "a", "memory_gb": 16, "layer_fwd_ms": [5, 9], "layer_bwd_ms": [10, 18],
                         "compute_memory_gb": [1, 1.5], "count": 2},
                        {"name": "b", "memory_gb": 24, "layer_fwd_ms": [9], "layer_bwd_ms": [18],
                         "compute_memory_gb": [2]}]}
    for key, value in changes.items():
        data[key] = value
    data["settings"] = free_unless_priced(dict(data.get("settings") or {}))
    return data


def yaml_dict(name: str) -> dict[str, Any]:
    return yaml.safe_load((CLUSTERS / name).read_text())


def random_grouped_cluster(rng: random.Random, world: int):
    """A small random cluster, on one node (collectives measured or from a bandwidth) or on two
    (bandwidths per link class): the extended brute force prices all of them."""
    devices = []
    for _ in range(world):
        k = rng.randint(1, 3)
        first = rng.uniform(2, 20)
        fwd = [first * (1 + i * rng.uniform(0.6, 1.2)) for i in range(k)]
        per = rng.uniform(0.3, 3)
        devices.append({"name": f"gpu{rng.randint(0, 3)}", "memory_gb": rng.choice([8, 12, 16, 24, 40]),
                        "layer_fwd_ms": fwd, "layer_bwd_ms": [x * rng.uniform(1.5, 2.5) for x in fwd],
                        "compute_memory_gb": [rng.uniform(0.2, 1) + per * (i + 1) for i in range(k)]})
    settings: dict[str, Any] = {"usable_memory_fraction": rng.uniform(0.7, 1.0), "reserved_memory_gb": rng.uniform(0, 2),
                                "micro_batch_overhead_ms": rng.choice([0, 2, 10]),
                                "overlap": rng.choice([0.0, 0.5, 1.0])}
    two_nodes = world >= 2 and rng.random() < 0.6
    if two_nodes:
        split = rng.randint(1, world - 1)
        for i, d in enumerate(devices):
            d["node"] = 0 if i < split else 1
        settings["link_bandwidth_gbps"] = rng.uniform(5, 100)
        settings["inter_node_bandwidth_gbps"] = rng.uniform(0.2, 5)
        settings["inter_node_latency_ms"] = rng.choice([0.0, 0.5])
    elif rng.random() < 0.5:
        settings["allgather_ms"] = rng.uniform(0, 30)
        settings["reduce_scatter_ms"] = rng.uniform(0, 30)
    else:
        settings["link_bandwidth_gbps"] = rng.uniform(0.5, 20)
    model = {"name": "m", "num_layers": rng.randint(1, 6), "parameters": int(rng.uniform(0.02, 1.0) * 1e9)}
    return cluster_from_dict({"model": model, "settings": settings, "devices": devices})


def calibration_device(name: str, fwd_ms: float, memory_gb: float) -> dict[str, Any]:
    return {"name": name, "memory_gb": memory_gb, "layer_fwd_ms": [fwd_ms * k for k in (1.0, 1.9, 2.7, 3.6)],
            "layer_bwd_ms": [fwd_ms * k for k in (2.0, 3.8, 5.5, 7.2)], "compute_memory_gb": [0.5, 0.8, 1.1, 1.4],
            "optimizer_ns_per_param": 0.2}


def calibration_cluster() -> dict[str, Any]:
    """Three ranks whose collectives outweigh a one-sample layer (so the collectives and the overlap
    show apart in the step) and whose memory makes plans differ in batch, micro-batches and mode."""
    return {"model": {"name": "m", "num_layers": 4, "parameters": 10_000_000},
            "settings": {"reserved_memory_gb": 0, "usable_memory_fraction": 1.0, "micro_batch_overhead_ms": 1.0,
                         "allgather_ms": 6.0, "reduce_scatter_ms": 6.0, "overlap": 0.6},
            "devices": [calibration_device("a", 2.0, 4), calibration_device("b", 5.0, 4), calibration_device("c", 3.0, 2.0)]}


INJECTED = Calibration(step_overhead_ms=40.0, micro_batch_overhead_ms=2.5, allgather_ms=9.0, reduce_scatter_ms=9.0,
                       overlap=0.3, compute_scale=(1.3, 0.9, 1.6), host_contention=1.25)
