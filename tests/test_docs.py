"""The user docs stay true: every fenced block of README.md and docs/**/*.md runs (or, marked as
needing a GPU or a cluster, parses) per the convention in tests/docs_blocks.py, and prints exactly
the output block shown after it; the README keeps its promises (two commands, short, maturity
first) and lists the extras pyproject.toml declares; no page or example names a checkpoint file the
code does not write; every CLI command has its reference; the site's navigation holds every page."""

from __future__ import annotations

import ast
import difflib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cephalo_lightning.planner import cluster_from_dict, plan
from tests.conftest import HANG_TIMEOUT_S, clean_env
from tests.docs_blocks import ROOT, Block, DocsConventionError, Handling, all_blocks, normalised, page_blocks, pages

README = (ROOT / "README.md").read_text()
BLOCKS = all_blocks()
PYTHON = [b for b in BLOCKS if b.language == "python" and b.handling is Handling.RUN]
BASH = [b for b in BLOCKS if b.language == "bash" and b.handling is Handling.RUN]
PARSED = [b for b in BLOCKS if b.handling is Handling.PARSE_ONLY or b.language == "yaml"]
# pages other engineers own: the lead adds them to the navigation at merge
NOT_IN_NAV = {"benchmarks/gpu.md"}


def _ids(blocks: list[Block]) -> list[str]:
    return [b.id for b in blocks]


def _env() -> dict[str, str]:
    return clean_env(PYTHONPATH=str(ROOT), WANDB_MODE="offline", COLUMNS="120", PATH=f"{Path(sys.executable).parent}:"
                     f"{clean_env().get('PATH', '/usr/bin:/bin')}")


def assert_prints(block: Block, stdout: str, folder: str | None = None) -> None:
    """``block``'s stdout is its ``output`` block's text, as the convention compares them."""
    if block.prints is None:
        return
    want, got = normalised(block.prints, folder), normalised(stdout, folder)
    assert got == want, (f"{block.id} prints what its output block ({block.page}:{block.printed_at}) does not show; "
                         "paste what it prints there:\n" + "\n".join(difflib.unified_diff(
                             want.splitlines(), got.splitlines(), "the page", "printed", lineterm="")))


def _git_status() -> set[str]:
    done = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                          text=True)
    return set(done.stdout.splitlines()) if done.returncode == 0 else set()


# ----------------------------------------------------------------------------- every block


