"""The preemption budget: SIGUSR1 to a checkpoint on disk and the job exited, synchronous and background saves,
at a few state sizes.

    python -m benchmarks.bench_preemption            # depths 2, 8, 16 (about 130 MB, 420 MB, 830 MB of state)
    python -m benchmarks.bench_preemption --quick    # depths 2 and 8

Spot VMs get 30 s of warning (GCP, Azure; AWS 2 minutes); SLURM sends the requeue signal (SIGUSR1 with
``--signal=USR1@S``). Each run is one ``Trainer.fit`` process (``scenarios/preempt_worker.py``) under
``CephaloStrategy(state_dict_type="sharded")`` as a SLURM job with requeueing, one CPU rank training a
TinyLM 1024 wide with AdamW in fp32; the benchmark sends SIGUSR1 once it has trained a few steps and
measures, from the signal:

* **on disk**: until ``last-preempted.ckpt`` is published (the checkpoint folder's final rename);
* **exited**: until the process is gone (its exit status must be 138: saved, requeue asked).

The stop comes at the next step boundary, so up to one step is part of both; the step is printed
beside them. ``async`` is ``CephaloStrategy(async_checkpoint=True)``: at a stop the strategy waits for
the background write to be published before it exits, so the budget holds the whole write either way.
MEASURED on this machine's disk, emulated on CPU: the write's speed is the disk's and the host's.
"""

from __future__ import annotations

import argparse
import json
import signal
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
SLURM = {"SLURM_NTASKS": "1", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "preempted", "SLURM_PROCID": "0",
         "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "127.0.0.1"}
REQUEUED = 128 + signal.SIGUSR1


def _published(path: Path) -> float | None:
    return path.stat().st_mtime if path.exists() else None


def one_stop(work: Path, depth: int, background: bool, deadline_s: float = 600) -> dict[str, Any]:
    from scenarios.launch_env import clean_env

    work.mkdir(parents=True)
    from cephalo_lightning.testing.local_ranks import free_port

    env = clean_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()), **SLURM)
    log = work / "log.txt"
    process = subprocess.Popen([sys.executable, str(ROOT / "scenarios" / "preempt_worker.py"), str(work), str(depth),
                                str(int(background))], cwd=ROOT, env=env, stdout=open(log, "w"),  # noqa: SIM115
                               stderr=subprocess.STDOUT)
    deadline = time.monotonic() + deadline_s
    try:
        while not (work / "ready").exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fit ended or hung before its steps ({process.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(0.02)
        sent = time.time()
        process.send_signal(signal.SIGUSR1)
        process.wait(timeout=deadline_s)
        exited = time.time()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    checkpoint = work / "last-preempted.ckpt"
    if process.returncode != REQUEUED or not checkpoint.exists():
        raise RuntimeError(f"the stop did not save and exit as preempted (status {process.returncode}, checkpoint "
                           f"{'present' if checkpoint.exists() else 'absent'}):\n{log.read_text()[-3000:]}")
    ready = json.loads((work / "ready").read_text())
    on_disk = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    return {"depth": depth, "async": background, "parameters": ready["parameters"], "bytes_on_disk": on_disk,
            "step_s": statistics.median(ready["step_s"]), "on_disk_s": _published(checkpoint) - sent,
            "exited_s": exited - sent}


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--depths", type=lambda s: [int(d) for d in s.split(",")], default=None,
                        help="comma-separated TinyLM depths (default 2,8,16; --quick: 2,8)")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    depths = args.depths or ([2, 8] if args.quick else [2, 8, 16])
    load = common.load_average()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for depth in depths:
            for background in (False, True):
                rows.append(one_stop(Path(tmp) / f"{depth}-{int(background)}", depth, background))
    return {"rows": rows, "load": common.load_span(load)}


def print_report(result: dict[str, Any]) -> None:
    print(common.environment_note())
    print("One Trainer.fit process (one CPU rank, AdamW, fp32) as a SLURM job with requeueing, sent SIGUSR1 "
          "mid-run; the times count from the signal.\n")
    print(f"{'parameters':>11s} {'on disk':>9s} {'save':>6s} {'step':>8s} {'ckpt on disk':>13s} {'exited':>8s} "
          f"{'write MB/s':>11s}")
    for r in result["rows"]:
        rate = r["bytes_on_disk"] / 1e6 / max(r["on_disk_s"] - r["step_s"], 1e-9)
        print(f"{r['parameters'] / 1e6:10.1f}M {r['bytes_on_disk'] / 1e6:7.0f}MB {'async' if r['async'] else 'sync':>6s} "
              f"{r['step_s']:7.2f}s {r['on_disk_s']:12.2f}s {r['exited_s']:7.2f}s {rate:11.0f}")
    print("\nckpt on disk: the signal to the checkpoint's publication (it includes finishing the step in progress); "
          "exited: to the process's end, status 138 (saved, requeue asked). write MB/s: bytes on disk over "
          "(on disk - one step), a rough rate. A budget of 30 s holds the state the rate writes in 30 s, less "
          "one step and the exit.")
    print(common.load_note(*result["load"]))


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
