"""Shared test hygiene: no test leaks a process group or Lightning's rendezvous variables, and
every test that starts a process (gloo ranks or a subprocess) is marked ``multiprocess``."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from scenarios.launch_env import RENDEZVOUS_VARIABLES, clean_env  # noqa: F401 (clean_env: tests import it from here)

# [Note: one thread per process] ``make test`` runs one xdist worker per core, and every process a
# test starts (a gloo rank, an example, a launcher's ranks) is one more on the same cores. A second
# torch intra-op thread per process then only oversubscribes them: on tensors this small it buys no
# speed, and OpenMP threads spin while their peers are descheduled, burning the core another test
# needs. So the workers, and through the inherited environment every process they start, use one
# thread unless ``OMP_NUM_THREADS`` says otherwise. Set before torch is imported, which reads it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # after the thread count
import torch.distributed as dist

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch first

pytest_plugins = ["tests.fake_clock"]  # the ``clock`` fixture

# A subprocess's timeout stops a hang and nothing else: never a speed check (a loaded machine
# runs a 20 s subprocess for minutes).
HANG_TIMEOUT_S = 1800


@pytest.fixture(autouse=True)
def _isolated_process_group():
    before = {k: os.environ.get(k) for k in RENDEZVOUS_VARIABLES}
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread, as each CPU rank has: on a shared 2-core host, a second OpenMP thread
    that gets descheduled makes the first spin, and timings become meaningless. A file opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def failure_report(result: subprocess.CompletedProcess, tail: int = 3000) -> str:
    """Why a subprocess failed, for an assertion message: its exit status, the exception that ends
    each traceback in its stderr (the first is usually the cause; Lightning's launcher then kills
    rank 0 with SIGKILL, exit -9, when another rank fails) and the end of its stderr."""
    stderr = result.stderr or ""
    lines = stderr.splitlines()
    raised = []
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" not in line:
            continue
        for later in lines[i + 1:]:
            text = later.split("]: ", 1)[-1] if later.startswith("[rank") else later
            if text and not text.startswith((" ", "Traceback", "^", "~")):
                raised.append(later.strip())
                break
    status = f"exit {result.returncode}" + (" (killed by a signal)" if result.returncode < 0 else "")
    causes = "\n".join(dict.fromkeys(raised)) or "(no traceback)"
    return f"{status}\nexceptions, first first:\n{causes}\n--- stdout tail:\n{(result.stdout or '')[-1000:]}\n--- stderr tail:\n{stderr[-tail:]}"


# ----------------------------------------------------------------------------- the multiprocess mark

# [Note: the fast lane] ``make test-fast`` runs ``-m "not multiprocess and not soak"``: the in-process
# tests, less the few marked ``soak`` (hundreds of steps in one process, a minute on 2 busy cores).
# A test that starts a process but lacks the mark would slip into it and slow it down, so an audit
# hook (Python's own: it sees every ``subprocess.Popen``, and the local-ranks launcher announces
# itself with an audit event) records every start, and a test that started one in its setup, call
# or teardown without the mark fails, naming what it started. A module-scoped fixture counts for the
# test that first needs it; in the fast lane that is always an unmarked test, so nothing escapes.
# Only Python processes count (the interpreter, or a script of its environment such as
# cephalo-train): a library probing the system while it is imported (``lscpu``, say) is not a test
# starting ranks, and whether it happens in one test or another depends on the order they run in.
_LAUNCHER = "cephalo_lightning.testing.run_local_ranks"
_WATCH = pytest.StashKey["_ProcessStarts"]()


def _runs_python(executable: object, args: object) -> bool:
    import sys
    from pathlib import Path

    program = executable if executable is not None else (args[0] if isinstance(args, (list, tuple)) and args else args)
    if not isinstance(program, (str, os.PathLike)):
        return False
    path = Path(os.fsdecode(program))
    return path.name.startswith("python") or path.parent == Path(sys.executable).parent


class _ProcessStarts:
    """The processes started since the last look (an audit hook; it cannot be removed, only read)."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def __call__(self, event: str, args: tuple) -> None:
        if event == _LAUNCHER:
            self.started.append(f"{event}({args[0]!r})" if args else event)
        elif event == "subprocess.Popen" and _runs_python(args[0], args[1]):
            self.started.append(f"{event}({args[0] if args[0] is not None else args[1][0]!r})")

    def take(self) -> list[str]:
        started, self.started = self.started, []
        return started


def pytest_configure(config: pytest.Config) -> None:
    import sys

    watch = _ProcessStarts()
    sys.addaudithook(watch)
    config.stash[_WATCH] = watch


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.config.stash[_WATCH].take()  # what ran between tests is nobody's


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    started = item.config.stash[_WATCH].take()
    if started and report.passed and item.get_closest_marker("multiprocess") is None:
        shown = ", ".join(started[:3]) + (f" and {len(started) - 3} more" if len(started) > 3 else "")
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} started {len(started)} process(es) in its {report.when} ({shown}) but is "
                           "not marked: add @pytest.mark.multiprocess (make test-fast runs only unmarked tests, "
                           "in this process)")


# ----------------------------------------------------------------------------- the order of the files

# [Note: longest files first] ``make test`` hands whole files to the xdist workers in collection
# order (``--dist loadfile --no-loadscope-reorder``), a new one to a worker as its current one runs
# out. Started in the order of their measured times (tests/durations.txt), the long files run side by
# side at the start and the short ones fill in at the end, so the workers finish together; in
# alphabetical order a long file that starts last runs alone. A file the list does not know starts
# first (it may be long). The order of the tests inside a file is kept.
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    from tests.durations import read

    measured = read()
    unknown = max(measured.values(), default=0.0) + 1.0

    def file_time(item: pytest.Item) -> float:
        return measured.get(item.nodeid.split("::", 1)[0], unknown)

    items.sort(key=lambda item: -file_time(item))  # stable: a file's tests keep their order
