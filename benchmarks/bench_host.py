"""What the host does to an emulated cluster's compute, which no per-rank cost model sees.

``bench_fidelity.py`` predicts every plan's step from one calibrated compute scale per rank. This
benchmark measures, on the machine it runs on, the two host effects that make such a scale depend
on the plan:

1. **The host's speed** (MEASURED, no emulation): the same chunk of single-thread work (about
   30 ms), timed again and again on the thread's CPU clock, on each core alone and on every core
   at once. A dedicated core does every chunk alike; a virtual machine's vCPU, whose physical core
   the hypervisor shares (another guest on its sibling hyper-thread), does some chunks much slower,
   and nothing inside the guest reports it (no steal time), so the slower chunks count as compute.
2. **What that does to a cluster** (EMULATED: cluster A of ``bench_fidelity``, one rank at x1 and
   one at x3 on gloo): six hand-made plans that move the x3 rank's batch (8 or 16 samples) and
   its kind (its graph kept, one or two recomputed micro-batches), measured in interleaved rounds;
   every rank's busy time over the profile's prediction. A rank whose every layer runs beside more
   of the other rank's real compute measures a higher ratio; one compute scale fitted on one plan
   carries its ratio to all the others.

Run: ``python -m benchmarks.bench_host [--seconds 8] [--rounds 3] [--quick] [--json PATH]`` (about 2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

from benchmarks import _common as common
from benchmarks.harness import Benchmark

# ----------------------------------------------------------------------------- 1. the host's speed, measured

CHUNK_SHAPE = (1024, 128, 512)  # rows x width x hidden: one MLP of the demo GPT at 16 samples of 64 tokens
CHUNK_FORWARDS = 20  # one chunk: about 30 ms of one core


def _chunks(core: int, seconds: float, start: Any, out: Any) -> None:
    """One process pinned to ``core``: the CPU ms of each chunk of the same work, for ``seconds``."""
    import torch

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    rows, width, hidden = CHUNK_SHAPE
    x, up, down = torch.randn(rows, width), torch.randn(width, hidden), torch.randn(hidden, width)
    for _ in range(10):  # warm
        torch.relu(x @ up) @ down
    start.wait()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        begin = time.thread_time()
        for _ in range(CHUNK_FORWARDS):
            torch.relu(x @ up) @ down
        times.append((time.thread_time() - begin) * 1e3)
    out.put((core, times))


def host_speed(seconds: float) -> dict[str, Any]:
    """Each core's chunk times alone, then every core's at once (the same work in every chunk)."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    ctx = mp.get_context("spawn")

    def run(on: list[int]) -> dict[int, list[float]]:
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_chunks, args=(c, seconds, start, out)) for c in on]
        for p in procs:
            p.start()
        time.sleep(1.0)  # every process imported torch and warmed up
        start.set()
        got = dict(out.get() for _ in procs)
        for p in procs:
            p.join()
        return got

    runs = [(f"core {c} alone", run([c])[c]) for c in cores]
    together = run(cores)
    runs += [(f"core {c}, every core busy", together[c]) for c in cores]
    fastest = min(statistics.quantiles(t, n=10)[0] for _, t in runs)  # the fastest decile of any run
    return {"cores": cores, "seconds": seconds, "forwards_per_chunk": CHUNK_FORWARDS, "fastest_ms": fastest,
            "runs": [{"name": name, "chunk_ms": t} for name, t in runs]}


def _describe_chunks(times: list[float], fastest: float) -> list[str]:
    """Median, 10th and 90th percentiles over the fastest decile, and the share of chunks 1.3x slower."""
    deciles = statistics.quantiles(times, n=10)
    slow = sum(t > 1.3 * fastest for t in times) / len(times)
    return [str(len(times)), f"x{statistics.median(times) / fastest:.2f}", f"x{deciles[0] / fastest:.2f}",
            f"x{deciles[-1] / fastest:.2f}", f"{100 * slow:.0f}%"]


# ----------------------------------------------------------------------------- 2. cluster A, emulated

