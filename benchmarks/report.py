"""Run the results page's benchmarks and write ``docs/benchmarks/report.md`` with plots (``make bench``).

    python -m benchmarks.report            # full runs (~10-15 min on 2 cores)
    python -m benchmarks.report --quick    # each benchmark's smoke-run flags (~4 min)
    python -m benchmarks.report --replot   # redraw the plots from docs/benchmarks/results.json, run nothing

The benchmarks are the registry's entries with ``in_report`` (``benchmarks/registry.py``), each run as
its command line would run it. Each section holds the benchmark's own printed tables (what it measured,
emulated or predicted) and plots of its headline figures; ``results.json`` keeps the raw results.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.harness import to_json
from benchmarks.registry import BENCHMARKS, Entry

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"  # the results page, its plots and results.json


# ----------------------------------------------------------------------------- plots


def _figure(name: str, draw: Callable[[Any], str]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    title = draw(ax)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(OUT / f"{name}.png", dpi=110)
    plt.close(fig)
    return f"![{title}]({name}.png)"


def plot_planner(rows: list[dict[str, Any]]) -> str:
    def draw(ax: Any) -> str:
        for gpus in sorted({r["gpus"] for r in rows}):
            mine = [r for r in rows if r["gpus"] == gpus]
            ax.plot([r["global_batch"] for r in mine], [r["plan_s"] for r in mine], marker="o", label=f"{gpus} GPUs")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global batch")
        ax.set_ylabel("planner time (s, measured)")
        ax.legend()
        return "Planner wall time (measured on this CPU)"

    return _figure("planner_time", draw)


def plot_planner_scaling(rows: list[dict[str, Any]]) -> str:
    def draw(ax: Any) -> str:
        gpus = [r["gpus"] for r in rows]
        ax.plot(gpus, [r["plan_s"] for r in rows], marker="o", label="plan time (s)")
        ax.set_xscale("log")
        ax.set_xlabel("GPUs (8 kinds)")
        ax.set_ylabel("planner time (s, measured)")
        twin = ax.twinx()
        twin.plot(gpus, [r["peak_mb"] for r in rows], marker="s", color="tab:orange", label="peak MB")
        twin.set_ylabel("peak resident MB (measured)")
        ax.legend(loc="upper left", fontsize=8)
        twin.legend(loc="upper right", fontsize=8)
        return f"Planner scaling at B = {rows[0]['global_batch']:,}: time and peak memory"

    return _figure("planner_scaling", draw)


def plot_fidelity(result: dict[str, Any]) -> str:
    def draw(ax: Any) -> str:
        labels, steps, memory = [], [], []
        for c in result["clusters"]:
            if "failed" in c:
                continue
            for r in c["ranks"]:
                labels.append(f"{c['cluster']['name']}{r['rank']}")
                steps.append(r["step_ratio"] if r["bottleneck"] else float("nan"))
                memory.append(r["memory_ratio"] if r["memory_ratio"] is not None else float("nan"))
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], steps, width=0.4, label="step (slowest rank)")
        ax.bar([i + 0.2 for i in x], memory, width=0.4, label="peak memory")
        ax.axhspan(0.9, 1.1, color="green", alpha=0.15, label="within 10%")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_ylabel("measured / predicted (EMULATED)")
        ax.legend(fontsize=8)
        return "Plan fidelity per rank: measured / predicted"

    return _figure("fidelity", draw)


def plot_planner_quality(rows: list[dict[str, Any]]) -> str:
    def draw(ax: Any) -> str:
        missing = []
        for gpus in sorted({r["gpus"] for r in rows}):
            mine = [r for r in rows if r["gpus"] == gpus and r.get("speedup_vs_even")]
            if mine:
                ax.plot([r["global_batch"] for r in mine], [r["speedup_vs_even"] for r in mine], marker="o",
                        label=f"{gpus} GPUs")
            else:  # the ratio has no denominator
                reason = next((r.get("even_reason") for r in rows if r["gpus"] == gpus), None)
                missing.append(f"no {gpus}-GPU series: the even split does not fit ({reason or 'infeasible'})")
        if missing:
            ax.text(0.42, 0.2, textwrap.fill("; ".join(missing), 60), transform=ax.transAxes, fontsize=6.5,
                    va="bottom", color="dimgrey")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global batch")
        ax.set_ylabel("plan / even (predicted samples/s)")
        ax.legend()
        return "Cephalo plan vs the even split (predicted; catalog cluster)"

    return _figure("planner_vs_even", draw)


def plot_collectives(rows: list[dict[str, Any]]) -> str:
    def draw(ax: Any) -> str:
        for world in sorted({r["world_size"] for r in rows}):
            mine = sorted((r for r in rows if r["world_size"] == world and r["op"] == "all_gather"),
                          key=lambda r: r["imbalance"])
            ax.plot([r["imbalance"] for r in mine], [r["padded_ratio"] for r in mine], marker="o", label=f"padded W={world}")
            ax.plot([r["imbalance"] for r in mine], [r["exact_ratio"] for r in mine], marker="s", ls="--",
                    label=f"exact W={world}")
        ax.set_xlabel("imbalance W*rho - 1")
        ax.set_ylabel("all-gather time / even (measured)")
        ax.legend(fontsize=7)
        return "Uneven all-gather cost, padded vs exact (gloo, measured)"

    return _figure("collectives", draw)


def plot_layered_memory(rows: list[dict[str, Any]]) -> str:
    def draw(ax: Any) -> str:
        for method in sorted({r["method"] for r in rows}):
            for m in sorted({r["micro_batch_size"] for r in rows}):
                mine = sorted((r for r in rows if r["rank"] == 0 and r["method"] == method and r["micro_batch_size"] == m),
                              key=lambda r: r["micro_batches"])
                ax.plot([r["micro_batches"] for r in mine], [r["peak_with_state_over_n1"] for r in mine], marker="o",
                        label=f"{method}, m={m}")
        ax.axhline(1.10, color="grey", ls=":", lw=1, label="goal: peak(n) <= 1.10 x peak(1)")
        ax.set_xlabel("micro-batches n (fixed micro-batch size m)")
        ax.set_ylabel("peak(n) / peak(1), incl. state")
        ax.legend(fontsize=7)
        return "Peak memory vs micro-batch count (measured, stash on emulated host)"

    return _figure("layered_memory", draw)


def plot_plans(rows: list[dict[str, Any]], name: str, title: str, key: str = "plan") -> str:
    def draw(ax: Any) -> str:
        names = [r[key] for r in rows]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["measured_samples_per_s"] for r in rows], width=0.4, label="measured (emulated)")
        ax.bar([x + 0.2 for x in xs], [r["predicted_samples_per_s"] or 0 for r in rows], width=0.4, label="predicted")
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("samples/s")
        ax.legend()
        same = _identical_plans(rows, key)
        if same:
            ax.text(0.01, 0.02, textwrap.fill(same, 90), transform=ax.transAxes, fontsize=6.5, va="bottom",
                    color="dimgrey", bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
        return title

    return _figure(name, draw)


def _identical_plans(rows: list[dict[str, Any]], key: str) -> str:
    """A note naming plans that assign exactly the same batches, micro-batches and shares: any
    difference between their measured bars is the machine's noise, not the plan."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for r in rows:
        groups.setdefault((tuple(r["batch_sizes"]), tuple(r["micro_batches"]), tuple(r["state_shares"])), []).append(r[key])
    notes = [f"{' and '.join(names)} are the same plan (batches {list(k[0])}, micro-batches {list(k[1])}, "
             f"shares {list(k[2])}): their measured bars differ by noise only"
             for k, names in groups.items() if len(names) > 1]
    return "; ".join(notes)


