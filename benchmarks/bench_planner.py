"""Planner benchmark: wall time and peak memory of `plan()` up to 10,000 GPUs, and plan quality vs the baselines.

    python -m benchmarks.bench_planner            # all three tables
    python -m benchmarks.bench_planner --quick    # smaller grids, for smoke tests

1. Scaling: the first N / 8 GPUs of each of the 8 kinds of ``configs/clusters/hetero-8kinds.yaml``
   (catalog-estimated, GPT-6.7B shape, optimizer step estimated from memory bandwidth), N up to
   10,000, at B = 65,536. Each row runs in a fresh torch-free interpreter: the plan time is the best
   of the repeats, the peak is the process's peak resident memory (interpreter and numpy included;
   the bare import is printed beside it). Goal: < 1 s and < 500 MB at 10,000 GPUs.
2. Bounded in B: 4 GPUs (2x L4 + A6000 + P40, catalog) from B = 64 to the planner's limit in both
   modes, and B = 10^9 (a clear error, not an OOM).
3. Quality: 4, 16, 64 GPUs of ``configs/clusters/hetero-64.yaml`` at B = 64..4096: the plan's
   predicted samples/s against every baseline (even, proportional, poplar, reference, ddp-even,
   hsdp-even) and the upper bound.
4. Topology: the scaling cluster in nodes of 8 GPUs in rank order (10,000 GPUs: 1,250 nodes; a node
   may straddle two kinds), 300 GB/s inside a node, 25 GB/s between nodes: ``plan()`` weighs every
   candidate grouping (full shard, per node, node halves and pairs, per rank). Goal: < 2 s at 10,000.

Throughput figures are PREDICTIONS of the planner's cost model for catalog-estimated clusters;
times and memory are measured on this machine. ``run_benchmark()``, ``run_scaling()`` and
``run_batch_bound()`` return the rows as data for report scripts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.harness import Benchmark
from cephalo_lightning.planner import Cluster, load_cluster, plan
from cephalo_lightning.planner.schema.limits import MAX_GLOBAL_BATCH
from cephalo_lightning.planner.search.peers import BASELINES

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_FILE = ROOT / "configs" / "clusters" / "hetero-64.yaml"
SCALING_FILE = ROOT / "configs" / "clusters" / "hetero-8kinds.yaml"
SMALL_FILE = ROOT / "configs" / "clusters" / "l4-a6000-p40.yaml"
SIZES = (4, 16, 64)
BATCHES = (64, 256, 1024, 4096)
QUICK_SIZES = (4, 16)
QUICK_BATCHES = (64, 256)
SCALING = (8, 64, 512, 1024, 4096, 10_000)
QUICK_SCALING = (8, 512, 10_000)
SCALING_BATCH = 65_536
BOUND_BATCHES = (64, 4096, 65_536, MAX_GLOBAL_BATCH, 10**9)
NODE_SIZE = 8
TOPOLOGY_LINKS = {"link_bandwidth_gbps": 300.0, "inter_node_bandwidth_gbps": 25.0, "inter_node_latency_ms": 0.02}
TOPOLOGY = (512, 1024, 10_000)
QUICK_TOPOLOGY = (10_000,)
QUICK_BOUND_BATCHES = (64, 65_536, 10**9)


def subset(cluster: Cluster, gpus: int) -> Cluster:
    """The first gpus / kinds devices of every kind, kinds interleaved in file order."""
    kinds = list(dict.fromkeys(cluster.devices))
    per_kind = gpus // len(kinds)
    available = min(cluster.devices.count(k) for k in kinds)
    if per_kind < 1 or per_kind * len(kinds) != gpus or per_kind > available:
        raise ValueError(f"{gpus} GPUs is not a multiple of the {len(kinds)} kinds up to {available} each")
    return replace(cluster, devices=tuple(k for k in kinds for _ in range(per_kind)))


def with_nodes(cluster: Cluster, per_node: int = NODE_SIZE, links: dict[str, float] | None = None) -> Cluster:
    """The ranks in nodes of ``per_node`` in rank order, with the link figures ``links`` (TOPOLOGY_LINKS)."""
    made: dict[tuple[int, int], Any] = {}
    devices = tuple(made.setdefault((id(d), r // per_node), replace(d, node=r // per_node))
                    for r, d in enumerate(cluster.devices))
    return replace(cluster, devices=devices, settings=replace(cluster.settings, **(links or TOPOLOGY_LINKS)))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


# ------------------------------------------------------------------------------------ 1 + 2: isolated runs

_RUNNER = textwrap.dedent("""
    import json, sys, time
    for name in ("torch", "lightning", "pytorch_lightning"):
        sys.modules[name] = None  # the planner is torch-free: measure it alone

    def peak_mb():  # this process's peak resident memory (getrusage's would include the parent's)
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024

    from cephalo_lightning.planner import PlanningError, load_cluster, plan
    from benchmarks.bench_planner import subset, with_nodes
    cluster = load_cluster({file!r})
    if {gpus!r} is not None:
        cluster = subset(cluster, {gpus!r})
    if {nodes!r}:
        cluster = with_nodes(cluster)
    import_mb = peak_mb()
    best, result, error = float("inf"), None, None
    for _ in range({repeats!r}):
        start = time.perf_counter()
        try:
            result = plan(cluster, {batch!r}, mode={mode!r})
        except PlanningError as err:
            error = str(err)
        best = min(best, time.perf_counter() - start)
    row = {{"plan_s": best, "peak_mb": peak_mb(),
            "import_mb": import_mb, "error": error}}
    if {nodes!r}:  # the same plan with the one-group grouping alone, for the cost of weighing the others
        full = float("inf")
        for _ in range({repeats!r}):
            start = time.perf_counter()
            plan(cluster, {batch!r}, mode={mode!r}, groupings=("full",))
            full = min(full, time.perf_counter() - start)
        row["full_only_s"] = full
    if result is not None:
        row.update(predicted_samples_per_s=result.predicted_samples_per_s, optimality_gap=result.optimality_gap,
                   shard_groups=result.num_shard_groups, nodes=cluster.num_nodes,
                   baselines={{n: b.predicted_samples_per_s for n, b in result.baselines.items()}})
    print(json.dumps(row))
