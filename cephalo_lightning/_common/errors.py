"""The base of every error the package raises on purpose (torch-free, so the planner shares it).

Each refusal also derives from the builtin a caller would expect (``ValueError`` for bad input,
``RuntimeError`` for a state that cannot go on), so ``except ValueError`` keeps working while
``except CephaloError`` catches every refusal of this package and nothing else.
"""

import sys


class CephaloError(Exception):
    """Cephalo refused or stopped; the message says what is wrong and what to change."""


class ConfigurationError(CephaloError, ValueError):
    """An argument, option or file is not valid; the message names it and the fix."""


class UnsupportedError(CephaloError, TypeError):
    """A model, dataset, optimization or call Cephalo cannot run; the message says what would work."""


def refused(err: CephaloError) -> int:
    """A refusal at a command line: one ``error: ...`` line on stderr (no traceback: the message says
    what to change); the exit status is 2 for bad input (a ValueError or TypeError kind, as argparse), else 1."""
    print("error: " + " ".join(str(err).split()), file=sys.stderr)
    return 2 if isinstance(err, (ValueError, TypeError)) else 1