def plot_strategies(rows: list[dict[str, Any]]) -> str:
    def draw(ax: Any) -> str:
        ax.bar([r["strategy"] for r in rows], [r["step_ms"] for r in rows])
        ax.set_ylabel("median step (ms, measured)")
        return "Trainer.fit step time on 2 gloo ranks, even plan (measured)"

    return _figure("strategies", draw)


# ----------------------------------------------------------------------------- report

PLOTS: dict[str, Callable[[Any], list[str]]] = {
    "planner": lambda r: [plot_planner_scaling(r["scaling"]), plot_planner(r["quality"]),
                          plot_planner_quality(r["quality"])],
    "runtime": lambda r: [plot_collectives(r["collectives"])] if r["collectives"] else [],
    "layered": lambda r: [plot_layered_memory(r["memory"])] if r["memory"] else [],
    "strategy": lambda r: [plot_strategies(r["strategies"])],
    "emulated": lambda r: [plot_plans(r["plans"], "emulated_plans", "Emulated 2-rank CPU cluster: measured vs predicted")],
    "fidelity": lambda r: [plot_fidelity(r)],
}


def _section(entry: Entry, quick: bool) -> tuple[Any, str]:
    """Run one benchmark as its command line would; its result and its section of the page."""
    benchmark = entry.load()
    start = time.perf_counter()
    result, _ = benchmark.run(list(entry.quick_args) if quick else [])
    seconds = time.perf_counter() - start
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        benchmark.print_report(result)
    print(text.getvalue(), flush=True)
    images = PLOTS.get(entry.name, lambda r: [])(result)
    return result, (f"## {entry.title}\n\n_Run time {seconds:.0f} s._\n\n" + "\n\n".join(images)
                    + f"\n\n```\n{text.getvalue().rstrip()}\n```\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="each benchmark's smoke-run flags")
    parser.add_argument("--replot", action="store_true",
                        help="redraw the plots from docs/benchmarks/results.json (report.md and the results stay)")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    entries = [entry for entry in BENCHMARKS if entry.in_report]
    if args.replot:
        stored = json.loads((OUT / "results.json").read_text())
        for entry in entries:
            if entry.name in stored and entry.name in PLOTS:
                print("\n".join(PLOTS[entry.name](stored[entry.name])))
        return 0
    sections: list[str] = []
    raw: dict[str, Any] = {}
    for entry in entries:
        print(f"== {entry.title}", flush=True)
        raw[entry.name], section = _section(entry, args.quick)
        sections.append(section)
    header = (
        "# Benchmark report\n\n"
        f"Generated by `python -m benchmarks.report{' --quick' if args.quick else ''}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Machine: CPU only; every runtime figure comes "
        "from 2-4 CPU processes on gloo, and heterogeneous devices are EMULATED (per-rank slowdown and "
        "memory capacity). Planner figures are predictions of the cost model. Each table says which "
        "figures are measured, emulated or predicted.\n"
    )
    (OUT / "report.md").write_text(header + "\n" + "\n".join(sections))
    (OUT / "results.json").write_text(to_json(raw))
    print(f"wrote {OUT / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
