"""Plans a person can read: what binds each rank (checked against the cost model's own figures on
clusters built so that each constraint binds), the table's legend, baselines and lines, the help
texts, ``plan --plot`` and the blocks of docs/plan-reading.md."""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cephalo_lightning._common.units import memory_text
from cephalo_lightning._common.vocabulary import Planner
from cephalo_lightning.planner import Cluster, Plan, cluster_from_dict, load_cluster, plan
from cephalo_lightning.planner.command import main as plan_main
from cephalo_lightning.planner.cost.cluster_cost import collective_ms
from cephalo_lightning.planner.cost.device_cost import DeviceCost
from cephalo_lightning.planner.cost.prices import FREE
from cephalo_lightning.planner.report import (
    CATALOG,
    LEGEND,
    LEGEND_BINDS,
    baseline_lines,
    next_line,
    render_plan,
    summary_lines,
)
from cephalo_lightning.planner.schema.plan import Binding
from cephalo_lightning.planner.search.peers import BASELINE_GROUPINGS, BASELINES
from tests.planner_cases import free_unless_priced
from tests.plans import plan_of

LAYERS = 4


def device(name: str, memory: float, compute_memory: list[float], fwd: list[float] | None = None,
           count: int = 1) -> dict[str, Any]:
    fwd = fwd or [1.0, 2.0]
    return {"name": name, "memory_gb": memory, "layer_fwd_ms": fwd, "layer_bwd_ms": [2 * f for f in fwd],
            "compute_memory_gb": compute_memory, "count": count}


def cluster(devices: list[dict[str, Any]], **settings: Any) -> Cluster:
    """A 1e9-parameter model (14.9 GiB of state at 16 bytes a parameter), nothing reserved, no
    micro-batch overhead, all of every device's memory usable."""
    return cluster_from_dict({
        "model": {"name": "m", "num_layers": LAYERS, "parameters": 1_000_000_000},
        "settings": free_unless_priced({"reserved_memory_gb": 0, "micro_batch_overhead_ms": 0,
                                        "usable_memory_fraction": 1.0, **settings}),
        "devices": devices})


def s(value: float) -> str:
    return f"{value:.3g} s"


# two big devices and a small one whose one sample does not fit beside its share of the state,
# over a slow link (20 ms per layer's all-gather and reduce-scatter): the big ones are link-bound
SLOW_LINK = cluster([device("big", 80, [1.0, 2.0], count=2), device("small", 8, [7.5, 15.0])],
                    allgather_ms=20.0, reduce_scatter_ms=20.0)
FAST = cluster([device("a", 80, [1.0, 2.0], fwd=[10.0, 20.0], count=2)])  # no collectives priced: compute binds


def test_a_rank_without_samples_because_of_memory_says_what_one_sample_would_need() -> None:
    p = plan(SLOW_LINK, 8)
    small = p.ranks[2]
    assert small.batch_size == 0 and small.binding is Binding.MEMORY
    cost = DeviceCost(SLOW_LINK.devices[2], SLOW_LINK)
    need = cost.memory_gb(1, small.state_share, 0.0, num_micro_batches=1, batch_size=1)
    assert need > small.memory_limit_gb == 8.0
    assert small.why == (f"stores {100 * small.state_share:.3g}% of the state; computing one sample would need "
                         f"{need:.3g} GiB of 8 GiB usable")
    assert Plan.from_dict(p.to_dict()).ranks == p.ranks  # the plan JSON carries binding and why


def test_link_bound_ranks_name_their_collectives_and_compute() -> None:
    p = plan(SLOW_LINK, 8)
    prices, exposed = collective_ms(SLOW_LINK, p.state_shares)
    cost = DeviceCost(SLOW_LINK.devices[0], SLOW_LINK)
    for r in p.ranks[:2]:
        fwd, bwd = cost.compute_ms(r.batch_size, r.num_micro_batches, r.recompute)
        compute = LAYERS * (fwd + bwd) / 1e3
        collectives = LAYERS * (2 * prices.ag[r.rank] + prices.rs[r.rank] + exposed[r.rank]) / 1e3  # gather twice, reduce once
        assert collectives > compute
        assert r.binding is Binding.LINK
        assert r.why == (f"its collectives take {s(collectives)} of the {s(p.predicted_step_s)} step, more than its "
                         f"compute ({s(compute)})")


