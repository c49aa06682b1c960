"""Fault tolerance's cost per step when nothing fails: the same two-group plan with it on and off, in one run.

    python -m benchmarks.bench_ft_overhead            # 6 rounds of 40 steps each way (about 3 minutes)
    python -m benchmarks.bench_ft_overhead --quick    # 1 round of 14 steps each way (about 30 s)

An emulated 2-group cluster: two CPU processes on this machine (one thread each), gloo over
loopback, each a shard group of one rank training its half of every global batch of a 5.3M-parameter
TinyLM in fp32 (``scenarios/ft_steady.py``). Each round runs the plan twice, back to back:

* **off**: the two groups as one world, ``CephaloStrategy(fault_tolerance=False)``'s runtime (the
  cross-group sum is the bucketed all-reduce, started during the backward);
* **on**: each group its own process group and a torchft replica group on a lighthouse on loopback:
  the step's quorum (its small control sum started with it), the cross-group sum over torchft's
  managed process group in the same buckets, started during the backward as the off way's, the commit.

The rounds alternate the order (on first, then off first), so a change in the machine's load hits both.
Printed: the median step of each way over the steps after :data:`WARMUP`, the overhead
``median(on) / median(off) - 1`` (and each round's own, its two ways back to back: their spread is
the measurement's), and where each way's step goes (the median of each phase: the
quorum, the forward and backward with the cross-group sum inside, what is left to wait after the
backward, the commit decision, the optimizer). The
two ways train the same steps on the same data, so their final weights are compared too (the
largest difference; the sums add the same two numbers, so it should be 0). MEASURED, emulated on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import _common as common
from benchmarks.harness import Benchmark

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 4  # steps left out of the medians: the first quorum, allocation, the first bucket plan
PHASES = ("quorum", "compute", "sum", "commit", "optimizer")


def _run(work: Path, mode: str, steps: int, deadline_s: float = 600) -> list[list[dict]]:
    """Both groups of one way; each group's step records."""
    from cephalo_lightning.testing.local_ranks import free_port
    from scenarios.launch_env import clean_env

    os.environ.setdefault("RUST_LOG", "warn")  # the in-process lighthouse logs every quorum otherwise
    lighthouse = None
    if mode == "ft":
        from torchft._torchft import LighthouseServer

        lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=60_000,
                                      heartbeat_timeout_ms=5_000)
        endpoint = lighthouse.address()
    else:
        endpoint = f"127.0.0.1:{free_port()}"
    env = clean_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RUST_LOG="warn")
    procs = [subprocess.Popen([sys.executable, str(ROOT / "scenarios" / "ft_steady.py"), str(work), str(g), mode,
                               endpoint, str(steps)], cwd=ROOT, env=env,
                              stdout=open(work / f"log-{g}-{mode}.txt", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
             for g in (0, 1)]
    deadline = time.monotonic() + deadline_s
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {mode} run did not finish in {deadline_s} s; logs in {work}")
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if lighthouse is not None:
            lighthouse.shutdown()
    if any(p.returncode for p in procs):
        logs = "\n".join((work / f"log-{g}-{mode}.txt").read_text()[-2000:] for g in (0, 1))
        raise RuntimeError(f"the {mode} run failed ({[p.returncode for p in procs]}):\n{logs}")
    return [[json.loads(line) for line in (work / f"steps-{g}-{mode}.jsonl").read_text().splitlines()] for g in (0, 1)]


def _max_difference(work: Path) -> float:
    import torch

    on, off = (torch.load(work / f"final-0-{mode}.pt") for mode in ("ft", "off"))
    return max(float((on[name] - off[name]).abs().max()) for name in off)


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=None, help="rounds of both ways (default 6; --quick: 1)")
    parser.add_argument("--steps", type=int, default=None, help="steps per way and round (default 40; --quick: 14)")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    rounds = args.rounds or (1 if args.quick else 6)
    steps = args.steps or (14 if args.quick else 40)
    load = common.load_average()
    steady: dict[str, list[dict]] = {"ft": [], "off": []}
    paired: list[float] = []  # each round's own overhead: its two ways ran back to back
    difference = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            this_round: dict[str, list[float]] = {"ft": [], "off": []}
            for mode in (("ft", "off") if r % 2 == 0 else ("off", "ft")):
                work = Path(tmp) / f"round-{r}"
                work.mkdir(exist_ok=True)
                for records in _run(work, mode, steps):
                    kept = [s for s in records[WARMUP:] if s["committed"]]
                    steady[mode] += kept
                    this_round[mode] += [s["step"] for s in kept]
            paired.append(statistics.median(this_round["ft"]) / statistics.median(this_round["off"]) - 1)
            difference = max(difference, _max_difference(Path(tmp) / f"round-{r}"))
    median = {mode: statistics.median(s["step"] for s in records) for mode, records in steady.items()}
    phases = {mode: {p: statistics.median(s[p] for s in records) for p in PHASES} for mode, records in steady.items()}
    return {"rounds": rounds, "steps": steps, "warmup": WARMUP, "step_s": median, "phases_s": phases,
            "overhead": median["ft"] / median["off"] - 1, "overhead_s": median["ft"] - median["off"],
            "round_overheads": paired,
            "max_weight_difference": difference, "load": common.load_span(load)}


def print_report(result: dict[str, Any]) -> None:
    print(common.environment_note())
    print(f"An emulated 2-group cluster (two CPU processes, one thread each, gloo over loopback); {result['rounds']} "
          f"round(s) of {result['steps']} steps each way, the first {result['warmup']} of each run left out.\n")
    print(f"{'way':34s} {'median step':>12s} " + " ".join(f"{p:>10s}" for p in PHASES))
    for mode, name in (("off", "fault tolerance off"), ("ft", "fault tolerance on (torchft)")):
        print(f"{name:34s} {result['step_s'][mode] * 1e3:10.1f}ms "
              + " ".join(f"{result['phases_s'][mode][p] * 1e3:8.1f}ms" for p in PHASES))
    own = result["phases_s"]["ft"]["quorum"] + result["phases_s"]["ft"]["commit"]
    print(f"\noverhead of fault tolerance: {result['overhead'] * 100:+.1f}% of the step "
          f"({result['overhead_s'] * 1e3:+.1f} ms per step); the final weights differ by at most "
          f"{result['max_weight_difference']:.1e}")
    rounds = result.get("round_overheads") or []
    if len(rounds) > 1:
        print("each round's own overhead (its two ways back to back): "
              + ", ".join(f"{o * 100:+.1f}%" for o in rounds)
              + f"; median {statistics.median(rounds) * 100:+.1f}%, from {min(rounds) * 100:+.1f}% to {max(rounds) * 100:+.1f}%")
    inside = result["phases_s"]["ft"]["compute"] - result["phases_s"]["off"]["compute"]
    print(f"torchft's own steps (quorum + commit): {own * 1e3:.1f} ms, {own / result['step_s']['ft'] * 100:.1f}% of the "
          f"on-way's step; the forward and backward (the cross-group sum inside, both ways) take {inside * 1e3:+.1f} ms "
          "more with torchft's managed process group than with the job's own.")
    print("Phases (medians, so they need not add up to the step): quorum = torchft's quorum before the forward (and "
          "the start of the step's control sum); compute = forward and backward, each gradient bucket's cross-group "
          "all-reduce started as it fills and waited at the end (both ways); sum = what is left after the backward "
          "(on: the control sum compared; off: nothing); commit = torchft's commit decision. MEASURED, emulated on CPU.")
    print(common.load_note(*result["load"]))


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