""")


def isolated(file: Path, gpus: int | None, batch: int, mode: str = "layered", repeats: int = 3,
             nodes: bool = False) -> dict[str, Any]:
    """One plan() in a fresh torch-free interpreter: best time of ``repeats`` and the process's peak memory
    (``nodes``: the ranks in nodes of NODE_SIZE, see :func:`with_nodes`). It runs in the repository root, so that
    ``python -c`` imports this checkout's ``cephalo_lightning`` and ``benchmarks``."""
    code = _RUNNER.format(file=str(file), gpus=gpus, batch=batch, mode=mode, repeats=repeats, nodes=nodes)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600, cwd=ROOT,
                         env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_scaling(sizes: tuple[int, ...] = SCALING, batch: int = SCALING_BATCH, repeats: int = 3) -> list[dict[str, Any]]:
    rows = []
    for gpus in sizes:
        row = isolated(SCALING_FILE, gpus, batch, repeats=repeats)
        rows.append({"gpus": gpus, "kinds": 8, "global_batch": batch, **row})
    return rows


def run_topology(sizes: tuple[int, ...] = TOPOLOGY, batch: int = SCALING_BATCH, repeats: int = 3) -> list[dict[str, Any]]:
    rows = []
    for gpus in sizes:
        row = isolated(SCALING_FILE, gpus, batch, repeats=repeats, nodes=True)
        rows.append({"gpus": gpus, "kinds": 8, "global_batch": batch, **row})
    return rows


def run_batch_bound(batches: tuple[int, ...] = BOUND_BATCHES, repeats: int = 1) -> list[dict[str, Any]]:
    rows = []
    for mode in ("layered", "uniform"):
        for batch in batches:
            row = isolated(SMALL_FILE, None, batch, mode=mode, repeats=repeats)
            rows.append({"gpus": 4, "global_batch": batch, "mode": mode, **row})
    return rows


# ------------------------------------------------------------------------------------ 3: quality


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
                row[f"{name}_skipped"] = baseline.skipped
                row[f"speedup_vs_{name}"] = _ratio(result.predicted_samples_per_s,
                                                    baseline.predicted_samples_per_s if baseline.feasible else None)
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------ printing


def _fmt(value: float | None, spec: str, none: str = "infeasible") -> str:
    return none if value is None else format(value, spec)


def print_scaling(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"1. planner scaling, 8 kinds, B = {SCALING_BATCH:,} (time and memory: measured; "
                        f"samples/s: predicted)", title_justify="left")
    for header in ("GPUs", "plan time s", "peak MB", "import MB", "samples/s", "vs even", "vs poplar", "opt. gap"):
        table.add_column(header, justify="right")
    for r in rows:
        base = r.get("baselines", {})
        table.add_row(f"{r['gpus']:,}", f"{r['plan_s']:.3f}", f"{r['peak_mb']:.0f}", f"{r['import_mb']:.0f}",
                      _fmt(r.get("predicted_samples_per_s"), ".4g", "error"),
                      _fmt(_ratio(r.get("predicted_samples_per_s"), base.get("even")), ".2f"),
                      _fmt(_ratio(r.get("predicted_samples_per_s"), base.get("poplar")), ".3f"),
                      _fmt(None if r.get("optimality_gap") is None else 100 * r["optimality_gap"], ".3f", "-") + "%")
    Console(width=120).print(table)
    print("peak MB: the planning process's peak resident memory (interpreter and numpy included; import MB: "
          "after the imports alone). Goal: < 1 s and < 500 MB at 10,000 GPUs.")


