"""Planner benchmark: wall time of `plan()` and the plan's predicted throughput vs the baselines.

    python benchmarks/bench_planner.py            # 4, 16, 64 GPUs x B = 64, 256, 1024, 4096
    python benchmarks/bench_planner.py --quick    # a smaller grid, for smoke tests

The clusters are the first 1, 4 or 16 GPUs of each of the 4 kinds in
``configs/clusters/hetero-64.yaml``. Throughput figures are PREDICTIONS of the planner's cost
model for that cluster file (catalog-estimated profiles), not measurements; the wall times are
real. ``run_benchmark()`` returns the rows as data for report scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

try:
    import cephalo_lightning  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cephalo_lightning.planner import Cluster, load_cluster, plan

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_FILE = ROOT / "configs" / "clusters" / "hetero-64.yaml"
SIZES = (4, 16, 64)
BATCHES = (64, 256, 1024, 4096)
QUICK_SIZES = (4, 16)
QUICK_BATCHES = (64, 256)


def subset(cluster: Cluster, gpus: int) -> Cluster:
    """The first gpus / kinds devices of every kind, kinds interleaved in file order."""
    kinds = list(dict.fromkeys(cluster.devices))
    per_kind = gpus // len(kinds)
    available = min(cluster.devices.count(k) for k in kinds)
    if per_kind < 1 or per_kind * len(kinds) != gpus or per_kind > available:
        raise ValueError(f"{gpus} GPUs is not a multiple of the {len(kinds)} kinds up to {available} each")
    return replace(cluster, devices=tuple(k for k in kinds for _ in range(per_kind)))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def run_benchmark(sizes: tuple[int, ...] = SIZES, batches: tuple[int, ...] = BATCHES, mode: str = "layered",
                  repeats: int = 3, cluster_file: str | Path = CLUSTER_FILE) -> list[dict[str, Any]]:
    """One row per (GPUs, global batch): planner seconds (best of ``repeats``) and predicted figures."""
    base = load_cluster(cluster_file)
    rows = []
    for gpus in sizes:
        cluster = subset(base, gpus)
        for batch in batches:
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                result = plan(cluster, batch, mode=mode)
                best = min(best, time.perf_counter() - start)
            row: dict[str, Any] = {
                "gpus": gpus, "kinds": len(set(cluster.devices)), "global_batch": batch, "mode": mode,
                "plan_s": best,
                "predicted_samples_per_s": result.predicted_samples_per_s,
                "upper_bound_samples_per_s": result.upper_bound_samples_per_s,
                "fraction_of_upper_bound": result.fraction_of_upper_bound,
                "optimality_gap": result.optimality_gap,
            }
            for name, baseline in result.baselines.items():
                row[f"{name}_samples_per_s"] = baseline.predicted_samples_per_s if baseline.feasible else None
                row[f"{name}_reason"] = baseline.reason
                row[f"speedup_vs_{name}"] = _ratio(result.predicted_samples_per_s,
                                                    baseline.predicted_samples_per_s if baseline.feasible else None)
            rows.append(row)
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "infeasible" if value is None else format(value, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="planner benchmark (throughput: cost-model predictions; time: measured)",
                  title_justify="left")
    for header in ("GPUs", "B", "plan time s", "samples/s", "vs even", "vs proportional",
                   "of upper bound", "opt. gap"):
        table.add_column(header, justify="right")
    for r in rows:
        table.add_row(str(r["gpus"]), str(r["global_batch"]), f"{r['plan_s']:.3f}",
                      f"{r['predicted_samples_per_s']:.3g}", _fmt(r.get("speedup_vs_even"), ".2f"),
                      _fmt(r.get("speedup_vs_proportional"), ".2f"), f"{100 * r['fraction_of_upper_bound']:.1f}%",
                      f"{100 * r['optimality_gap']:.2f}%" if r["optimality_gap"] is not None else "-")
    Console(width=110).print(table)
    print("vs even / vs proportional: the plan's predicted samples/s divided by the baseline's "
          "(infeasible: the baseline does not fit memory); all throughput figures are predictions of the cost model.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"GPUs {QUICK_SIZES} x B {QUICK_BATCHES}, one repeat")
    parser.add_argument("--mode", choices=("layered", "uniform"), default="layered")
    parser.add_argument("--cluster", default=str(CLUSTER_FILE), help="cluster file with 4 kinds of 16 GPUs")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    sizes, batches, repeats = (QUICK_SIZES, QUICK_BATCHES, 1) if args.quick else (SIZES, BATCHES, 3)
    rows = run_benchmark(sizes, batches, args.mode, repeats, args.cluster)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
