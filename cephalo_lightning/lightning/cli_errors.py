"""``cephalo-train``'s parse errors as one ``error:`` line, as every refusal of the package is.

jsonargparse answers a bad option with the usage of every option of the subcommand (some 60
lines) above its message, and a misspelt ``init_args`` key of a ``class_path`` inside a report of
every Union subtype it tried. Here the message is one line that names the option as the config
writes it (``trainer.max_step``, ``model.init_args.presett``) and the nearest valid one::

    nearest = difflib's closest option, ratio >= 0.6, among the parsers' option keys
              (or, inside a class_path, the class's constructor parameters)
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser
from typing_extensions import override

# how jsonargparse names an option it does not know: a config file's key or a command-line flag
UNKNOWN_OPTION = (
    re.compile(r"Group '(?P<group>[\w.]+)' does not accept option '(?P<key>[\w.]+)'"),
    re.compile(r"Subcommand '[\w-]+' does not accept option '(?P<key>[\w.]+)'"),
    re.compile(r"Option '(?P<key>[\w.]+)' is not accepted"),
    re.compile(r"unrecognized arguments: --(?P<key>[\w.]+)"),
)
# ... and a key of a class_path's init_args: the class tried and the key it refused
UNKNOWN_INIT_ARG = re.compile(r'Parser key "(?P<group>[\w.]+)":.*?Problem with given class_path '
                              r"'(?P<cls>[\w.]+)':\s*;?\s*Option '(?P<key>\w+)' is not accepted")


def fail(message: str) -> NoReturn:
    """One line on stderr and exit status 2, as argparse does for a bad command line."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def init_parameters(class_path: str) -> list[str]:
    """The keyword parameters of ``class_path``'s constructor (none where it does not import)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        parameters = inspect.signature(cls).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def option_error(message: str, options: Sequence[str]) -> str:
    """jsonargparse's error ``message`` as one line: for an option it does not know, the option, the
    nearest of ``options`` (dotted keys: ``trainer.max_steps``) and where they are listed; any other
    message with its lines joined."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    text = "".join(line + (" " if line.endswith(":") else "; ") for line in lines).rstrip("; ")
    nested = UNKNOWN_INIT_ARG.search(text)
    if nested is not None:
        group, cls, key = nested.group("group"), nested.group("cls"), nested.group("key")
        nearest = difflib.get_close_matches(key, init_parameters(cls), n=1)
        hint = f"did you mean '{group}.init_args.{nearest[0]}'? " if nearest else ""
        return (f"unknown option '{group}.init_args.{key}' ({cls} takes no {key!r}); {hint}"
                f"--{group}.help {cls} lists its options")
    for pattern in UNKNOWN_OPTION:
        found = pattern.search(text)
        if found is not None:
            key = ".".join(filter(None, (found.groupdict().get("group"), found.group("key"))))
            nearest = difflib.get_close_matches(key, options, n=1)
            hint = f"did you mean {nearest[0]!r}? " if nearest else ""
            return f"unknown option {key!r} ({text}); {hint}--help lists the options"
    return text


class CLIArgumentParser(LightningArgumentParser):
    """LightningArgumentParser whose parse errors end the program with :func:`option_error`'s one
    line. ``option_parsers``: the parsers whose options a misspelt one is matched against (the CLI's
    main parser and every subcommand's: jsonargparse reports a config file's key at the main parser)."""

    def __init__(self, *args: Any, option_parsers: list[LightningArgumentParser] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.option_parsers = option_parsers if option_parsers is not None else [self]

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            super().error(message, ex)  # raises: a parse jsonargparse itself retries, or a debugging session
        options = sorted({key for parser in self.option_parsers
                          for key in parser.get_defaults(skip_validation=True).keys()})
        fail(option_error(message, options))
