"""A run with failures: fault tolerance against checkpoint-restart, N steps with a group killed every K steps.

    python -m benchmarks.bench_ft_failures            # N=36, K=8 (3 kills), a checkpoint every 5 steps
    python -m benchmarks.bench_ft_failures --quick    # N=16, K=6 (1 kill), a checkpoint every 4 steps

An emulated 2-group cluster: CPU processes on this machine (one thread each), gloo over loopback,
``Trainer.fit`` of a tiny Hugging Face Llama (AdamW, fp32) on the same global batches either way
(``scenarios/failure_run.py``), every attempt at a step given a fixed emulated device time
(``DEVICE_STEP_S`` there). Group 1 SIGKILLs itself mid-step (after its backward, before the step
commits) in steps K, 2K, ... up to N - K, once each, and comes back:

* **fault tolerance**: ``CephaloStrategy(fault_tolerance=True)``, each group its own process, a
  lighthouse on loopback (heartbeat timeout :data:`HEARTBEAT_TIMEOUT_MS` ms); group 0 trains on alone,
  redoing the interrupted step; group 1 is started again at once and recovers the live state;
* **checkpoint-restart**: both groups as one ``torchrun --max-restarts`` job, a ``ModelCheckpoint``
  every C steps; torchrun restarts both ranks, which resume from the newest checkpoint. Each arm has its
  own rendezvous (a free port, a fresh id, a join timeout) and torchrun does not share its store with the
  ranks (``scenarios/launch_env.py``: a restarted rank could otherwise read a dead rank's address, and the
  restart hang).

Every arm is bounded: past its deadline (:func:`deadline_s`, from the step and kill counts, or ``--deadline``)
the arm's whole process tree is killed and its row reads "did not finish in N s"; an arm whose processes
fail reads "failed" with its log's last lines. The other arm runs either way.

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
import uuid
from pathlib import Path
from typing import Any

from benchmarks import _common as common
from benchmarks.harness import Benchmark

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scenarios" / "failure_run.py"
HEARTBEAT_TIMEOUT_MS = 2000
LATE_S = 5  # group 0 done this long and group 1 still running: its last life came back too late to rejoin
# an arm's deadline: SLACK times a slow host's expected wall time (steps of at most STEP_S, START_S a life's
# start-up; the steps take about 3 s (their emulated device time) and a start 20-40 s on 2 loaded cores)
STEP_S, START_S, SLACK = 10.0, 60.0, 3.0
JOIN_TIMEOUT_S = 120  # torchrun: a rendezvous round that cannot complete fails this soon (its default: 600 s)
TAIL_LINES = 12  # of a failed or unfinished arm's log, kept in its row


def deadline_s(steps: int, kills: int) -> float:
    """How long one arm may run: :data:`SLACK` x (``steps`` x :data:`STEP_S` + each life's start-up)."""
    return SLACK * (steps * STEP_S + (kills + 1) * START_S)


def kill_steps(steps: int, every: int) -> list[int]:
    """The steps group 1 is killed in: ``every``, ``2 every``, ... up to ``steps - every``."""
    return list(range(every, steps - every + 1, every))


def _env(torchrun: bool, **extra: str) -> dict[str, str]:
    """A started process's environment; ``torchrun``: a launcher that restarts its ranks."""
    from scenarios.launch_env import clean_env, torchrun_env

    return (torchrun_env if torchrun else clean_env)(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RUST_LOG="warn",
                                                     **extra)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _summary(work: Path, wall: float, processes: int) -> dict[str, Any]:
    steps = _records(work / "steps-0.jsonl")  # group (rank) 0: trained every step
    committed = [s["step"] for s in steps if s["committed"]]
    return {"wall_s": wall, "kills": len(list(work.glob("killed-*"))), "steps": len(set(committed)),
            "completed_again": len(committed) - len(set(committed)),
            "interrupted_redone": sum(not s["committed"] for s in steps), "processes": processes}


def _tail(work: Path, pattern: str) -> list[str]:
    """The last :data:`TAIL_LINES` lines of each log matching ``pattern``, each log's name first."""
    lines = []
    for path in sorted(work.glob(pattern)):
        lines += [f"--- {path.name}", *path.read_text(errors="replace").splitlines()[-TAIL_LINES:]]
    return lines


def _outcome(finished: bool, deadline: float, failure: str | None = None, tail: list[str] | None = None) -> dict:
    """A row's ending: finished, did not finish by ``deadline`` (its process tree killed), or ``failure``."""
    return {"finished": finished and failure is None, "deadline_s": deadline, "failure": failure, "log_tail": tail or []}


def fault_tolerance(work: Path, steps: int, every: int, deadline: float) -> dict[str, Any]:
    os.environ.setdefault("RUST_LOG", "warn")  # the in-process lighthouse logs every quorum otherwise
    from torchft.coordination import LighthouseServer

    from scenarios.process_tree import end_tree

    work.mkdir(parents=True)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=60_000,
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    env = _env(False, TORCHFT_LIGHTHOUSE=lighthouse.address())
    lives: list[subprocess.Popen] = []
    kills = len(kill_steps(steps, every))
    most_lives = 2 + kills + 2  # a return per kill, and two unplanned exits forgiven

    def start(group: int) -> subprocess.Popen:
        log = open(work / f"life-{group}-{len(lives)}.log", "w")  # noqa: SIM115 (the child writes it)
        life = subprocess.Popen([sys.executable, str(SCRIPT), str(work), "ft", str(group), str(steps), str(every)],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        lives.append(life)
        return life

    began = time.monotonic()
    late, failure, finished, unplanned = False, None, True, 0  # late: group 1's last life had not rejoined in time
    try:
        groups = {0: start(0), 1: start(1)}
        while any(life.poll() is None for life in groups.values()):
            now = time.monotonic()
            if now - began > deadline:
                finished = False
                break
            if groups[1].poll() not in (None, 0) and groups[0].poll() is None:
                unplanned += groups[1].returncode != -9  # the planned kill is a SIGKILL; anything else is not
                if len(lives) >= most_lives:
                    failure = f"failed: group 1 exited {len(lives) - 1} times (the plan kills it {kills} times)"
                    break
                groups[1] = start(1)  # the node is back: the group starts again
            if groups[0].poll() not in (None, 0):
                failure = f"failed: group 0 exited with {groups[0].returncode}"
                break
            if (work / "done-0").exists() and groups[1].poll() is None and not (work / "done-1").exists() \
                    and now - (work / "done-0").stat().st_mtime > LATE_S:
                late = True  # it would train the whole run alone: the job is over
                end_tree(groups[1])
            time.sleep(0.05)
        wall = time.monotonic() - began
    finally:
        for life in lives:
            end_tree(life)
        lighthouse.shutdown()
    if finished and failure is None and groups[1].returncode != 0 and not late:
        failure = f"failed: group 1's last life exited with {groups[1].returncode}"
    tail = _tail(work, "life-*.log") if failure or not finished else None
    return {**_summary(work, wall, len(lives)), "late_return": late, "unplanned_exits": unplanned,
            **_outcome(finished, deadline, failure, tail)}


def checkpoint_restart(work: Path, steps: int, every: int, checkpoint_every: int, deadline: float) -> dict[str, Any]:
    from cephalo_lightning.testing.local_ranks import free_port
    from scenarios.process_tree import end_tree

    work.mkdir(parents=True)
    kills = len(kill_steps(steps, every))
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--max-restarts", str(3 * kills + 2), "--monitor-interval", "0.1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", f"ft-failures-{uuid.uuid4().hex[:12]}",
               "--rdzv-conf", f"join_timeout={JOIN_TIMEOUT_S}", str(SCRIPT), str(work), "cr", "-", str(steps),
               str(every), str(checkpoint_every)]
    began = time.monotonic()
    with open(work / "torchrun.log", "w") as log:
        job = subprocess.Popen(command, cwd=ROOT, env=_env(True), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
        try:
            while job.poll() is None and time.monotonic() - began <= deadline:
                time.sleep(0.1)
            wall = time.monotonic() - began
            finished = job.poll() is not None
        finally:
            end_tree(job)  # past the deadline: torchrun and its ranks (each in a session of its own)
    failure = f"failed: torchrun exited with {job.returncode}" if finished and job.returncode != 0 else None
    tail = _tail(work, "torchrun.log") if failure or not finished else None
    started = (work / "started").read_text().split() if (work / "started").exists() else []  # failed starts too
    return {**_summary(work, wall, len(started)), **_outcome(finished, deadline, failure, tail)}


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=None, help="N, the steps of the run (default 36; --quick: 16)")
    parser.add_argument("--every", type=int, default=None, help="K: a kill every K steps (default 8; --quick: 6)")
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help="C: checkpoint-restart's checkpoint interval in steps (default 5; --quick: 4)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds each arm may run before its processes are killed (default: "
                             f"{SLACK:g} x ({STEP_S:g} s a step + {START_S:g} s a start))")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    steps = args.steps or (16 if args.quick else 36)
    every = args.every or (6 if args.quick else 8)
    checkpoint_every = args.checkpoint_every or (4 if args.quick else 5)
    if not 0 < every < steps or checkpoint_every < 1:
        raise SystemExit(f"--every {every} must lie in 1..{steps - 1} (--steps {steps}) and --checkpoint-every "
                         f"{checkpoint_every} be at least 1")
    if args.deadline is not None and args.deadline <= 0:
        raise SystemExit(f"--deadline {args.deadline} must be a positive number of seconds")
    deadline = args.deadline or deadline_s(steps, len(kill_steps(steps, every)))
    load = common.load_average()
    with tempfile.TemporaryDirectory() as tmp:
        ft = fault_tolerance(Path(tmp) / "ft", steps, every, deadline)
        cr = checkpoint_restart(Path(tmp) / "cr", steps, every, checkpoint_every, deadline)
    return {"steps": steps, "every": every, "checkpoint_every": checkpoint_every,
            "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
            "rows": [{"way": "fault tolerance (torchft)", **ft},
                     {"way": f"checkpoint-restart (torchrun, ckpt every {checkpoint_every})", **cr}],
            "load": common.load_span(load)}