def _plans(profiled: Any) -> dict[str, Any]:
    from cephalo_lightning.planner import Plan, RankPlan

    def plan(b0: int, n0: int, b1: int, n1: int, recompute1: bool) -> Any:
        ranks = (RankPlan(0, profiled.devices[0].name, b0, n0, -(-b0 // n0), 0.32),
                 RankPlan(1, profiled.devices[1].name, b1, n1, -(-b1 // n1), 0.68, recompute=recompute1))
        return Plan(b0 + b1, "layered", ranks)

    return {  # x1 rank: 2 recomputed micro-batches; x3 rank: what varies
        "24 | 8 kept": plan(24, 2, 8, 1, False), "24 | 8 recomputed": plan(24, 2, 8, 1, True),
        "24 | 8 in 2": plan(24, 2, 8, 2, True), "16 | 16 kept": plan(16, 2, 16, 1, False),
        "16 | 16 recomputed": plan(16, 2, 16, 1, True), "16 | 16 in 2": plan(16, 2, 16, 2, True),
    }


def _cluster_a(rank: int, world: int, rounds: int) -> dict[str, Any]:
    from benchmarks import bench_fidelity as fidelity
    from cephalo_lightning.planner.cost.cluster_cost import predicted_busy_s

    common.quiet_lightning()
    common.pin_threads(1)
    cfg, cluster = fidelity.Config(), fidelity.CLUSTERS[0]
    profiled = fidelity.profile(cfg, cluster)
    plans = _plans(profiled)
    windows: dict[str, list[dict[str, Any]]] = {name: [] for name in plans}
    for r in range(rounds):  # interleaved, the order rotated: the host's drift reaches every plan alike
        for name in common.rotated(list(plans), r):
            windows[name].extend(fidelity._measure_plan(cfg, cluster, plans[name])["history"])
    out = {}
    for name, plan in plans.items():
        predicted = predicted_busy_s(profiled, plan)
        busy = [statistics.median(w["ranks"][i]["measured_busy_s"] for w in windows[name]) for i in range(world)]
        out[name] = {"step_s": statistics.median(w["step_s"] for w in windows[name]), "busy_s": busy,
                     "profile_busy_s": predicted, "ratio": [b / p for b, p in zip(busy, predicted)]}
    return {"cluster": cluster.note, "emulate": cluster.emulate, "plans": out}


def run_host(seconds: float, rounds: int) -> dict[str, Any]:
    before = common.load_average()
    host = host_speed(seconds)
    cluster = common.run_ranks(_cluster_a, 2, rounds)[0]
    return {"environment": common.environment_note(), "load": common.load_span(before),
            "host_speed": host, "cluster_a": cluster}


def print_report(result: dict[str, Any]) -> None:
    host = result["host_speed"]
    print(result["environment"])
    print(common.load_note(*result["load"]))
    rows = [[run["name"], *_describe_chunks(run["chunk_ms"], host["fastest_ms"])] for run in host["runs"]]
    common.print_table(["run", "chunks", "median", "10th pct", "90th pct", "chunks >= x1.3"], rows,
                       title=f"1. MEASURED: CPU ms of the same chunk of work ({host['forwards_per_chunk']} MLP forwards, "
                             f"one thread, {host['seconds']:.0f} s per run) over the fastest decile of any run "
                             f"({host['fastest_ms']:.1f} ms)")
    print()
    plans = result["cluster_a"]["plans"]
    rows = [[name, f"{p['step_s'] * 1e3:.1f}", *(f"{b * 1e3:.1f} / {q * 1e3:.1f} = {r:.3f}"
                                                 for b, q, r in zip(p["busy_s"], p["profile_busy_s"], p["ratio"]))]
            for name, p in plans.items()]
    common.print_table(["plan (x1 | x3 samples)", "step ms", "x1 busy / profile", "x3 busy / profile"], rows,
                       title="2. EMULATED (cluster A: x1 and x3 on gloo): every rank's busy time against its profile")
    fitted = plans["24 | 8 kept"]["ratio"]
    misses = [max((p["ratio"][i] / fitted[i] - 1 for p in plans.values()), key=abs) for i in range(len(fitted))]
    print(f"a compute scale per rank fitted on '24 | 8 kept' ({', '.join(f'{r:.3f}' for r in fitted)}) misses another "
          f"plan's by up to {', '.join(f'{100 * m:+.1f}%' for m in misses)} (x1, x3)")


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, help="seconds per host-speed run (default 8; --quick 2)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of cluster A's plans (default 3; --quick 1)")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    return run_host(args.seconds or (2.0 if args.quick else 8.0), args.rounds or (1 if args.quick else 3))


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