def test_compute_bound_ranks_set_the_step_with_their_compute() -> None:
    p = plan(FAST, 4)
    cost = DeviceCost(FAST.devices[0], FAST)
    for r in p.ranks:
        step = cost.step_s(r.batch_size, r.num_micro_batches, FREE, r.state_share, r.recompute)
        assert step == pytest.approx(p.predicted_step_s, rel=1e-12)
        assert r.binding is Binding.COMPUTE
        assert r.why == f"its compute ({s(step)}) sets the step of {s(step)}; its collectives take 0 s"


def test_a_rank_one_sample_short_of_the_step_is_bound_by_granularity() -> None:
    p = plan(FAST, 3)  # two identical ranks, three samples: one rank computes two, the other one
    short = min(p.ranks, key=lambda r: r.batch_size)
    assert short.batch_size == 1
    cost = DeviceCost(FAST.devices[short.rank], FAST)
    now = cost.step_s(1, 1, FREE, short.state_share, short.recompute)
    more = min(cost.step_s(2, n, FREE, short.state_share) for n in (1, 2))  # no graph memory measured: recompute
    assert now < p.predicted_step_s <= more
    assert short.binding is Binding.GRANULARITY
    assert short.why == (f"one sample more would take it from {s(now)} to {s(more)}, at or past the step of "
                         f"{s(p.predicted_step_s)}")
    longest = max(p.ranks, key=lambda r: r.batch_size)
    assert longest.binding is Binding.COMPUTE


def test_a_binding_that_is_not_one_of_the_four_is_refused_in_a_plan_file() -> None:
    data = plan(FAST, 4).to_dict()
    data["ranks"][0]["binding"] = "bandwidth"
    with pytest.raises(Exception, match=r"ranks\[0\]\.binding \(rank 0\) must be one of \['compute', 'memory', 'link', "
                                        r"'granularity'\], got 'bandwidth'"):
        Plan.from_dict(data)


# ----------------------------------------------------------------------------- the table

ROOT = Path(__file__).resolve().parents[2]
TWO_NODES = ROOT / "configs" / "clusters" / "two-nodes.yaml"


@pytest.mark.parametrize("width", [60, 80, 120])
def test_no_line_ends_in_spaces_and_no_sentence_is_cut_by_a_wrap(width: int) -> None:
    cluster = load_cluster(TWO_NODES)
    p = plan(cluster, 64)
    text = render_plan(p, width, cluster, next_step=True)
    lines = text.splitlines()
    assert lines and not [line for line in lines if line != line.rstrip()]
    for line in summary_lines(p, cluster, next_step=True):  # each of them whole, on a line of its own
        assert line in lines, line
    assert sum(line.startswith("legend: ") for line in lines) == 1


def test_the_legend_names_every_column_it_abbreviates() -> None:
    explained = render_plan(plan(FAST, 4)).splitlines()
    legend = next(line for line in explained if line.startswith("legend: "))
    assert legend == LEGEND + LEGEND_BINDS
    for term in ("n x m", "kept", "state share", "used/limit/cap", "binds"):
        assert term in legend
    for header in ("micro-", "share", "used/limit/cap", "binds"):
        assert header in "\n".join(explained[:4])
    baseline = render_plan(plan(FAST, 4, planner="even"))  # a baseline's batches follow its rule: no binds column
    assert LEGEND + "\n" in baseline and "binds" not in baseline


