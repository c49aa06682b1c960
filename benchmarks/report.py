"""Run the results page's benchmarks into ``docs/benchmarks/results.json``, then render ``docs/benchmarks/report.md``
and its plots from that file alone (``make bench``).

    python -m benchmarks.report            # full runs (~10-15 min on 2 cores)
    python -m benchmarks.report --quick    # each benchmark's smoke-run flags (~4 min)
    python -m benchmarks.report --replot   # render the page and its plots from results.json, run nothing
    python -m benchmarks.report --only lab_cluster   # run these alone, keep the others' stored results

The benchmarks are the registry's entries with ``in_report`` (``benchmarks/registry.py``), each run as
its command line would run it. ``results.json`` holds each one's result as its ``--json`` writes it, and
under ``_runs`` the date, length and flags of its run. Each section of the page holds the benchmark's own
printed tables of its stored result (what it measured, emulated or predicted) and plots of its headline
figures: the page is a function of the JSON, so no figure on it is typed by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks.harness import comma_list, to_json
from benchmarks.registry import BENCHMARKS, Entry

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"  # the results page, its plots and results.json


# ----------------------------------------------------------------------------- plots


@dataclass(frozen=True)
class Figure:
    """One plot of a section: its file ``<name>.png`` beside the page, its title, and how to draw it.
    The page names it (``markdown``) without drawing; ``save`` draws it."""

    name: str
    title: str
    draw: Callable[[Any], None]

    @property
    def markdown(self) -> str:
        return f"![{self.title}]({self.name}.png)"

    def save(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 3.8))
        self.draw(ax)
        ax.set_title(self.title, fontsize=10)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(OUT / f"{self.name}.png", dpi=110)
        plt.close(fig)


def plot_planner(rows: list[dict[str, Any]]) -> Figure:
    def draw(ax: Any) -> None:
        for gpus in sorted({r["gpus"] for r in rows}):
            mine = [r for r in rows if r["gpus"] == gpus]
            ax.plot([r["global_batch"] for r in mine], [r["plan_s"] for r in mine], marker="o", label=f"{gpus} GPUs")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global batch")
        ax.set_ylabel("planner time (s, measured)")
        ax.legend()

    return Figure("planner_time", "Planner wall time (measured on this CPU)", draw)


def plot_planner_scaling(rows: list[dict[str, Any]]) -> Figure:
    def draw(ax: Any) -> None:
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

    return Figure("planner_scaling", f"Planner scaling at B = {rows[0]['global_batch']:,}: time and peak memory", draw)


def plot_fidelity(result: dict[str, Any]) -> Figure:
    def draw(ax: Any) -> None:
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

    return Figure("fidelity", "Plan fidelity per rank: measured / predicted", draw)


def plot_planner_quality(rows: list[dict[str, Any]]) -> Figure:
    def draw(ax: Any) -> None:
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

    return Figure("planner_vs_even", "Cephalo plan vs the even split (predicted; catalog cluster)", draw)


def plot_collectives(rows: list[dict[str, Any]]) -> Figure:
    def draw(ax: Any) -> None:
        for world in sorted({r["world_size"] for r in rows}):
            mine = sorted((r for r in rows if r["world_size"] == world and r["op"] == "all_gather"),
                          key=lambda r: r["imbalance"])
            ax.plot([r["imbalance"] for r in mine], [r["padded_ratio"] for r in mine], marker="o", label=f"padded W={world}")
            ax.plot([r["imbalance"] for r in mine], [r["exact_ratio"] for r in mine], marker="s", ls="--",
                    label=f"exact W={world}")
        ax.set_xlabel("imbalance W*rho - 1")
        ax.set_ylabel("all-gather time / even (measured)")
        ax.legend(fontsize=7)

    return Figure("collectives", "Uneven all-gather cost, padded vs exact (gloo, measured)", draw)


def plot_layered_memory(rows: list[dict[str, Any]]) -> Figure:
    def draw(ax: Any) -> None:
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

    return Figure("layered_memory", "Peak memory vs micro-batch count (measured, stash on emulated host)", draw)


def plot_plans(rows: list[dict[str, Any]], name: str, title: str, key: str = "plan") -> Figure:
    def draw(ax: Any) -> None:
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

    return Figure(name, title, draw)


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


def plot_strategies(rows: list[dict[str, Any]]) -> Figure:
    def draw(ax: Any) -> None:
        ax.bar([r["strategy"] for r in rows], [r["step_ms"] for r in rows])
        ax.set_ylabel("median step (ms, measured)")

    return Figure("strategies", "Trainer.fit step time on 2 gloo ranks, even plan (measured)", draw)


def plot_lab_cluster(rows: list[dict[str, Any]]) -> Figure:
    def draw(ax: Any) -> None:
        variants = [key for key in rows[0] if key not in ("job", "batch")]
        xs = range(len(rows))
        width = 0.8 / len(variants)
        for i, variant in enumerate(variants):
            offset = (i - (len(variants) - 1) / 2) * width
            ax.bar([x + offset for x in xs], [r[variant]["samples_per_s"] for r in rows], width=width, label=variant)
        ax.set_xticks(list(xs), [f"{r['job']}\nB = {r['batch']}" for r in rows])
        ax.set_yscale("log")
        ax.set_ylabel("samples/s (predicted)")
        ax.legend(fontsize=7)

    return Figure("lab_cluster", "4x A100 + 4x RTX 3090 on 10 GbE: free links, overlap 1, overlap 0 (predicted)", draw)


# ----------------------------------------------------------------------------- report

PLOTS: dict[str, Callable[[Any], list[Figure]]] = {
    "planner": lambda r: [plot_planner_scaling(r["scaling"]), plot_planner(r["quality"]),
                          plot_planner_quality(r["quality"])],
    "runtime": lambda r: [plot_collectives(r["collectives"])] if r["collectives"] else [],
    "layered": lambda r: [plot_layered_memory(r["memory"])] if r["memory"] else [],
    "strategy": lambda r: [plot_strategies(r["strategies"])],
    "emulated": lambda r: [plot_plans(r["plans"], "emulated_plans", "Emulated 2-rank CPU cluster: measured vs predicted")],
    "fidelity": lambda r: [plot_fidelity(r)],
    "lab_cluster": lambda r: [plot_lab_cluster(r["rows"])],
}

RUNS = "_runs"  # results.json's record of each section's run: {name: {"date", "seconds", "quick"}}
HEADER = (
    "# Benchmark report\n\n"
    "Rendered by `python -m benchmarks.report` from `docs/benchmarks/results.json` (the benchmarks' results, "
    "as their `--json` writes them); `make bench` runs them again. Machine: CPU only; every runtime figure comes "
    "from 2-4 CPU processes on gloo, and heterogeneous devices are EMULATED (per-rank slowdown and "
    "memory capacity). Planner figures are predictions of the cost model. Each table says which "
    "figures are measured, emulated or predicted.\n"
)


def report_entries() -> list[Entry]:
    return [entry for entry in BENCHMARKS if entry.in_report]


def figures(stored: dict[str, Any]) -> list[Figure]:
    return [figure for entry in report_entries() if entry.name in stored
            for figure in PLOTS.get(entry.name, lambda r: [])(stored[entry.name])]


def printed_report(entry: Entry, result: Any) -> str:
    """The benchmark's own tables of ``result``, as its command line prints them."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        entry.load().print_report(result)
    return text.getvalue().rstrip()


