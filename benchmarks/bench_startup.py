"""Start-up time of the torch-free planner CLI beside a bare ``python -c pass``.

    python -m benchmarks.bench_startup            # 10 rounds, plus `import lightning.pytorch` for scale
    python -m benchmarks.bench_startup --quick    # 3 rounds, without the Lightning import

Every variant is a fresh interpreter (this checkout first on ``PYTHONPATH``), run in interleaved
rounds so the machine's load hits all alike; the ratios are medians of per-round ratios to
``python -c pass`` measured in the same round. Wall times are real measurements on this machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import Benchmark

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_FILE = ROOT / "configs" / "clusters" / "t4-example.yaml"
BASELINE = "python -c pass"
VARIANTS = {
    BASELINE: ["-c", "pass"],
    "plan --help": ["-m", "cephalo_lightning", "plan", "--help"],
    "plan t4-example.yaml -b 64": ["-m", "cephalo_lightning", "plan", str(CLUSTER_FILE), "-b", "64"],
}
LIGHTNING = {"python -c 'import lightning.pytorch'": ["-c", "import lightning.pytorch"]}


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _wall(args: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def run_benchmark(rounds: int = 10, with_lightning: bool = True) -> list[dict[str, Any]]:
    variants = {**VARIANTS, **(LIGHTNING if with_lightning else {})}
    env = _env()
    for args in variants.values():  # warm the file cache and the bytecode
        _wall(args, env)
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for i in range(rounds):
        for name in names[i % len(names):] + names[: i % len(names)]:
            times[name].append(_wall(variants[name], env))
    rows = []
    for name in names:
        ratios = [t / b for t, b in zip(times[name], times[BASELINE])]
        rows.append({"command": name, "median_s": statistics.median(times[name]), "min_s": min(times[name]),
                     "ratio_to_python": statistics.median(ratios), "rounds": rounds})
    try:
        load_after = os.getloadavg()[0]
    except OSError:  # pragma: no cover - not on every platform
        load_after = float("nan")
    cores = os.cpu_count() or 1
    for row in rows:  # the run's context, on every row: the result stays a list of rows
        row.update(load_after=load_after, cores=cores)
    return rows


def print_report(rows: list[dict[str, Any]]) -> None:
    width = max(len(r["command"]) for r in rows)
    print(f"Start-up wall time, {rows[0]['rounds']} interleaved rounds (measured; fresh interpreter each):")
    print(f"{'command'.ljust(width)}  median s   min s   x python -c pass")
    for r in rows:
        print(f"{r['command'].ljust(width)}  {r['median_s']:8.3f}  {r['min_s']:6.3f}  {r['ratio_to_python']:8.1f}x")
    print(f"(1-minute load average after the run: {rows[-1]['load_after']:.2f} on {rows[-1]['cores']} cores)")


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 10; --quick 3)")


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--quick``: 3 rounds, no Lightning reference."""
    return run_benchmark(rounds=args.rounds or (3 if args.quick else 10), with_lightning=not args.quick)


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
