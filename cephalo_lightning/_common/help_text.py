"""Command-line help as plain text: docstrings written in reST read without their markup.

:func:`plain` turns ``literal`` into literal, :role:`~pkg.mod.Name` into Name, `text <url>`_ into
text (url), `x` into x and a closing "::" into ":"; :class:`PlainHelp` applies it to every
description, epilog and argument help an argparse (or jsonargparse) formatter prints.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(~?)([^`<]*?)\s*(?:<[^`>]*>)?`")
_LINK = re.compile(r"`([^`<]+?)\s*<([^`>]+)>`__?")
_LITERAL = re.compile(r"``(.+?)``", re.S)
_INTERPRETED = re.compile(r"`([^`]+)`")


def plain(text: str) -> str:
    """``text`` without reST markup (see the module docstring)."""
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2).lstrip("."), text)
    text = _LINK.sub(r"\1 (\2)", text)
    text = _LITERAL.sub(r"\1", text)
    text = _INTERPRETED.sub(r"\1", text)
    return re.sub(r"::(\s|$)", r":\1", text)


class PlainHelp:
    """A help formatter mixin: every text it formats is :func:`plain` (put it before the formatter class)."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))  # type: ignore[misc]

    def _expand_help(self, action: argparse.Action) -> str:
        return plain(super()._expand_help(action))  # type: ignore[misc]

    def _format_usage(self, usage: Any, *args: Any, **kwargs: Any) -> str:
        return super()._format_usage(plain(usage) if isinstance(usage, str) else usage, *args, **kwargs)  # type: ignore[misc]


class PlainHelpFormatter(PlainHelp, argparse.HelpFormatter):
    """argparse's default formatter, markup removed."""


class PlainRawDescriptionHelpFormatter(PlainHelp, argparse.RawDescriptionHelpFormatter):
    """argparse's formatter that keeps the description's lines, markup removed."""