def render(stored: dict[str, Any]) -> str:
    """The results page from the stored results alone (``results.json`` as read back): every figure on
    it is the benchmarks' (``tests/test_benchmarks.py`` renders the committed file against the page)."""
    sections = []
    for entry in report_entries():
        if entry.name not in stored:
            continue
        run = stored[RUNS][entry.name]
        images = [figure.markdown for figure in PLOTS.get(entry.name, lambda r: [])(stored[entry.name])]
        sections.append(f"## {entry.title}\n\n_Run on {run['date']}{' with --quick' if run['quick'] else ''}, "
                        f"{run['seconds']:.0f} s._\n\n" + "\n\n".join(images)
                        + f"\n\n```\n{printed_report(entry, stored[entry.name])}\n```\n")
    return HEADER + "\n" + "\n".join(sections)


def _run(entry: Entry, quick: bool) -> tuple[Any, dict[str, Any]]:
    """Run one benchmark as its command line would; its result and the record of the run."""
    start = time.perf_counter()
    result, _ = entry.load().run(list(entry.quick_args) if quick else [])
    seconds = time.perf_counter() - start
    return result, {"date": time.strftime("%Y-%m-%d", time.gmtime()), "seconds": round(seconds, 1), "quick": quick}


def write_page(stored_text: str) -> None:
    """Render the page and draw its plots from the results as stored (the JSON read back, not the live objects)."""
    stored = json.loads(stored_text)
    for figure in figures(stored):
        figure.save()
    (OUT / "report.md").write_text(render(stored))
    print(f"wrote {OUT / 'report.md'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="each benchmark's smoke-run flags")
    parser.add_argument("--replot", action="store_true",
                        help="render report.md and redraw the plots from docs/benchmarks/results.json, run nothing")
    parser.add_argument("--only", type=comma_list([entry.name for entry in report_entries()]), metavar="NAMES",
                        help="run only these benchmarks (comma-separated) and keep the other results as stored")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    if args.replot:
        write_page((OUT / "results.json").read_text())
        return 0
    raw: dict[str, Any] = {RUNS: {}}
    if args.only:
        raw = json.loads((OUT / "results.json").read_text())
    for entry in report_entries():
        if args.only and entry.name not in args.only:
            continue
        print(f"== {entry.title}", flush=True)
        raw[entry.name], raw[RUNS][entry.name] = _run(entry, args.quick)
        print(printed_report(entry, raw[entry.name]), flush=True)
    (OUT / "results.json").write_text(to_json(raw) + "\n")
    write_page((OUT / "results.json").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
