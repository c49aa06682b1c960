"""Link bandwidths as a person writes them: a quantity, its unit, and what it is per.

The cost model prices a collective from each rank's bandwidth per direction, in GB/s (10**9 bytes
per second): the cluster file's numeric ``settings.link_bandwidth_gbps`` and
``settings.inter_node_bandwidth_gbps``, which is what the profiler writes. A hand-written file says
the same thing with units instead, under ``settings.link_bandwidth`` / ``settings.inter_node_bandwidth``::

    GB/s per rank = value x (1 for GB/s, 1/1000 for MB/s, 1/8 for Gbit/s, 1/8000 for Mbit/s)
                    / (the ranks of the busiest node, for "per link"; 1 for "per rank")

* ``"3.1 GB/s per rank"``: each rank's own bandwidth, as the numeric keys mean it;
* ``"25 Gbit/s per link"`` (inter-node only): one node's network link, shared by the node's ranks,
  so each rank gets the link over the number of ranks on the busiest node. 10 GbE is
  ``"10 Gbit/s per link"`` = 1.25 GB/s per link = 0.3125 GB/s per rank with 4 ranks a node.

Units are case-sensitive as written in datasheets: ``GB/s`` and ``MB/s`` are bytes; ``Gbit/s``,
``Gb/s``, ``Gbps``, ``Mbit/s``, ``Mb/s`` and ``Mbps`` are bits. A bare number, or a quantity that
does not say whether it is per rank or per link, is refused (:class:`BandwidthError`): "25" may be
25 GB/s per rank or 25 Gbit/s per link, which price the link 8 x (ranks per node) apart.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from cephalo_lightning.planner.schema.planning_error import PlanningError

# GB/s per unit (10**9 bytes per second; bits / 8)
UNITS_GBPS = {"GB/s": 1.0, "MB/s": 1e-3, "Gbit/s": 1 / 8, "Gb/s": 1 / 8, "Gbps": 1 / 8,
              "Mbit/s": 1 / 8000, "Mb/s": 1 / 8000, "Mbps": 1 / 8000}
# the spelled key -> the numeric key it stands for
SPELLED_KEYS = {"link_bandwidth": "link_bandwidth_gbps", "inter_node_bandwidth": "inter_node_bandwidth_gbps"}
_QUANTITY = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]\S*)\s*(?:per\s+(\S+))?\s*")


class BandwidthError(PlanningError):
    """A bandwidth in the cluster file has no unit, an unknown unit, or does not say what it is per;
    the message gives the readings and the spelling to write."""


class Scope(Enum):
    """What a written bandwidth is per."""

    RANK = "rank"  # each rank's own bandwidth
    LINK = "link"  # one node's inter-node link, shared by the node's ranks


@dataclass(frozen=True)
class Bandwidth:
    """A bandwidth as written: GB/s per direction and what it is per."""

    gb_per_s: float
    scope: Scope

    def per_rank(self, ranks_sharing: int) -> float:
        """GB/s per direction per rank, the link shared by ``ranks_sharing`` ranks when per link."""
        return self.gb_per_s / ranks_sharing if self.scope is Scope.LINK else self.gb_per_s


def _example(key: str) -> str:
    return "25 Gbit/s per link" if key == "inter_node_bandwidth" else "16 GB/s per rank"


def parse_bandwidth(value: Any, key: str) -> Bandwidth:
    """``settings.<key>`` as written (see the module docstring); refuses what is ambiguous."""
    where = f"settings.{key}"
    numeric = SPELLED_KEYS[key]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise BandwidthError(
            f"{where} is the bare number {value!r}, which could mean {value:g} GB/s per rank or {value:g} Gbit/s "
            f"per link (= {value / 8:g} GB/s, shared by the node's ranks): write its unit and what it is per, e.g. "
            f"{key}: {value:g} Gbit/s per link, or {key}: {value:g} GB/s per rank (the numeric {numeric} is "
            "GB/s per rank)")
    match = _QUANTITY.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise BandwidthError(f"{where} must be a quantity with a unit and what it is per, e.g. "
                             f"{key}: {_example(key)}; got {value!r}")
    number, unit, per = float(match.group(1)), match.group(2), match.group(3)
    if unit not in UNITS_GBPS:
        raise BandwidthError(f"{where}: unknown unit {unit!r} in {value!r}; write one of {', '.join(UNITS_GBPS)} "
                             "(GB/s and MB/s are bytes, the others bits)")
    if number <= 0:
        raise BandwidthError(f"{where} must be > 0, got {value!r}; give the link's bandwidth per direction")
    gb_per_s = number * UNITS_GBPS[unit]
    if per is None:
        raise BandwidthError(
            f"{where} is {value!r} but does not say what it is per: {gb_per_s:g} GB/s per rank, or {gb_per_s:g} "
            f"GB/s per link shared by the node's ranks? Write {value.strip()} per rank or {value.strip()} per link")
    if per not in {s.value for s in Scope}:
        raise BandwidthError(f"{where}: 'per {per}' in {value!r}; write per rank or per link")
    scope = Scope(per)
    if scope is Scope.LINK and key == "link_bandwidth":
        raise BandwidthError(
            f"{where} is {value!r}: inside a node every GPU has a link of its own (NVLink, PCIe), so its bandwidth is "
            f"per rank; write {key}: {number:g} {unit} per rank (per link is for inter_node_bandwidth, the network "
            "link a node's ranks share)")
    return Bandwidth(gb_per_s, scope)


def split_spelled(settings: Any) -> tuple[Any, dict[str, Bandwidth]]:
    """``settings`` without its spelled bandwidths, and those parsed (key -> value); a key given both
    spelled and numeric is refused."""
    if not isinstance(settings, Mapping):
        return settings, {}
    spelled = {key: parse_bandwidth(settings[key], key) for key in SPELLED_KEYS if key in settings}
    for key in spelled:
        if SPELLED_KEYS[key] in settings:
            raise BandwidthError(f"settings gives both {key} and {SPELLED_KEYS[key]}: keep one ({key} with its unit, "
                                 f"or {SPELLED_KEYS[key]} in GB/s per rank)")
    return {k: v for k, v in settings.items() if k not in spelled}, spelled


def ranks_on_busiest_node(nodes: Sequence[int]) -> int:
    """The most ranks any node holds (the ranks sharing one node's link at the worst)."""
    return max(sum(1 for n in nodes if n == node) for node in set(nodes))


def per_rank_gbps(spelled: Mapping[str, Bandwidth], nodes: Sequence[int]) -> dict[str, float]:
    """The numeric settings (GB/s per rank) the spelled bandwidths stand for, on a cluster whose
    ranks are on ``nodes``."""
    sharing = ranks_on_busiest_node(nodes)
    return {SPELLED_KEYS[key]: value.per_rank(sharing) for key, value in spelled.items()}
