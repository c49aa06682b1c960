"""Emulated compute regions on a shared host: how long a slowed region lasts against its emulated length.

    python -m benchmarks.bench_emulation                  # 4 processes at slowdowns 2, 2, 4, 4 on this host
    python -m benchmarks.bench_emulation --slowdowns 1,1,2,2 --regions 300
    python -m benchmarks.bench_emulation --quick                  # 40 regions per process

EMULATED ON CPU: each process stands for one GPU of a cluster. It runs compute regions (a few matrix
products, one thread) inside a :class:`~cephalo_lightning.runtime.emulation.emulator.DeviceEmulator`
and reads, per region, on this host:

* the region's compute without the time the process waited for a core (``ContentionClock``),
* the region's wall time, and
* the run-queue wait inside it (wall before the emulator's wait minus compute).

The emulated length of a region is ``slowdown x compute``. Printed per process: the regions' wall
time over their emulated length, summed over the regions (MEASURED), and what it would have been had the run-queue wait come on
top of the emulated length instead of counting towards the wait after the compute (the emulator's
[Note: covered run-queue wait]; computed from the same regions' measured run-queue wait). A process at
slowdown 1 has no wait to cover its queueing with.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
from typing import Any

from benchmarks.harness import Benchmark
from cephalo_lightning.runtime.observers import Observer
from cephalo_lightning.runtime.timing import ContentionClock


class _Probe(Observer):
    """Attached after the emulator (its region ends first): the region's compute and its run-queue wait,
    read before the emulator waits."""

    def __init__(self) -> None:
        self.start: ContentionClock | None = None
        self.compute_s = 0.0
        self.queued_s = 0.0

    def compute_begin(self, region: str) -> None:
        self.start = ContentionClock.now()

    def compute_end(self, region: str) -> None:
        now = ContentionClock.now()
        self.compute_s = now.since(self.start)
        self.queued_s = now.queued_since(self.start)


def _rank(rank: int, slowdown: float, regions: int, products: int, out: mp.Queue) -> None:
    import torch

    from cephalo_lightning.runtime.emulation.emulator import DeviceEmulator
    from cephalo_lightning.runtime.observers import Observers

    torch.set_num_threads(1)
    probe = _Probe()
    observers = Observers()
    observers.attach(DeviceEmulator(slowdown))
    observers.attach(probe)
    a = torch.randn(256, 256)
    walls, emulated, queued = 0.0, 0.0, 0.0
    for i in range(regions):
        start = ContentionClock.now()
        with observers.compute("layer_forward"):
            for _ in range(products):
                a @ a
        wall = ContentionClock.now().wall - start.wall
        if i >= regions // 10:  # warm-up left out
            walls += wall
            emulated += slowdown * probe.compute_s
            queued += probe.queued_s
    out.put((rank, slowdown, walls / emulated, (emulated + queued) / emulated))


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slowdowns", default="2,2,4,4", help="one slowdown per process")
    parser.add_argument("--regions", type=int, help="compute regions per process (default 200; --quick 40)")
    parser.add_argument("--products", type=int, default=20, help="256 x 256 matrix products per region")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    slowdowns = [float(s) for s in args.slowdowns.split(",")]
    regions = args.regions or (40 if args.quick else 200)
    out: mp.Queue = mp.Queue()
    procs = [mp.get_context("fork").Process(target=_rank, args=(r, s, regions, args.products, out))
             for r, s in enumerate(slowdowns)]
    for p in procs:
        p.start()
    results = sorted(out.get() for _ in procs)
    for p in procs:
        p.join()
    return {"slowdowns": slowdowns, "cores": mp.cpu_count(), "regions": regions,
            "rows": [{"rank": rank, "slowdown": slowdown, "wall_over_emulated": ratio, "queued_on_top": uncovered}
                     for rank, slowdown, ratio, uncovered in results]}


def print_report(result: dict[str, Any]) -> None:
    slowdowns = result["slowdowns"]
    print(f"EMULATED: {len(slowdowns)} processes on this host's {result['cores']} cores stand for GPUs at slowdowns "
          f"{','.join(f'{s:g}' for s in slowdowns)} (they ask for {sum(1 / s for s in slowdowns):.2f} cores); "
          "totals over the regions")
    print("rank  slowdown  region wall / emulated length (MEASURED)  with the run-queue wait on top (same regions)")
    for r in result["rows"]:
        print(f"{r['rank']:>4}  {r['slowdown']:>8g}  {r['wall_over_emulated']:>41.3f}  {r['queued_on_top']:>38.3f}")


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
