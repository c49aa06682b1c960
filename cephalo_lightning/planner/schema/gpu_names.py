"""One reading of GPU names, shared by the catalog and the check that a pinned plan runs on its devices.

A name, however it is written (a catalog key, a cluster file's alias, or what
``torch.cuda.get_device_name`` reports), is read as a *model* and the memory size it states::

    lower case, cut into words at every character that is not a letter or a digit;
    drop the vendor words (nvidia, tesla, geforce, quadro), form factors (sxm, sxm2, sxm4, pcie,
    nvl, also as a word's suffix) and memory kinds (hbm2, hbm2e, hbm3, hbm3e, gddr6, ...);
    a word "<digits>g" or "<digits>gb" is the stated size (GB as the name says it);
    the rest, joined, is the model, less a leading "rtx" and a trailing "gb" after a digit

    "NVIDIA A100-SXM4-40GB"   -> ("a100", 40)        "NVIDIA GeForce RTX 3090" -> ("3090", None)
    "NVIDIA A100 80GB PCIe"   -> ("a100", 80)        "NVIDIA RTX A6000"        -> ("a6000", None)
    "NVIDIA H100 80GB HBM3"   -> ("h100", 80)        "rtx3090", "3090"         -> ("3090", None)
    "a100-40gb", "a100_40g"   -> ("a100", 40)        "NVIDIA A10G"             -> ("a10g", None)

A catalog entry (a key, its aliases and its memory in GiB) matches a name when one of its key's or
aliases' readings has the name's model and, where the name states a size, its memory is what a card
of that size reports (:func:`size_agrees`); a memory measured beside the name must agree with the
entry's too (:func:`memory_agrees`). One entry left: that one. Several (the name alone cannot
tell, "a100"): the one whose own spelling reads exactly as the name does, else none.

Two names denote the same card (:func:`same_device`) when their memories agree (where both are
known) and both identify one catalog entry and it is the same; where either is not in the catalog,
when their models are equal and the sizes they state (if both state one) too; a name without a model
number ("cpu", a hand-written "fast") is told apart by its memory alone.

[Note: stated sizes and reported memory] A card sold as N GB reports N GiB less what ECC and the
driver keep: 0.88 N to N GiB over the catalog's cards (a T4 sold as 16 GB reports 14.6 GiB, an
A100-40GB 39.4 GiB), which keeps the catalog's sizes of one model (V100 16/32, A100 40/80) apart.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

VENDOR_WORDS = frozenset({"nvidia", "tesla", "geforce", "quadro"})
_FORM_FACTOR = r"sxm\d?|pcie|nvl"
_MEMORY_KIND = re.compile(r"hbm\d?e?|gddr\d?x?")
_SIZE = re.compile(r"(\d+)gb?")
STATED_LOW, STATED_HIGH = 0.88, 1.0  # reported GiB over a card's stated GB (see the note)
MEMORY_SLACK_GIB = 0.25  # the allocator's and driver's variation between cards of one model
MEMORY_RELATIVE = 0.05  # a recorded capacity against a measured one (the pinned-plan check's rule)


class Catalogued(Protocol):
    """What the matcher reads of a catalog entry."""

    @property
    def key(self) -> str: ...
    @property
    def aliases(self) -> tuple[str, ...]: ...
    @property
    def memory_gb(self) -> float: ...


Entry = TypeVar("Entry", bound=Catalogued)


@dataclass(frozen=True)
class NameReading:
    """A GPU name read as its model and the memory size it states (GB, None where it states none)."""

    model: str
    stated_gb: int | None


def read(name: str) -> NameReading:
    """The model and stated size of a GPU name (see the module)."""
    model, stated = [], None
    for word in re.split(r"[^a-z0-9]+", name.lower()):
        if not word or word in VENDOR_WORDS or re.fullmatch(_FORM_FACTOR, word) or _MEMORY_KIND.fullmatch(word):
            continue
        size = _SIZE.fullmatch(word)
        if size:
            stated = int(size.group(1))
            continue
        model.append(re.sub(rf"(?<=[a-z0-9])({_FORM_FACTOR})$", "", word))
    joined = re.sub(r"(?<=\d)gb$", "", "".join(model))
    return NameReading(joined[3:] if joined.startswith("rtx") and len(joined) > 3 else joined, stated)


def size_agrees(stated_gb: float, reported_gib: float) -> bool:
    """Whether a card that reports ``reported_gib`` GiB can be one sold as ``stated_gb`` GB (see the note)."""
    return STATED_LOW * stated_gb - MEMORY_SLACK_GIB <= reported_gib <= STATED_HIGH * stated_gb + MEMORY_SLACK_GIB


def memory_agrees(expected_gib: float, actual_gib: float) -> bool:
    """Whether a measured memory is the recorded one, up to the variation between cards of one model."""
    return abs(expected_gib - actual_gib) <= MEMORY_RELATIVE * expected_gib + MEMORY_SLACK_GIB


def _readings(entry: Catalogued) -> list[NameReading]:
    return [read(spelling) for spelling in (entry.key, *entry.aliases)]


def identify(name: str, entries: Iterable[Entry], memory_gib: float | None = None) -> Entry | None:
    """The catalog entry a GPU name (and, where known, its memory in GiB) denotes, or None (see the module)."""
    wanted = read(name)
    found = [e for e in entries
             if any(r.model == wanted.model for r in _readings(e))
             and (wanted.stated_gb is None or size_agrees(wanted.stated_gb, e.memory_gb))
             and (memory_gib is None or memory_agrees(e.memory_gb, memory_gib))]
    if len(found) == 1:
        return found[0]
    exact = [e for e in found if wanted in _readings(e)]
    return exact[0] if len(exact) == 1 else None


def same_device(expected: str, expected_gib: float | None, actual: str, actual_gib: float | None,
                entries: Iterable[Catalogued]) -> bool:
    """Whether two GPU names (each with its memory in GiB, where known) denote the same card (see the module)."""
    entries = tuple(entries)
    if expected_gib is not None and actual_gib is not None and not memory_agrees(expected_gib, actual_gib):
        return False
    one, other = identify(expected, entries, expected_gib), identify(actual, entries, actual_gib)
    if one is not None and other is not None:
        return one.key == other.key
    a, b = read(expected), read(actual)
    if not (_numbered(a.model) and _numbered(b.model)):
        return True  # "cpu", a hand-written "fast": no model number to tell them apart by
    return a.model == b.model and (a.stated_gb is None or b.stated_gb is None or a.stated_gb == b.stated_gb)


def _numbered(model: str) -> bool:
    return any(c.isdigit() for c in model)