def test_baselines_are_named_with_their_grouping_and_identical_ones_listed_once() -> None:
    cluster = load_cluster(TWO_NODES)
    p = plan(cluster, 64)
    lines = baseline_lines(p)
    by_rate: dict[float, list[str]] = {}
    for name, base in p.baselines.items():
        by_rate.setdefault(base.predicted_samples_per_s, []).append(name)
    assert len(by_rate) < len(p.baselines)  # this cluster has baselines that predict the same throughput
    for rate, names in by_rate.items():
        line = next(line for line in lines if f": {rate:.3g} samples/s" in line)
        assert line.startswith("  " + ", ".join(f"{n} ({BASELINE_GROUPINGS[n]})" for n in names) + ":"), line
        assert f"this plan is {p.predicted_samples_per_s / rate:.2f}x faster" in line
    for name in p.baselines:
        assert sum(bool(re.search(rf"(?<![\w-]){re.escape(name)} \(", line)) for line in lines) == 1
    assert set(BASELINE_GROUPINGS) == set(BASELINES)
    # the 25 Gbit/s link shared by a node's ranks prices every speed-aware full-shard baseline alike
    assert "proportional (full shard), poplar (full shard), reference (full shard): 9.09 samples/s" in "\n".join(lines)


def test_small_memory_figures_are_shown_in_a_unit_that_keeps_them_readable() -> None:
    assert [memory_text(v) for v in (20.06, 0.02, 0.5, 2e-6)] == ["20.1 GiB", "20.5 MiB", "512 MiB", "2.1 KiB"]
    tiny = cluster([device("cpu", 0.05, [0.004, 0.008], count=2)])  # 51 MiB devices: the state (14.9 GiB) fits nowhere
    from cephalo_lightning.planner.search.baselines import even_baseline

    reason = even_baseline(tiny, 2).reason
    assert "0.0 " not in reason and "GiB of 51.2 MiB usable" in reason, reason
    p = plan_of(batches=[1, 1], micro=[1, 1], shares=[0.5, 0.5], devices=["cpu"] * 2, predicted_step_s=[0.1] * 2,
                predicted_memory_gb=[0.02] * 2, memory_limit_gb=[0.04] * 2, memory_capacity_gb=[0.05] * 2)
    text = render_plan(p)
    assert "memory MiB" in text and "20.5/41/51.2" in text


def test_catalog_is_explained_once_and_only_for_catalog_figures() -> None:
    cluster_ = load_cluster(TWO_NODES)
    text = render_plan(plan(cluster_, 64), cluster=cluster_)
    assert text.count(CATALOG) == 1 and "catalog" in text.splitlines()[5]
    assert CATALOG not in render_plan(plan(FAST, 4))


def test_the_next_line_says_how_to_train_with_the_plan() -> None:
    cluster_ = load_cluster(TWO_NODES)
    p = plan(cluster_, 64)
    assert next_line(p, cluster_) == (
        'next: write the plan with -o plan.json, then train with Trainer(strategy=CephaloStrategy(plan="plan.json"), '
        "devices=2, num_nodes=2) and a DataLoader of batch_size=64, the global batch, which the plan splits between "
        "the ranks")
    assert next_line(p, cluster_, "out/p.json").startswith(
        'next: train with Trainer(strategy=CephaloStrategy(plan="out/p.json"), devices=2, num_nodes=2)')


