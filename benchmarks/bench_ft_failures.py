"""A run with failures: fault tolerance against checkpoint-restart, N steps with a group killed every K steps.

    python -m benchmarks.bench_ft_failures            # N=36, K=8 (3 kills), a checkpoint every 5 steps
    python -m benchmarks.bench_ft_failures --quick    # N=16, K=6 (1 kill), a checkpoint every 4 steps

An emulated 2-group cluster: CPU processes on this machine (one thread each), gloo over loopback,
``Trainer.fit`` of a tiny Hugging Face Llama (AdamW, fp32) on the same global batches either way
(``scenarios/failure_run.py``). Group 1 SIGKILLs itself mid-step (after its backward, before the
cross-group sum) in steps K, 2K, ... up to N - K, once each, and comes back:

* **fault tolerance**: ``CephaloStrategy(fault_tolerance=True)``, each group its own process, a
  lighthouse on loopback (heartbeat timeout :data:`HEARTBEAT_TIMEOUT_MS` ms); group 0 trains on alone,
  redoing the interrupted step; group 1 is started again at once and recovers the live state;
* **checkpoint-restart**: both groups as one ``torchrun --max-restarts`` job, a ``ModelCheckpoint``
  every C steps; torchrun restarts both ranks, which resume from the newest checkpoint.

Printed side by side: the wall time from the first start to the job's end, the completed steps trained
again (the restart's steps since its checkpoint; fault tolerance's should be 0), the interrupted steps
redone, and the processes started. MEASURED, emulated on CPU: torchrun's restart is mostly start-up
(imports, process groups, the model) on this 2-core machine; fault tolerance's pause is mostly the
lighthouse's heartbeat timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import _common as common
from benchmarks.harness import Benchmark

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scenarios" / "failure_run.py"
HEARTBEAT_TIMEOUT_MS = 2000
DEADLINE_S = 1200
LATE_S = 5  # group 0 done this long and group 1 still running: its last life came back too late to rejoin


def _env(**extra: str) -> dict[str, str]:
    from scenarios.launch_env import clean_env

    return clean_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RUST_LOG="warn", **extra)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _summary(work: Path, wall: float, processes: int) -> dict[str, Any]:
    steps = _records(work / "steps-0.jsonl")  # group (rank) 0: trained every step
    committed = [s["step"] for s in steps if s["committed"]]
    return {"wall_s": wall, "kills": len(list(work.glob("killed-*"))), "steps": len(set(committed)),
            "completed_again": len(committed) - len(set(committed)),
            "interrupted_redone": sum(not s["committed"] for s in steps), "processes": processes}


def fault_tolerance(work: Path, steps: int, every: int) -> dict[str, Any]:
    os.environ.setdefault("RUST_LOG", "warn")  # the in-process lighthouse logs every quorum otherwise
    from torchft.coordination import LighthouseServer

    work.mkdir(parents=True)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=60_000,
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    env = _env(TORCHFT_LIGHTHOUSE=lighthouse.address())
    lives: list[subprocess.Popen] = []

    def start(group: int) -> subprocess.Popen:
        log = open(work / f"life-{group}-{len(lives)}.log", "w")  # noqa: SIM115
        life = subprocess.Popen([sys.executable, str(SCRIPT), str(work), "ft", str(group), str(steps), str(every)],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        lives.append(life)
        return life

    began = time.monotonic()
    try:
        groups = {0: start(0), 1: start(1)}
        late = False  # group 1's last life had not rejoined when group 0 finished
        while any(life.poll() is None for life in groups.values()):
            now = time.monotonic()
            if now - began > DEADLINE_S:
                raise RuntimeError(f"the fault-tolerant run did not finish in {DEADLINE_S} s; logs in {work}")
            if groups[1].poll() not in (None, 0) and groups[0].poll() is None:
                groups[1] = start(1)  # the node is back: the group starts again
            if groups[0].poll() not in (None, 0):
                raise RuntimeError(f"group 0 failed:\n{_tail(work, 'life-0-*.log')}")
            if (work / "done-0").exists() and groups[1].poll() is None and not (work / "done-1").exists() \
                    and now - (work / "done-0").stat().st_mtime > LATE_S:
                late = True  # it would train the whole run alone: the job is over
                groups[1].kill()
            time.sleep(0.05)
        wall = time.monotonic() - began
    finally:
        for life in lives:
            if life.poll() is None:
                life.kill()
            life.wait()
        lighthouse.shutdown()
    if groups[1].returncode != 0 and not late:
        raise RuntimeError(f"group 1's last life failed ({groups[1].returncode}):\n{_tail(work, 'life-1-*.log')}")
    return {**_summary(work, wall, len(lives)), "late_return": late}


def checkpoint_restart(work: Path, steps: int, every: int, checkpoint_every: int) -> dict[str, Any]:
    from cephalo_lightning.testing.local_ranks import free_port

    work.mkdir(parents=True)
    kills = len(range(every, steps - every + 1, every))
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--max-restarts", str(3 * kills + 2), "--monitor-interval", "0.1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(SCRIPT), str(work), "cr", "-", str(steps),
               str(every), str(checkpoint_every)]
    began = time.monotonic()
    with open(work / "torchrun.log", "w") as log:
        done = subprocess.run(command, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT, timeout=DEADLINE_S)
    wall = time.monotonic() - began
    if done.returncode != 0:
        raise RuntimeError(f"the checkpoint-restart run failed ({done.returncode}):\n{_tail(work, 'torchrun.log')}")
    return _summary(work, wall, len(_records(work / "lives.jsonl")))


def _tail(work: Path, pattern: str) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(work.glob(pattern)))


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=None, help="N, the steps of the run (default 36; --quick: 16)")
    parser.add_argument("--every", type=int, default=None, help="K: a kill every K steps (default 8; --quick: 6)")
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help="C: checkpoint-restart's checkpoint interval in steps (default 5; --quick: 4)")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    steps = args.steps or (16 if args.quick else 36)
    every = args.every or (6 if args.quick else 8)
    checkpoint_every = args.checkpoint_every or (4 if args.quick else 5)
    load = common.load_average()
    with tempfile.TemporaryDirectory() as tmp:
        ft = fault_tolerance(Path(tmp) / "ft", steps, every)
        cr = checkpoint_restart(Path(tmp) / "cr", steps, every, checkpoint_every)
    return {"steps": steps, "every": every, "checkpoint_every": checkpoint_every,
            "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
            "rows": [{"way": "fault tolerance (torchft)", **ft},
                     {"way": f"checkpoint-restart (torchrun, ckpt every {checkpoint_every})", **cr}],
            "load": common.load_span(load)}


def print_report(result: dict[str, Any]) -> None:
    print(common.environment_note())
    print(f"An emulated 2-group cluster (CPU processes, gloo over loopback), Trainer.fit of a tiny HF Llama for "
          f"{result['steps']} steps; group 1 killed mid-step every {result['every']} steps and back at once "
          f"(lighthouse heartbeat timeout {result['heartbeat_timeout_ms']} ms).\n")
    print(f"{'way':44s} {'wall':>8s} {'kills':>6s} {'steps':>6s} {'completed again':>16s} {'interrupted redone':>19s} "
          f"{'processes':>10s}")
    for r in result["rows"]:
        print(f"{r['way']:44s} {r['wall_s']:7.1f}s {r['kills']:6d} {r['steps']:6d} {r['completed_again']:16d} "
              f"{r['interrupted_redone']:19d} {r['processes']:10d}")
    ft, cr = result["rows"]
    if ft.get("late_return"):
        print("(group 1's last life came back after group 0 had finished and was stopped: the run was over)")
    print(f"\nfault tolerance / checkpoint-restart wall time: {ft['wall_s'] / cr['wall_s']:.2f}; steps trained twice "
          f"(completed again + interrupted redone): {ft['completed_again'] + ft['interrupted_redone']} against "
          f"{cr['completed_again'] + cr['interrupted_redone']}.")
    print("completed again: completed steps trained a second time (the restart's steps since its checkpoint); "
          "interrupted redone: steps cut by a kill and trained again; processes: the training processes started "
          "(fault tolerance restarts one group's, torchrun every rank's).")
    print(common.load_note(*result["load"]))


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
