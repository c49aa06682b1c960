"""The planner at 64 GPUs and a global batch of 4096 (its time is checked by ``benchmarks/wall_clock_checks.py
planner``), and its benchmark returns rows."""

from __future__ import annotations

from cephalo_lightning.planner import load_cluster, plan
from tests.planner_cases import CLUSTERS, check_plan


def test_64_gpus_at_4096_plan_in_under_a_second() -> None:
    """A valid plan; how long it takes is checked by ``benchmarks/wall_clock_checks.py planner``."""
    cluster = load_cluster(CLUSTERS / "hetero-64.yaml")
    assert cluster.world_size == 64 and len(set(cluster.devices)) == 4
    check_plan(cluster, plan(cluster, 4096), 4096)


def test_benchmark_returns_rows() -> None:
    from benchmarks.bench_planner import run_benchmark

    rows = run_benchmark(sizes=(4, 16), batches=(64,), repeats=1)
    assert [(r["gpus"], r["global_batch"]) for r in rows] == [(4, 64), (16, 64)]
    for r in rows:
        assert r["plan_s"] > 0 and 0 < r["fraction_of_upper_bound"] <= 1
        assert r["speedup_vs_even"] is None or r["speedup_vs_even"] >= 1 - 1e-3
