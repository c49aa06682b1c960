"""The command line every benchmark shares: ``--quick``, ``--json PATH``, then the benchmark's own options.

    python -m benchmarks.bench_x [--quick] [--json PATH] [its own options]

A benchmark is a :class:`Benchmark`: ``options`` adds its own flags to the parser, ``measure`` runs it from
the parsed arguments and returns a JSON-able result, ``print_report`` prints that result's tables. ``main``
parses once, measures, prints the tables and writes the result to ``PATH`` (``-``: the JSON on stdout in
place of the tables), so that the results page (``benchmarks/report.py``) and a shell read the same figures.

Torch-free: the planner benchmarks import it in a process that refuses torch.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STDOUT = "-"


def _no_options(parser: argparse.ArgumentParser) -> None:
    """A benchmark with no flags of its own."""


def _success(result: Any) -> int:
    """Every result exits 0 unless the benchmark says otherwise."""
    return 0


@dataclass(frozen=True)
class Benchmark:
    """One benchmark's entry points (see the module docstring)."""

    description: str
    measure: Callable[[argparse.Namespace], Any]
    print_report: Callable[[Any], None]
    options: Callable[[argparse.ArgumentParser], None] = _no_options
    exit_status: Callable[[Any], int] = _success

    def parser(self) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(description=self.description,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--quick", action="store_true", help="a small, fast configuration (a smoke run)")
        parser.add_argument("--json", metavar="PATH",
                            help=f"also write the result as JSON to PATH ({STDOUT!r}: on stdout, instead of the tables)")
        self.options(parser)
        return parser

    def run(self, argv: Sequence[str] | None = None) -> tuple[Any, argparse.Namespace]:
        """Measure from a command line; the result and the parsed arguments."""
        args = self.parser().parse_args(argv)
        return self.measure(args), args

    def main(self, argv: Sequence[str] | None = None) -> int:
        result, args = self.run(argv)
        if args.json == STDOUT:
            print(to_json(result))
        else:
            self.print_report(result)
            if args.json:
                Path(args.json).write_text(to_json(result) + "\n")
        return self.exit_status(result)


def to_json(result: Any) -> str:
    return json.dumps(result, indent=2, default=str)


def comma_list(allowed: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """An argparse ``type``: a comma-separated subset of ``allowed``, in the order given."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(name.strip() for name in text.split(",") if name.strip())
        unknown = sorted(set(names) - set(allowed))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {','.join(allowed)}")
        return names

    return parse