def test_the_plan_command_prints_the_table_with_its_next_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert plan_main([str(TWO_NODES), "-b", "64", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert LEGEND in printed and f'CephaloStrategy(plan="{out}")' in printed and "why:" in printed
    assert Plan.load(out).ranks[0].binding is Binding.COMPUTE


# ----------------------------------------------------------------------------- help texts

COMMANDS = [[], ["plan"], ["plan", "convert"], ["demo"], ["profile"], ["consolidate"], ["export"], ["fit"],
            ["validate"], ["test"], ["predict"]]
MARKUP = re.compile(r"``|:[a-z]+:`|`|::(\s|$)")  # literals, roles, interpreted text, literal-block markers


def _help(main: Any, argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):  # argparse exits after the help
        main([*argv, "--help"])
    return out.getvalue()


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda argv: " ".join(argv) or "commands")
def test_no_help_text_carries_rest_markup(argv: list[str]) -> None:
    from cephalo_lightning.__main__ import main

    text = _help(main, argv)
    assert len(text) > 300
    assert not [line for line in text.splitlines() if MARKUP.search(line)]


def test_cephalo_train_help_lists_every_other_command_without_markup() -> None:
    from cephalo_lightning.__main__ import USAGE
    from cephalo_lightning.lightning.cli import main

    text = _help(main, ["--help"])
    assert not MARKUP.search(text)
    listed = re.search(r"The other commands \(([^)]*)\)", " ".join(text.split())).group(1)
    commands = {m.group(1) for m in re.finditer(r"^  ([a-z]+)", USAGE, re.M)}
    assert commands - {"fit"} <= set(listed.split(", ")), (commands, listed)


def test_plan_strategy_is_a_hidden_deprecated_alias_of_planner(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--strategy" not in _help(plan_main, [])
    assert plan_main([str(TWO_NODES), "-b", "64", "--strategy", "even", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["planner"] == "even"
    assert captured.err == "warning: --strategy is deprecated; write --planner even\n"


# ----------------------------------------------------------------------------- plan --plot


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plot_draws_the_plan_beside_the_even_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    picture = tmp_path / "plan.png"
    assert plan_main([str(TWO_NODES), "-b", "64", "--plot", str(picture)]) == 0
    assert f"picture written to {picture}" in capsys.readouterr().out
    width, height = _png_size(picture)
    assert width >= 800 and height >= 1200
    from cephalo_lightning.planner.picture import even_plan, plan_figure

    p = plan(load_cluster(TWO_NODES), 64)
    even, _ = even_plan(load_cluster(TWO_NODES), p)
    figure = plan_figure(p, even)
    speedup = p.predicted_samples_per_s / even.predicted_samples_per_s
    assert f"{speedup:.2f}x faster than even" in figure._suptitle.get_text()
    batches = figure.axes[0].patches  # the plan's bars, then the even plan's
    assert [b.get_height() for b in batches] == [*p.batch_sizes, *even.batch_sizes]


def test_plot_without_matplotlib_says_how_to_install_it_before_planning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "plan.json"
    assert plan_main([str(TWO_NODES), "-b", "64", "-o", str(out), "--plot", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err == (
        "error: --plot draws with matplotlib, which is not installed; install it with pip install "
        "'cephalo-lightning[plot]' (or pip install matplotlib), or leave --plot out\n")
    assert not out.exists() and not (tmp_path / "p.png").exists()


# ----------------------------------------------------------------------------- docs/plan-reading.md

PAGE = ROOT / "docs" / "plan-reading.md"


def test_every_output_block_of_the_page_is_compared_with_what_its_block_prints() -> None:
    """tests/test_docs.py runs the page's blocks and compares what they print with the output blocks,
    numbers included (a cost-model change that moves a figure fails until the page shows it)."""
    from tests.docs_blocks import blocks

    shown = PAGE.read_text().count("<!-- docs-test: output -->")
    compared = [b for b in blocks(PAGE) if b.prints is not None]
    assert shown >= 3 and len(compared) == shown
    assert [b.language for b in compared].count("python") >= 2
    assert _png_size(ROOT / "docs" / "img" / "plan-two-nodes.png")[0] >= 800  # the picture the page shows


def test_the_rank_lines_of_a_plan_nothing_priced_read_as_information_not_errors() -> None:
    from cephalo_lightning.lightning.fit.loggers import rank_lines

    lines = rank_lines(Plan.even(2, 8, 2))  # what a fit without a plan or a profile runs: no plan was given
    assert lines[0] == ("Cephalo rank 0: device not profiled: batch 4 in 2 micro-batches of 2, state share 50.0%, "
                        "not priced (an even split, made before anything was measured)")
    assert not [line for line in lines if "given" in line]
    given = replace(Plan.even(2, 8, 2), planner=Planner.CEPHALO)  # a plan file without predictions, given
    assert rank_lines(given)[1].endswith("not priced (a plan given as it is, without a cluster file to predict it from)")
    provisional = replace(Plan.even(2, 8, 2), planner=Planner.PROVISIONAL)  # the layout a profiling fit starts with
    assert "given" not in rank_lines(provisional)[0] and "provisional" in rank_lines(provisional)[0]
    assert not [line for line in lines if "?" in line or "unprofiled:" in line]
    explained = rank_lines(plan(FAST, 3))  # two identical ranks: the odd sample goes to the lower one
    assert explained[0].endswith(", bound by compute") and explained[1].endswith(", bound by granularity")
