"""Run registered benchmarks one after the other, each in its own process, and say how long each took.

    python -m benchmarks --list              # the registry: name, on the results page or not, smoke-run flags
    python -m benchmarks --quick             # every benchmark's smoke run (make bench-smoke)
    python -m benchmarks planner layered     # two full runs
    python -m benchmarks --quick --json DIR  # and each one's result in DIR/<name>.json

Each runs as ``python -m benchmarks.bench_<name>`` from the repository root, with its registered
``quick_args`` under ``--quick``; its tables go to the terminal. The exit status is 1 when any failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.registry import BENCHMARKS, BY_NAME

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"default: all of them ({', '.join(BY_NAME)})")
    parser.add_argument("--quick", action="store_true", help="each benchmark's smoke-run flags")
    parser.add_argument("--json", metavar="DIR", help="write each result to DIR/<name>.json")
    parser.add_argument("--list", action="store_true", help="list the registry and run nothing")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in BY_NAME]
    if unknown:
        parser.error(f"no benchmark named {', '.join(unknown)}")
    entries = [BY_NAME[name] for name in args.names] or list(BENCHMARKS)
    if args.list:
        for entry in entries:
            page = "results page" if entry.in_report else "-"
            print(f"{entry.name:16s} {page:12s} {' '.join(entry.quick_args):22s} {entry.title}")
        return 0
    if args.json:
        Path(args.json).mkdir(parents=True, exist_ok=True)
    times = []
    for entry in entries:
        command = [sys.executable, "-m", entry.module, *(entry.quick_args if args.quick else ())]
        if args.json:
            command += ["--json", str(Path(args.json).resolve() / f"{entry.name}.json")]
        print(f"== {' '.join(command[1:])}", flush=True)
        start = time.perf_counter()
        status = subprocess.run(command, cwd=ROOT).returncode
        times.append((entry.name, time.perf_counter() - start, status))
    print("\nbenchmark         wall s  exit status")
    for name, seconds, status in times:
        print(f"{name:16s} {seconds:7.1f}  {status}")
    return 1 if any(status for _, _, status in times) else 0


if __name__ == "__main__":
    raise SystemExit(main())
