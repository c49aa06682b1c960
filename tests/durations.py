"""The measured time of each test file, for ordering the xdist workers' files (see conftest.py).

``python -m tests.durations JUNIT.xml > tests/durations.txt`` writes the list from a run's JUnit
report (``make durations`` runs the suite and does it).
"""

from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

LIST = Path(__file__).with_name("durations.txt")
HEADER = """\
# Seconds each test file took in `make test` (summed over its tests: setup, call, teardown), longest
# first. conftest.py starts the longest files first, so the xdist workers finish together; a file
# missing here starts before all of them. Refresh: make durations"""


def read(path: Path = LIST) -> dict[str, float]:
    """{file (relative to the repository, as pytest names it): seconds}; empty if the list is missing."""
    if not path.is_file():
        return {}
    rows = (line.split() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {name: float(seconds) for seconds, name in rows}


def file_of(classname: str) -> str:
    """The file of a JUnit classname (``tests.lightning.fit.test_x``, a class after it or not): its
    dotted parts up to the first ``test_`` module, as a path."""
    parts = classname.split(".")
    module = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1)
    return "/".join(parts[: module + 1]) + ".py"


def from_junit(report: Path) -> dict[str, float]:
    seconds: collections.Counter[str] = collections.Counter()
    for case in ET.parse(report).iter("testcase"):
        seconds[file_of(case.get("classname", ""))] += float(case.get("time", 0))
    return dict(seconds)


def main(argv: list[str]) -> None:
    (report,) = argv
    print(HEADER)
    for name, seconds in sorted(from_junit(Path(report)).items(), key=lambda item: -item[1]):
        print(f"{seconds:7.1f} {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
