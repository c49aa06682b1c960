"""Shared helpers for the CPU benchmarks: gloo ranks, interleaved timing, plain-text tables.

Importing this module has no side effects. The benchmarks run as modules from the repository root
(``python -m benchmarks.bench_x``), so this checkout's ``cephalo_lightning`` and ``benchmarks`` import.

Every figure these benchmarks print is a CPU measurement over gloo (processes on one machine), not
a GPU/NCCL one; ratios are measured side by side in one run with the variants interleaved, so that
the machine's noise hits all of them alike.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from cephalo_lightning.testing.local_ranks import run_local_ranks

CPU_NOTE = ("All figures are CPU measurements: ranks are processes on one machine talking over gloo "
            "(torch {torch}, {cores} cores, {threads} thread(s) per rank), not GPUs over NCCL.")


def environment_note(threads_per_rank: int = 1) -> str:
    return CPU_NOTE.format(torch=torch.__version__, cores=os.cpu_count(), threads=threads_per_rank)


def load_average() -> float:
    """The machine's 1-minute load average (other processes competing for the cores add noise)."""
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - not on every platform
        return float("nan")


def load_span(before: float) -> tuple[float, float, int]:
    """The load average before and now, with the machine's cores: what ``load_note`` prints, stored in a
    result so that its printed tables (the results page renders them from the JSON) read no live state."""
    return before, load_average(), os.cpu_count() or 1


def load_note(before: float, after: float, cores: int) -> str:
    return (f"1-minute load average before / after the run: {before:.2f} / {after:.2f} on {cores} cores "
            "(the benchmark's own ranks count; more than that means other processes competed for the cores).")


# ----------------------------------------------------------------------------- gloo ranks


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks (see ``run_local_ranks``)."""
    return run_local_ranks(fn, world_size, *args, threads=threads)


# ----------------------------------------------------------------------------- timing


def run_parts(parts: Sequence[str], measurements: Mapping[str, Callable[[], Any]]) -> dict[str, Any]:
    """The measurements named in ``parts``, in the mapping's order, garbage collected after each (so
    that one's leftovers do not weigh on the next)."""
    out: dict[str, Any] = {}
    for name, measure in measurements.items():
        if name in parts:
            out[name] = measure()
            gc.collect()
    return out


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def interleaved_times(variants: Mapping[str, Callable[[], Any]], repeats: int, warmup: int = 2,
                      sync: bool = True) -> dict[str, list[float]]:
    """Wall seconds of every variant, run in alternating rounds: round i runs all variants, in an
    order rotated by i (so no variant always goes first). ``warmup`` rounds are not recorded.

    With ``sync`` (and a process group) every call is fenced by barriers, so the time is that of the
    collective step as the slowest rank sees it. Every rank must call this with the same variants.
    """
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + repeats):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            if sync:
                barrier()
            start = time.perf_counter()
            variants[name]()
            if sync:
                barrier()
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times[name].append(elapsed)
    return times


def max_over_ranks(values: Sequence[float]) -> list[float]:
    """Element-wise maximum of a list of floats over the ranks (identity without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """Median of the per-round ratios: each ratio compares two runs taken seconds apart."""
    return median([a / b for a, b in zip(numerator, denominator) if b > 0])


def fit_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares s in y = 1 + s * x (a line through (0, 1))."""
    num = sum(x * (y - 1.0) for x, y in zip(xs, ys))
    den = sum(x * x for x in xs)
    return num / den if den > 0 else 0.0


# ----------------------------------------------------------------------------- tables


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A plain-text table, right-aligned columns; cells are formatted with ``str``."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(h.rjust(w) for h, w in zip(cells[0], widths)))
    lines.append("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    return "\n".join(lines)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> None:
    print(format_table(headers, rows, title))
    print()


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


# ----------------------------------------------------------------------------- Lightning fits on gloo ranks


def quiet_lightning() -> None:
    """Silence Lightning's info lines and warnings inside benchmark ranks (tables stay readable)."""
    import logging
    import warnings

    warnings.simplefilter("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning.pytorch.utilities.rank_zero",
                 "cephalo_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)


def pin_threads(threads: int) -> None:
    """Same intra-op threads for every strategy of a run (CephaloStrategy picks its own count unless
    ``OMP_NUM_THREADS`` is set; the built-in strategies keep the process's)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_STEP_TIMER: type | None = None


def step_timer() -> Any:
    """A Lightning ``Callback`` recording wall clock at every ``on_train_batch_start`` / ``_end``.

    ``step_s(skip)``: start -> end of each batch (training_step, backward, optimizer step, the
    strategy's and callbacks' batch hooks); ``iteration_s(skip)``: end -> next end (everything the
    loop does per batch, data loading and logging included); ``cpu_s(skip)``: the process's CPU
    time from start to end of each batch (all its threads; time spent waiting, for a collective or
    for a core that another program holds, does not count, so it is far less sensitive to the
    machine's load than wall time). ``skip`` leaves out warm-up batches. Built lazily so that
    importing this module does not import Lightning.
    """
    global _STEP_TIMER
    if _STEP_TIMER is None:
        from lightning.pytorch.callbacks import Callback

        class StepTimer(Callback):
            def __init__(self) -> None:
                self.starts: list[float] = []
                self.ends: list[float] = []
                self.cpu_starts: list[float] = []
                self.cpu_ends: list[float] = []

            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                self.cpu_starts.append(time.process_time())
                self.starts.append(time.perf_counter())

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                                   batch_idx: int) -> None:
                self.ends.append(time.perf_counter())
                self.cpu_ends.append(time.process_time())

            def cpu_s(self, skip: int = 0) -> list[float]:
                return [e - s for s, e in zip(self.cpu_starts, self.cpu_ends)][skip:]

            def step_s(self, skip: int = 0) -> list[float]:
                return [e - s for s, e in zip(self.starts, self.ends)][skip:]

            def iteration_s(self, skip: int = 0) -> list[float]:
                return [b - a for a, b in zip(self.ends, self.ends[1:])][max(0, skip - 1):]

        _STEP_TIMER = StepTimer
    return _STEP_TIMER()


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """``names`` rotated by ``round_index`` (round i starts with a different variant)."""
    shift = round_index % len(names)
    return list(names[shift:]) + list(names[:shift])


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1, linear interpolation); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


def max_over_rank_results(per_rank: Sequence[Mapping[str, Sequence[Mapping[str, Any]]]],
                          keys: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """Combine the ranks' ``{variant: [fit, ...]}`` results: for each fit, the element-wise maximum
    over the ranks of each per-batch list in ``keys`` (a batch takes as long as its slowest rank);
    other fields come from rank 0.

    Done in the parent rather than with a collective at the end of the ranks' work: a spawned rank
    whose last act is a collective can abort at exit (SIGABRT, "terminate called without an active
    exception") when gloo's worker thread is still releasing that collective's tensors while Python
    finalizes (pytorch#190489); seen in about 1 run in 3 on a loaded 2-core machine.
    """
    out: dict[str, list[dict[str, Any]]] = {}
    for name, fits in per_rank[0].items():
        out[name] = []
        for i, fit in enumerate(fits):
            merged = dict(fit)
            for key in keys:
                merged[key] = [max(values) for values in zip(*(r[name][i][key] for r in per_rank))]
            out[name].append(merged)
    return out