def print_topology(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"4. shard groups: nodes of {NODE_SIZE}, 300 GB/s inside, 25 GB/s between, B = "
                        f"{SCALING_BATCH:,} (time: measured; samples/s: predicted)", title_justify="left")
    for header in ("GPUs", "nodes", "plan time s", "full only s", "peak MB", "samples/s", "groups", "vs hsdp-even",
                   "vs ddp-even", "opt. gap"):
        table.add_column(header, justify="right")
    for r in rows:
        base = r.get("baselines", {})
        table.add_row(f"{r['gpus']:,}", f"{r.get('nodes', 0):,}", f"{r['plan_s']:.3f}", f"{r['full_only_s']:.3f}",
                      f"{r['peak_mb']:.0f}",
                      _fmt(r.get("predicted_samples_per_s"), ".4g", "error"), f"{r.get('shard_groups', 0):,}",
                      _fmt(_ratio(r.get("predicted_samples_per_s"), base.get("hsdp-even")), ".2f"),
                      _fmt(_ratio(r.get("predicted_samples_per_s"), base.get("ddp-even")), ".2f"),
                      _fmt(None if r.get("optimality_gap") is None else 100 * r["optimality_gap"], ".3f", "-") + "%")
    Console(width=120).print(table)
    print("plan() weighs every candidate grouping (full only: groupings=('full',), the plan without groups); "
          "opt. gap: certified over those groupings. "
          f"Goal: < 2 s at 10,000 GPUs ({10_000 // NODE_SIZE:,} nodes).")


def print_bound(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"2. bounded in B: 2x L4 + A6000 + P40 (limit {MAX_GLOBAL_BATCH:,} samples)", title_justify="left")
    for header in ("mode", "B", "plan time s", "peak MB", "answer", "opt. gap"):
        table.add_column(header, justify="right")
    for r in rows:
        answer = "error: " + r["error"][:60] + "..." if r.get("error") else f"{r['predicted_samples_per_s']:.4g} samples/s"
        gap = r.get("optimality_gap")
        table.add_row(r["mode"], f"{r['global_batch']:,}", f"{r['plan_s']:.3f}", f"{r['peak_mb']:.0f}", answer,
                      "-" if gap is None else f"{100 * gap:.3f}%")
    Console(width=140).print(table)


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="3. plan quality (throughput: cost-model predictions; time: measured)", title_justify="left")
    for header in ("GPUs", "B", "plan time s", "samples/s", *(f"vs {b}" for b in BASELINES), "of upper bound",
                   "opt. gap"):
        table.add_column(header, justify="right")
    for r in rows:
        versus = [("skipped" if r.get(f"{b}_skipped") else _fmt(r.get(f"speedup_vs_{b}"), ".2f")) for b in BASELINES]
        table.add_row(str(r["gpus"]), str(r["global_batch"]), f"{r['plan_s']:.3f}",
                      f"{r['predicted_samples_per_s']:.3g}", *versus, f"{100 * r['fraction_of_upper_bound']:.1f}%",
                      f"{100 * r['optimality_gap']:.2f}%" if r["optimality_gap"] is not None else "-")
    Console(width=140).print(table)
    print("vs X: the plan's predicted samples/s divided by baseline X's (infeasible: X does not fit memory; "
          "skipped: the reference's exact-sample program is only run up to 4,096 ranks x samples); "
          "all throughput figures are predictions of the cost model.")


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=("layered", "uniform"), default="layered", help="for table 3")
    parser.add_argument("--cluster", default=str(CLUSTER_FILE), help="table 3: cluster file with 4 kinds of 16 GPUs")
    parser.add_argument("--topology-only", action="store_true", help="table 4 alone")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``--quick``: smaller grids, one repeat."""
    quick = args.quick
    repeats = 1 if quick else 3
    result: dict[str, Any] = {}
    if not args.topology_only:
        result["scaling"] = run_scaling(QUICK_SCALING if quick else SCALING, repeats=repeats)
        result["bound"] = run_batch_bound(QUICK_BOUND_BATCHES if quick else BOUND_BATCHES)
        result["quality"] = run_benchmark(QUICK_SIZES if quick else SIZES, QUICK_BATCHES if quick else BATCHES,
                                          args.mode, repeats, args.cluster)
    result["topology"] = run_topology(QUICK_TOPOLOGY if quick else TOPOLOGY, repeats=repeats)
    return result


def print_report(result: dict[str, Any]) -> None:
    if "scaling" in result:
        print_scaling(result["scaling"])
        print_bound(result["bound"])
        print_table(result["quality"])
    print_topology(result["topology"])


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
