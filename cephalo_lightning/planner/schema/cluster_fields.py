"""Checks of a cluster file's fields: each returns the value it was given, converted, or raises a
:class:`PlanningError` naming the field (``where``), what it must be and how to fix the file.

``minimum`` bounds a number from below (``strict``: the bound itself is refused); a number above
:data:`~cephalo_lightning.planner.schema.files.MAX_EXACT_INTEGER` is refused before any float conversion.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from cephalo_lightning.planner.schema.files import MAX_EXACT_INTEGER, shown_number
from cephalo_lightning.planner.schema.planning_error import PlanningError

CLUSTER_FILE = " in the cluster file"


def checked_number(value: Any, where: str, *, minimum: float = 0.0, strict: bool = True) -> float:
    """A finite number above ``minimum`` (or at it, unless ``strict``), as a float."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_EXACT_INTEGER:
        raise PlanningError(f"{where} must be a number of at most {MAX_EXACT_INTEGER:,}, got {shown_number(value)}; "
                            "fix it in the cluster file")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PlanningError(f"{where} must be a number, got {value!r}; write a finite number in the cluster file")
    if value < minimum or (strict and value == minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise PlanningError(f"{where} must be {bound}, got {value!r}; set it to a number {bound}{CLUSTER_FILE}")
    return float(value)


def checked_integer(value: Any, where: str, *, minimum: int = 1) -> int:
    """A whole number >= ``minimum`` (``2.0`` too), as an int."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > MAX_EXACT_INTEGER:
        raise PlanningError(f"{where} must be at most {MAX_EXACT_INTEGER:,}, got {shown_number(value)}; "
                            "fix it in the cluster file")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value):
        raise PlanningError(f"{where} must be a whole number, got {value!r}; write one in the cluster file")
    if value < minimum:
        raise PlanningError(f"{where} must be >= {minimum}, got {value!r}; raise it in the cluster file")
    return int(value)


def checked_fraction(value: Any, where: str, meaning: str) -> float:
    """A number in [0, 1]; ``meaning`` says what it is, for the message."""
    number = checked_number(value, where, strict=False)
    if number > 1:
        raise PlanningError(f"{where} must be in [0, 1] ({meaning}), got {value!r}; set it between 0 and 1"
                            f"{CLUSTER_FILE}")
    return number


def checked_flag(value: Any, where: str) -> bool:
    """A YAML / JSON boolean (not the text "true")."""
    if not isinstance(value, bool):
        raise PlanningError(f"{where} must be true or false, got {value!r}; write true or false, unquoted{CLUSTER_FILE}")
    return value


def checked_series(value: Any, where: str, *, strict: bool) -> tuple[float, ...]:
    """A non-empty list of numbers, one per micro-batch size 1, 2, ... (each as :func:`checked_number`)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) == 0:
        raise PlanningError(
            f"{where} must be a non-empty list of numbers (micro-batch sizes 1, 2, ...), got {value!r}; list the "
            f"figure at each size, e.g. [1.2, 2.3, 3.5]{CLUSTER_FILE}"
        )
    return tuple(checked_number(v, f"{where}[{i}]", strict=strict) for i, v in enumerate(value))


def nearest_keys(unknown: Sequence[str], allowed: Collection[str]) -> str:
    """`` (did you mean 'x'?)`` for the unknown keys that resemble an allowed one (difflib's ratio
    >= 0.6), else empty: the fix for a typo, named beside the list of every key."""
    pairs = [(key, difflib.get_close_matches(key, sorted(allowed), n=1)) for key in unknown]
    found = [(key, near[0]) for key, near in pairs if near]
    if not found:
        return ""
    if len(unknown) == 1:
        return f" (did you mean {found[0][1]!r}?)"
    return " (did you mean " + ", ".join(f"{near!r} for {key!r}" for key, near in found) + "?)"


def reject_unknown_keys(data: Mapping[str, Any], allowed: Collection[str], where: str) -> None:
    """Refuses keys outside ``allowed`` (a misspelt key would otherwise be ignored), naming the
    nearest allowed key and every allowed one."""
    unknown = sorted(map(str, set(data) - set(allowed)))  # str: YAML keys may be numbers, dates, ...
    if unknown:
        raise PlanningError(f"{where}: unknown key(s) {unknown}{nearest_keys(unknown, allowed)}; allowed: "
                            f"{sorted(allowed)}. Fix or remove them")


def checked_mapping(value: Any, where: str) -> Mapping[str, Any]:
    """A mapping (a YAML / JSON object)."""
    if not isinstance(value, Mapping):
        raise PlanningError(f"{where} must be a mapping, got {type(value).__name__}; write it as key: value pairs, "
                            "as docs/cluster.md shows")
    return value
