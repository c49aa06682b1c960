"""Which node every rank is on, and the two link classes measured when the ranks span nodes.

The planner prices a shard group's collectives on its slowest link: the intra-node one when the
group stays inside a node, the inter-node one otherwise (``Settings.link_bandwidth_gbps`` /
``inter_node_bandwidth_gbps``, ``DeviceProfile.node``). A rank learns its node from, in order:

1. its emulation spec's ``node`` (an emulated topology on one host: the spec is the truth);
2. the launcher: torchrun's ``GROUP_RANK`` (else ``RANK // LOCAL_WORLD_SIZE``, torchrun numbers
   the ranks node by node), SLURM's ``SLURM_NODEID``, Lightning's ``NODE_RANK``: the first one every
   rank has;
3. its host name.

Nodes are numbered 0, 1, ... in the order of their first rank. When there are two or more, each
link class is timed with the runtime's collectives (:func:`time_links`): an all-gather among the
ranks of each node (intra-node), and one among the ranks with the same position in their node
across the nodes (inter-node, the traffic of a cross-group reduction), every group at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cephalo_lightning._common.vocabulary import Collective
from cephalo_lightning.planner.schema.cluster_spec import Emulation
from cephalo_lightning.profiling.collective_timing import time_op
from cephalo_lightning.profiling.options import ProfileOptions
from cephalo_lightning.runtime.collectives import Collectives
from cephalo_lightning.runtime.distributed import all_reduce_, is_distributed, rank_and_size
from cephalo_lightning.runtime.emulation.links import EmulatedLinks
from cephalo_lightning.runtime.sharding.layout import build_layout

LAUNCHER_VARIABLES = ("GROUP_RANK", "SLURM_NODEID", "NODE_RANK")  # torchrun, SLURM, Lightning's launchers


@dataclass(frozen=True)
class NodeClue:
    """What one rank knows of its node, gathered from every rank before the nodes are assigned."""

    emulated: int | None  # the emulation spec's node
    launcher: tuple[str, str] | None  # (where it came from, its value): the launcher's node rank
    host: str


def node_clue(emulate: Emulation | None, environ: Mapping[str, str], host: str) -> NodeClue:
    """This rank's clue: its emulated node, the launcher's node rank (first found), its host."""
    launcher = None
    for name in LAUNCHER_VARIABLES:
        if environ.get(name, "").strip():
            launcher = (name, environ[name].strip())
            break
    if launcher is None and environ.get("LOCAL_WORLD_SIZE", "").strip() and environ.get("RANK", "").strip():
        try:
            launcher = ("RANK // LOCAL_WORLD_SIZE", str(int(environ["RANK"]) // int(environ["LOCAL_WORLD_SIZE"])))
        except (ValueError, ZeroDivisionError):
            launcher = None
    return NodeClue(emulate.node if emulate is not None else None, launcher, host)


@dataclass(frozen=True)
class Topology:
    """Every rank's node (0, 1, ... in the order of their first rank) and what told it."""

    nodes: tuple[int, ...]
    source: str  # "emulation", a launcher variable, or "host name"

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))

    def members(self, node: int) -> tuple[int, ...]:
        return tuple(r for r, n in enumerate(self.nodes) if n == node)

    def node_groups(self) -> list[tuple[int, ...]]:
        """The ranks of each node, node by node."""
        return [self.members(n) for n in range(self.num_nodes)]

    def cross_groups(self) -> list[tuple[int, ...]]:
        """The ranks at position j of their node, across the nodes that have one, for each j."""
        groups = self.node_groups()
        return [tuple(g[j] for g in groups if len(g) > j) for j in range(max(len(g) for g in groups))]


def _numbered(keys: Sequence[object]) -> tuple[int, ...]:
    first: dict[object, int] = {}
    return tuple(first.setdefault(key, len(first)) for key in keys)


def find_nodes(clues: Sequence[NodeClue]) -> Topology:
    """Every rank's node from every rank's clue (the same on every rank: a pure function).

    Emulated nodes win when every rank has one; then the launcher's node ranks when every rank
    has one from the same source; else the host names.
    """
    if clues and all(c.emulated is not None for c in clues):
        return Topology(_numbered([c.emulated for c in clues]), "emulation")
    sources = {c.launcher[0] if c.launcher is not None else None for c in clues}
    if len(sources) == 1 and None not in sources:
        return Topology(_numbered([c.launcher[1] for c in clues]), sources.pop())
    return Topology(_numbered([c.host for c in clues]), "host name")


# --------------------------------------------------------------------------------------------
# timing the link classes