def _finished(row: dict[str, Any]) -> bool:
    return row.get("finished", True)  # results stored before the deadline existed are all finished runs


def print_report(result: dict[str, Any]) -> None:
    print(common.environment_note())
    print(f"An emulated 2-group cluster (CPU processes, gloo over loopback), Trainer.fit of a tiny HF Llama for "
          f"{result['steps']} steps; group 1 killed mid-step every {result['every']} steps and back at once "
          f"(lighthouse heartbeat timeout {result['heartbeat_timeout_ms']} ms). MEASURED, emulated on CPU.\n")
    print(f"{'way':44s} {'wall':>8s} {'kills':>6s} {'steps':>6s} {'completed again':>16s} {'interrupted redone':>19s} "
          f"{'processes':>10s}")
    for r in result["rows"]:
        if _finished(r):
            print(f"{r['way']:44s} {r['wall_s']:7.1f}s {r['kills']:6d} {r['steps']:6d} {r['completed_again']:16d} "
                  f"{r['interrupted_redone']:19d} {r['processes']:10d}")
            continue
        why = r["failure"] or f"did not finish in {r['deadline_s']:.0f} s (its processes killed)"
        print(f"{r['way']:44s} {why}: {r['steps']} of {result['steps']} steps committed, {r['kills']} kills, "
              f"{r['processes']} processes, after {r['wall_s']:.0f} s")
        print("\n".join(f"    {line}" for line in r["log_tail"]))
    ft, cr = result["rows"]
    if ft.get("late_return"):
        print("(group 1's last life came back after group 0 had finished and was stopped: the run was over)")
    if ft.get("unplanned_exits"):
        print(f"(group 1 exited {ft['unplanned_exits']} time(s) other than by the planned kill, and was started again)")
    if _finished(ft) and _finished(cr):
        print(f"\nfault tolerance / checkpoint-restart wall time: {ft['wall_s'] / cr['wall_s']:.2f}; steps trained "
              f"twice (completed again + interrupted redone): {ft['completed_again'] + ft['interrupted_redone']} "
              f"against {cr['completed_again'] + cr['interrupted_redone']}.")
    else:
        print("\nno ratio: an arm did not finish (above).")
    print("completed again: completed steps trained a second time (the restart's steps since its checkpoint); "
          "interrupted redone: steps cut by a kill and trained again; processes: the training processes started, "
          "those that failed before training included (fault tolerance restarts one group's, torchrun every rank's).")
    print(common.load_note(*result["load"]))


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
