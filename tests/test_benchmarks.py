"""The benchmarks' one harness: every ``bench_*.py`` registered once, every one taking ``--quick`` and
``--json PATH``, and the cheapest run end to end (its JSON against its printed table)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.registry import BENCHMARKS, BY_NAME

BENCHMARKS_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


def test_the_registry_lists_every_benchmark_file_once() -> None:
    files = sorted(path.stem.removeprefix("bench_") for path in BENCHMARKS_DIR.glob("bench_*.py"))
    assert sorted(entry.name for entry in BENCHMARKS) == files
    assert len(BY_NAME) == len(BENCHMARKS)


def test_the_results_page_plots_only_what_it_runs() -> None:
    from benchmarks.report import PLOTS

    assert set(PLOTS) <= {entry.name for entry in BENCHMARKS if entry.in_report}


@pytest.mark.parametrize("entry", BENCHMARKS, ids=lambda entry: entry.name)
def test_every_benchmark_takes_the_common_flags(entry, tmp_path) -> None:
    target = str(tmp_path / "result.json")
    args = entry.load().parser().parse_args([*entry.quick_args, "--json", target])
    assert args.quick and args.json == target
    assert not entry.load().parser().parse_args([]).quick


def test_a_quick_run_writes_the_json_its_tables_print(tmp_path, capsys) -> None:
    benchmark = BY_NAME["finetune_plan"].load()
    target = tmp_path / "result.json"
    assert benchmark.main(["--quick", "--json", str(target)]) == 0
    table = capsys.readouterr().out.splitlines()
    result = json.loads(target.read_text())
    rows = result["rows"]
    # 5 cards x (4, 8) and the mixed box, each full and LoRA
    assert result["batch"] == 16 and len(rows) == 2 * (5 * 2 + 1)
    for row in rows:
        line = next(line for line in table if line.startswith(f"{row['cluster']:<18} {row['fine-tune']:<9}"))
        if row["feasible"]:
            assert f"{row['samples_per_s']:>9.3g}" in line and len(line.split("/")) == len(row["memory_gb"]) + 1
        else:
            assert line.endswith(f"infeasible: {row['why']}")
    assert benchmark.main(["--quick", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out) == result


# ----------------------------------------------------------------------------- the pages


def test_the_results_page_is_its_json_rendered() -> None:
    """docs/benchmarks/report.md is a function of docs/benchmarks/results.json: a figure typed into the
    page, or a result changed without rendering the page again, fails here."""
    import difflib

    from benchmarks.report import OUT, figures, render

    stored = json.loads((OUT / "results.json").read_text())
    page = (OUT / "report.md").read_text()
    rendered = render(stored)
    diff = "\n".join(list(difflib.unified_diff(page.splitlines(), rendered.splitlines(), "report.md", "rendered",
                                               lineterm=""))[:40])
    assert rendered == page, f"render it again: python -m benchmarks.report --replot\n{diff}"
    missing = [f.name for f in figures(stored) if not (OUT / f"{f.name}.png").is_file()]
    assert not missing, f"plots the page names but docs/benchmarks/ lacks: {missing}"


MANUAL = BENCHMARKS_DIR.parent / "docs" / "benchmarks.md"
ROW = re.compile(r"^\| `bench_(\w+)\.py` \| .* \|\s*(yes)?\s*\|$", re.M)


def test_the_manual_page_lists_every_benchmark_and_whether_the_results_page_runs_it() -> None:
    listed = {name: flag == "yes" for name, flag in ROW.findall(MANUAL.read_text())}
    assert listed == {entry.name: entry.in_report for entry in BENCHMARKS}


def test_the_manual_page_quotes_no_results() -> None:
    """Results live in the generated report: the manual's prose (outside its table of what each benchmark
    measures and its code) holds no measured figure, percentage or ratio."""
    prose = "\n".join(line for line in MANUAL.read_text().splitlines() if not line.startswith("|"))
    prose = re.sub(r"`[^`]*`", "", prose)
    figures = re.findall(r"\b\d+\.\d+\b|\b\d+(?:\.\d+)?\s*(?:%|x\b|ms\b|s\b|MB\b|GB\b)", prose)
    assert not figures, f"docs/benchmarks.md quotes figures in its prose; put results in the generated report: {figures}"
