"""Losing a node: torchft fault tolerance against today's torchrun elastic restart, in one run.

    python -m benchmarks.bench_fault_tolerance             # all three (about 15 s + 40 s + 1 to 4 minutes)
    python -m benchmarks.bench_fault_tolerance --ft-only   # the torchft ways only
    python -m benchmarks.bench_fault_tolerance --quick     # the first torchft way alone (about 15 s)

Both ways run on an emulated 2-node cluster of CPU processes on this machine, over gloo and
loopback, with the suite's instrumented scenarios (run from a checkout):

* **torchft** (``scenarios/ft_worker.py``): two shard groups of one rank each, a ``torchft`` lighthouse
  on 127.0.0.1 (heartbeat timeout 2 s); group 1 is SIGKILLed in step 3 between its backward and the
  cross-group sum; group 0 goes on in its own process; group 1 is started again and recovers the
  live state from group 0.
* **torchft under Trainer.fit** (the same scenario, each life a ``Trainer.fit`` of a tiny Hugging
  Face Llama under ``CephaloStrategy(fault_tolerance=True)``; the kill in ``on_after_backward``).
* **torchrun elastic** (``scenarios/elastic_worker.py``, its agents from ``scenarios/torchrun_agents.py``):
  node A (2 ranks) and node B (1 rank) under ``--nnodes 1:2``, ``CephaloStrategy(elastic=True)``, a
  checkpoint every step; B's rank SIGKILLs its agent and itself after step 3's optimizer step,
  before that step's checkpoint; A's agent restarts its ranks, which re-plan and resume from the
  newest checkpoint.

Printed for each: the time from the kill to the survivors' next completed step, the completed steps
lost (trained again), and the survivors' step time before and after the loss. MEASURED on CPU: the
elastic restart's time is mostly rank start-up (imports, process groups) on this loaded 2-core
machine; torchft's is the lighthouse's heartbeat timeout plus a new quorum.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import _common as common
from benchmarks.harness import Benchmark


def torchft_way(work: Path, fit: bool = False) -> dict:
    from scenarios.ft_worker import KILL_AT, run_scenario

    scenario = run_scenario(work, deadline_s=600, fit=fit)
    (pid,) = scenario.lives(0)
    events = scenario.events[0, pid]
    killed = scenario.killed["time"]
    after = [e for e in events if e["committed"] and e["time"] > killed]
    steps = [e["step"] for e in events if e["committed"]]
    alone = [e["time"] for e in events if e["committed"] and e["participants"] == [0]]
    both = [e["time"] for e in events if e["committed"] and e["participants"] == [0, 1] and e["step"] < KILL_AT]
    return {"recovery_s": after[0]["time"] - killed, "steps_lost": len(steps) - len(set(steps)),
            "redone": sum(not e["committed"] for e in events),
            "step_before_s": statistics.median(b - a for a, b in zip(both, both[1:])),
            "step_after_s": statistics.median(b - a for a, b in zip(alone, alone[1:]))}


def elastic_way(work: Path) -> dict:
    from cephalo_lightning.testing.local_ranks import free_port
    from scenarios.torchrun_agents import start_agent, stop_agents

    port = free_port()
    agents = [start_agent(work, port, "A", 2, host=True), start_agent(work, port, "B", 1, host=False)]
    deadline = time.monotonic() + 1200
    try:
        while not (work / "recovered").exists():
            if time.monotonic() > deadline or agents[0].poll() is not None:
                raise RuntimeError(f"the elastic run did not recover (agent A: {agents[0].poll()}); logs in {work}")
            time.sleep(0.2)
    finally:
        stop_agents(agents)
    killed, recovered = (json.loads((work / n).read_text()) for n in ("killed", "recovered"))
    # the kill came after step killed["step"]'s optimizer step, before its checkpoint; the restart
    # resumed from the checkpoint before it: the first step after the restart is the one trained again
    return {"recovery_s": recovered["time"] - killed["time"], "steps_lost": killed["step"] - recovered["step"] + 1,
            "redone": 0, "step_before_s": float("nan"), "step_after_s": float("nan")}


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ft-only", action="store_true", help="skip the torchrun elastic restart")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``--quick``: the torchft way alone (no Trainer.fit, no torchrun)."""
    load = common.load_average()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(("torchft (this package's ReplicaGroup)", torchft_way(Path(tmp) / "ft")))
        if not args.quick:
            rows.append(("torchft under Trainer.fit", torchft_way(Path(tmp) / "ft-fit", fit=True)))
        if not (args.quick or args.ft_only):
            (Path(tmp) / "elastic").mkdir()
            rows.append(("torchrun elastic restart", elastic_way(Path(tmp) / "elastic")))
    return {"rows": [{"way": name, **r} for name, r in rows], "load": common.load_span(load)}


def print_report(result: dict[str, Any]) -> None:
    print(common.environment_note())
    print("An emulated 2-node cluster (CPU processes, gloo over loopback); one node killed mid-run.\n")
    print(f"{'way':40s} {'kill -> next step':>18s} {'steps lost':>11s} {'steps redone':>13s} "
          f"{'step before':>12s} {'step after':>11s}")
    for r in result["rows"]:
        print(f"{r['way']:40s} {r['recovery_s']:17.2f}s {r['steps_lost']:11d} {r['redone']:13d} "
              f"{r['step_before_s'] * 1e3:10.1f}ms {r['step_after_s'] * 1e3:9.1f}ms")
    print("\nsteps lost: completed steps trained again; steps redone: steps interrupted by the kill and run again "
          "(not committed, so never counted twice). Step times are the torchft survivors' (one group on the whole "
          "global batch after the loss); the elastic run's are not instrumented (nan).")
    print(common.load_note(*result["load"]))


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
