"""A plan file's fields read one by one: each check returns the value, converted, or raises a
:class:`PlanningError` naming the field (``where``), what it must be and the fix (re-make the plan)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from cephalo_lightning._common.vocabulary import Member, values_of
from cephalo_lightning.planner.schema.files import MAX_EXACT_INTEGER, shown_number
from cephalo_lightning.planner.schema.planning_error import REMAKE, PlanningError


def field_member(vocabulary: type[Member], value: Any, where: str) -> Member:
    """A file's string parsed into its member; any other string is refused naming the choices."""
    if value not in values_of(vocabulary):
        raise PlanningError(f"{where} must be one of {values_of(vocabulary)}, got {shown(value)}; {REMAKE}")
    return vocabulary(value)


def shown(value: Any) -> str:
    kind = {str: "a string", list: "a list", dict: "an object", bool: "a boolean", type(None): "null"}
    return f"{shown_number(value)} ({kind.get(type(value), type(value).__name__)})"


def too_large(value: Any) -> bool:
    """An integer no float holds exactly (10**400 would overflow ``math.isfinite``)."""
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_EXACT_INTEGER


def refuse_unknown(data: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise PlanningError(f"{where}: unknown field(s) {unknown}; the fields are {sorted(allowed)}; {REMAKE}")


def whole(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or too_large(value) \
            or not math.isfinite(value) or value != int(value) or value < minimum:
        hint = f"; write it as a JSON number, e.g. {value.strip()}" if isinstance(value, str) and \
            value.strip().isdigit() else ""
        raise PlanningError(f"{where} must be a whole number >= {minimum}, got {shown(value)}{hint}; or {REMAKE}")
    return int(value)


def finite(value: Any, where: str, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or too_large(value) \
            or not math.isfinite(value) or (minimum is not None and value < minimum):
        bound = f" >= {minimum:g}" if minimum is not None else ""
        raise PlanningError(f"{where} must be a finite number{bound}, got {shown(value)}; {REMAKE}")
    return float(value)


def text_field(value: Any, where: str, example: str) -> str:
    """A non-empty string (a device name such as "a100-40gb"): a number or a list here is a broken
    or hand-edited file, which the plan would otherwise carry on as the text "123"."""
    if not isinstance(value, str) or not value.strip():
        raise PlanningError(f"{where} must be a non-empty JSON string (e.g. \"{example}\"), got {shown(value)}; "
                            f"quote it in the file or {REMAKE}")
    return value