@dataclass(frozen=True)
class LinkProfile:
    """The two link classes' bandwidths (GB/s per direction per rank), from timed all-gathers."""

    intra_node_gbps: float | None  # None: no node has two ranks
    inter_node_gbps: float
    probe_bytes: int  # each rank's shard in the all-gathers
    intra_node_ms: float | None
    inter_node_ms: float
    emulated: bool  # the inter-node link is emulated (EmulatedLinks), not a real network


def _subgroups(members: Sequence[Sequence[int]], group: dist.ProcessGroup | None) -> list[dist.ProcessGroup | None]:
    """A process group for every list of ranks (of ``group``) with two or more; every rank creates
    every one, in the same order."""
    out: list[dist.ProcessGroup | None] = []
    for ranks in members:
        if len(ranks) < 2:
            out.append(None)
            continue
        global_ranks = [dist.get_global_rank(group, r) if group is not None else r for r in ranks]
        out.append(dist.new_group(ranks=global_ranks))
    return out


def _time_class(
    members: Sequence[Sequence[int]], *, rank: int, group: dist.ProcessGroup | None, device: torch.device,
    probe_bytes: int, links: EmulatedLinks | None, warmup: int, repeats: int,
) -> tuple[float, float] | None:
    """(slowest milliseconds, least GB/s per rank) of an all-gather in every group of ``members`` at once."""
    subgroups = _subgroups(members, group)
    mine = next(((ranks, sub) for ranks, sub in zip(members, subgroups) if rank in ranks and sub is not None), None)
    seconds_per_gb, ms = 0.0, 0.0
    if mine is not None:
        ranks, sub = mine
        size = len(ranks)
        shard_numel = max(1, probe_bytes // 4)
        unit = build_layout([shard_numel * size], [1.0 / size] * size, ["link-probe"]).units[0]
        shard = torch.ones(shard_numel, dtype=torch.float32, device=device)
        full = torch.empty(unit.numel, dtype=torch.float32, device=device)
        comm = Collectives(sub, Collective.PADDED, links=links)  # the emulated link holds what crosses nodes
        sent = shard_numel * 4
        ms = time_op(lambda: comm.all_gather(shard, full, unit).wait(), device, group, warmup, repeats)
        seconds_per_gb = ms / 1e3 / (sent * (size - 1) / 1e9)
    else:  # not in a group of this class: keep the barriers of the timed rounds
        time_op(lambda: None, device, group, warmup, repeats)
    worst = all_reduce_(torch.tensor([ms, seconds_per_gb], dtype=torch.float64,
                                     device=device if dist.get_backend(group) == "nccl" else "cpu"), "max", group)
    ms, seconds_per_gb = worst.tolist()
    if mine is not None:
        dist.destroy_process_group(mine[1])
    return None if seconds_per_gb <= 0 else (ms, 1.0 / seconds_per_gb)


def time_links(
    topology: Topology, *, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu",
    probe_bytes: int = ProfileOptions.link_probe_bytes, links: EmulatedLinks | None = None, warmup: int = 1, repeats: int = 5,
) -> LinkProfile | None:
    """Both link classes' bandwidth; ``None`` on one node. Every rank of ``group`` must call it.

    Each class is an all-gather of ``probe_bytes`` per rank (fp32) in every group of the class at
    once: the ranks of each node, then the ranks with the same position in their node across the
    nodes. A rank's bandwidth is what it sends (its shard to each peer) over the time; the class's
    figure is the least over the ranks (the slowest link decides a step). ``links``: the emulated
    links between nodes (the inter-node all-gathers are then held until the emulated link would
    have delivered them).
    """
    if topology.num_nodes < 2 or not is_distributed(group):
        return None
    rank, world = rank_and_size(group)
    if len(topology.nodes) != world:
        raise ValueError(f"the topology has {len(topology.nodes)} ranks but the group has {world}")
    device = torch.device(device)
    common = {"rank": rank, "group": group, "device": device, "probe_bytes": probe_bytes, "links": links,
              "warmup": warmup, "repeats": repeats}
    intra = _time_class(topology.node_groups(), **common)
    inter = _time_class(topology.cross_groups(), **common)
    assert inter is not None  # two nodes or more: rank 0 of each node meets the others
    return LinkProfile(
        intra_node_gbps=None if intra is None else intra[1], inter_node_gbps=inter[1], probe_bytes=probe_bytes,
        intra_node_ms=None if intra is None else intra[0], inter_node_ms=inter[0], emulated=links is not None,
    )