@pytest.fixture(scope="module")
def python_results(request, tmp_path_factory):
    """The selected python blocks, run by one runner process that forks a child per block (imports shared)."""
    selected = {item.callspec.params["block"].id for item in request.session.items
                if item.originalname == "test_python_block_runs" and hasattr(item, "callspec")}
    todo = [{"id": b.id, "code": b.code} for b in PYTHON if b.id in selected]
    folder = tmp_path_factory.mktemp("docs-python")
    (folder / "blocks.json").write_text(json.dumps(todo))
    done = subprocess.run([sys.executable, "-m", "tests.docs_runner", str(folder / "blocks.json"),
                           str(folder / "results.json")], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=HANG_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((folder / "results.json").read_text())


@pytest.mark.multiprocess
@pytest.mark.parametrize("block", PYTHON, ids=_ids(PYTHON))
def test_python_block_runs(block, python_results):
    result = python_results[block.id]
    assert result["status"] == 0, f"{block.id} exited with {result['status']}:\n{result['output']}"
    assert_prints(block, result["stdout"], result["folder"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("block", BASH, ids=_ids(BASH))
def test_shell_block_runs(block):
    before = _git_status()
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=HANG_TIMEOUT_S)
    assert done.returncode == 0, f"{block.id} exited with {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}"
    left = _git_status() - before
    assert not left, f"{block.id} left files in the checkout (write under a mktemp -d folder): {sorted(left)}"
    assert_prints(block, done.stdout)


@pytest.mark.parametrize("block", PARSED, ids=_ids(PARSED))
def test_parse_only_block_parses(block):
    if block.language == "python":
        ast.parse(block.code, filename=block.id)
    elif block.language == "bash":
        done = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
        assert done.returncode == 0, f"{block.id}: {done.stderr}"
    else:
        data = yaml.safe_load(block.code)
        if isinstance(data, dict) and "model" in data and ({"devices", "nodes"} & set(data)):
            cluster_from_dict(data)  # a cluster file example is a valid cluster file


# ----------------------------------------------------------------------------- output blocks

PRINTING_PAGE = """Plan it:

```python
print("187 s per step")
```

<!-- docs-test: output -->
```console
187 s per step
```
"""


def test_an_output_block_belongs_to_the_block_right_before_it():
    (block,) = page_blocks("page.md", PRINTING_PAGE)
    assert (block.line, block.prints, block.printed_at) == (3, "187 s per step\n", 8)


@pytest.mark.parametrize("page, says", [
    ("Text.\n\n<!-- docs-test: output -->\n```\n187 s\n```\n", "must follow the python or bash block"),
    ('```python\nprint(1)\n```\nSo:\n<!-- docs-test: output -->\n```\n1\n```\n', "only blank lines between"),
    ("```text\nx\n```\n<!-- docs-test: output -->\n```\n1\n```\n", "must follow the python or bash block"),
    ("```yaml\na: 1\n```\n<!-- docs-test: output -->\n```\n1\n```\n", "does not run"),
    (PRINTING_PAGE + "<!-- docs-test: output -->\n```\nagain\n```\n", "must follow the python or bash block"),
    ("<!-- docs-test: illustration -->\n```\n2.05s\n```\n", "needs its reason"),
], ids=["after-prose", "text-between", "after-text", "after-yaml", "twice", "illustration-without-reason"])
def test_output_a_test_cannot_produce_is_refused(page, says):
    with pytest.raises(DocsConventionError, match=says):
        page_blocks("page.md", page)


def test_output_is_compared_exactly_but_for_paths_and_blank_edges(tmp_path):
    """The rule of tests/docs_blocks.py, on printed text written by hand: numbers differ, it fails."""
    (block,) = page_blocks("page.md", PRINTING_PAGE.replace("187 s per step\n```", "<repo>/x <tmp>/y 187 s \n```"))
    assert_prints(block, f"\n{ROOT}/x {tmp_path}/y 187 s\n\n", str(tmp_path))
    (block,) = page_blocks("page.md", PRINTING_PAGE)
    with pytest.raises(AssertionError, match=r"-187 s per step\n\s*\+190 s per step"):
        assert_prints(block, "190 s per step\n")


def test_every_output_block_on_the_pages_is_compared():
    """No marker outside the two kinds that a test reads: a page's output is compared or says why not."""
    compared = [b for b in BLOCKS if b.prints is not None]
    markers = sum(path.read_text().count("<!-- docs-test: output -->") for path in pages())
    assert len(compared) == markers > 0
    assert all(b.language in ("python", "bash") and b.handling is Handling.RUN for b in compared)


# ----------------------------------------------------------------------------- the README


def test_the_two_commands_are_the_makefile_targets_and_ci_runs_the_test_one():
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_is_short_with_contents_and_says_what_never_ran_first():
    lines = README.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail into docs/"
    first_screen = "\n".join(lines[:40])
    assert "never" in first_screen and "GPU" in first_screen and "emulated" in first_screen.lower()
    assert "## Contents" in README


def _requirement_name(requirement: str) -> str:
    """A requirement's distribution name, normalised (``mkdocstrings[python]>=0.26`` -> ``mkdocstrings``)."""
    return re.split(r"[\[<>=!~;\s]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_the_readme_names_every_extra_with_its_packages():
    """The README's ``Extras:`` paragraph: every extra of pyproject.toml, each with exactly its packages
    before the colon (an extra named there stands for its own packages)."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads TOML")
    declared = {extra: {_requirement_name(r) for r in requirements} for extra, requirements in
                tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"].items()}
    paragraph = " ".join(README.split("\nExtras: ", 1)[1].split("\n\n", 1)[0].split())
    listed = dict(re.findall(r"`\[([\w-]+)\]` \(([^)]*)\)", paragraph))
    assert sorted(listed) == sorted(declared), f"README extras {sorted(listed)}, pyproject.toml {sorted(declared)}"
    for extra, text in listed.items():
        named: set[str] = set()
        for item in text.split(":", 1)[0].split(","):
            inner = re.fullmatch(r"`\[([\w-]+)\]`", item.strip())
            named |= declared[inner.group(1)] if inner else {item.strip().lower()}
        assert named == declared[extra], f"README: [{extra}] ({text}); pyproject.toml: {sorted(declared[extra])}"


def test_the_readme_cluster_example_parses_and_plans():
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", README, re.S) if "nodes:" in b)
    cluster = cluster_from_dict(yaml.safe_load(block))
    assert cluster.num_nodes == 2 and cluster.settings.inter_node_bandwidth_gbps == pytest.approx(10 / 8 / 4)
    assert plan(cluster, 64).global_batch_size == 64


def _cluster_files() -> list[tuple[str, object]]:
    """Every cluster file a reader may copy: the docs' yaml blocks that hold one, and configs/clusters/."""
    files = [(b.id, yaml.safe_load(b.code)) for b in BLOCKS if b.language == "yaml"]
    files += [(str(p.relative_to(ROOT)), yaml.safe_load(p.read_text())) for p in sorted((ROOT / "configs" / "clusters").glob("*.yaml"))]
    return [(where, data) for where, data in files
            if isinstance(data, dict) and "model" in data and ("devices" in data or "nodes" in data)]


def test_every_cluster_file_of_the_docs_names_its_links():
    """A cluster file of several ranks without a price for its links is refused; one a reader copies
    from the docs plans as written (the README's and docs' yaml blocks, configs/clusters/)."""
    from cephalo_lightning.planner.cost.collective_prices import check_priced

    files = _cluster_files()
    assert len(files) >= 8, [where for where, _ in files]
    for where, data in files:
        cluster = cluster_from_dict(data)
        check_priced(cluster)  # raises, naming the keys to write, where a link has no price
        assert not cluster.settings.free_links, where


# ----------------------------------------------------------------------------- names the code writes

CHECKPOINT_NAME = re.compile(r"[\w.=<>*{}\[\]-]*\.ckpt\b|\bhpc_ckpt\w*")
USER_NAMED = re.compile(r"(?:-o|--output|save_checkpoint\(|ckpt_path=)\s*[\"']?([\w./<>-]+\.ckpt)")


def _written_checkpoint_names() -> set[str]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from cephalo_lightning.lightning.fit.preemption import CHECKPOINT_NAME as PREEMPTED

    return {ModelCheckpoint.CHECKPOINT_NAME_LAST + ModelCheckpoint.FILE_EXTENSION, PREEMPTED}


def test_no_doc_or_example_names_a_checkpoint_file_the_code_does_not_write():
    """``last.ckpt`` (ModelCheckpoint's), ``last-preempted.ckpt`` (the strategy's stop), Lightning's
    versioned ``last-vN.ckpt``, the ``last*.ckpt`` they are found by, and names the same page gives
    an output itself (``-o run.ckpt``); nothing else, e.g. Lightning's ``hpc_ckpt_*`` that the
    strategy's own preemption handling replaced."""
    written = _written_checkpoint_names()
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").iterdir()),
             *sorted((ROOT / "configs").rglob("*.yaml"))]
    wrong = []
    for path in files:
        text = path.read_text()
        own = {m.split("/")[-1] for m in USER_NAMED.findall(text)}
        for name in {m.split("/")[-1] for m in CHECKPOINT_NAME.findall(text)}:
            if name in written or name in own or name == "last*.ckpt" or re.fullmatch(r"last-v\d+\.ckpt", name):
                continue
            wrong.append(f"{path.relative_to(ROOT)}: {name}")
    assert not wrong, f"checkpoint files the code does not write (it writes {sorted(written)}): {wrong}"


# ----------------------------------------------------------------------------- reference and site


def test_every_cli_command_has_its_reference():
    import cephalo_lightning.__main__ as entry

    listed = entry.__doc__.split("<command>``:", 1)[1].split(".", 1)[0]  # "plan | profile | demo | ..."
    commands = {c.strip() for c in listed.split("|")}
    assert {"plan", "demo", "fit", "profile", "consolidate", "export"} <= commands
    reference = (ROOT / "docs" / "reference" / "cli.md").read_text()
    missing = [c for c in sorted(commands) if f"`python -m cephalo_lightning {c}" not in reference
               and f"cephalo_lightning {c} --help" not in reference]
    assert not missing, f"docs/reference/cli.md lacks {missing}"


def test_the_site_navigation_holds_every_page():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)  # !!python tags stay strings

    def walk(node) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [p for n in node for p in walk(n)]
        return [p for v in node.values() for p in walk(v)]

    nav = set(walk(config["nav"]))
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert pages - NOT_IN_NAV <= nav, f"pages missing from mkdocs.yml's nav: {sorted(pages - NOT_IN_NAV - nav)}"
    assert nav <= pages, f"nav names pages that do not exist: {sorted(nav - pages)}"


def test_the_architecture_page_indexes_every_note_in_the_code():
    notes = {m for path in (ROOT / "cephalo_lightning").rglob("*.py")
             for m in re.findall(r"\[Note: ([^\]]+)\]", path.read_text())}
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = sorted(n for n in notes if f"`[Note: {n}]`" not in page)
    assert not missing, f"add these to the [Note: ...] index in docs/architecture.md: {missing}"


def test_the_cluster_page_lists_every_catalog_gpu_and_every_cluster_file_key():
    from dataclasses import fields

    from cephalo_lightning.planner.schema.bandwidth import SPELLED_KEYS
    from cephalo_lightning.planner.schema.catalog import CATALOG
    from cephalo_lightning.planner.schema.cluster import _DEVICE_KEYS
    from cephalo_lightning.planner.schema.cluster_spec import ModelSpec, Settings

    page = (ROOT / "docs" / "cluster.md").read_text()
    reference = (ROOT / "docs" / "reference" / "cluster-file.md").read_text()
    missing = [f"{s.key} ({s.memory_gb:g} GiB)" for s in CATALOG if f"| `{s.key}` |" not in page
               or f"| {s.memory_gb:g} |" not in page.split(f"| `{s.key}` |", 1)[1].split("\n", 1)[0]]
    assert not missing, f"docs/cluster.md's GPU catalog lacks or misstates {missing}"
    # every key a cluster file may hold is named on the task page or, by class, in the reference
    keys = {f.name for f in fields(ModelSpec)} | {f.name for f in fields(Settings)} | set(_DEVICE_KEYS) | set(SPELLED_KEYS)
    unnamed = sorted(k for k in keys if f"`{k}`" not in page and f"`{k}`" not in reference)
    assert not unnamed, f"cluster file keys no page names: {unnamed}"
