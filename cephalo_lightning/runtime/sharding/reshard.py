"""Re-sharding in place: every rank's state moves onto the layout of new shares (and groups).

Each unit's master shard, and every optimizer-state tensor shaped like the pieces, moves by the
overlap of the old and new ranges (one ``all_to_all_single`` per unit and tensor on the world
group, no full gather, no disk); the optimizers' parameter groups and state are re-keyed to the
new local pieces. With shard groups, a rank's new range is filled from its OLD group's owners (every
group holds a whole replica, so its old group has every element it needs), which also lets a re-plan
change the grouping in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from cephalo_lightning.runtime.collectives import Collectives
from cephalo_lightning.runtime.distributed import gather_objects
from cephalo_lightning.runtime.sharding.flat_unit import FlatUnit, UnitState, piece_shape
from cephalo_lightning.runtime.sharding.layout import ShardLayout, UnitLayout, check_shard_groups, group_layouts


class Resharded(Protocol):
    """What :func:`reshard` reads of the sharded model (:class:`~.sharded_model.ShardedModel`), and
    the one method through which the model takes the new layouts: :meth:`adopt_layouts`."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    world: Collectives
    units: list[FlatUnit]
    shard_groups: tuple[tuple[int, ...], ...]
    layouts: tuple[ShardLayout, ...]
    layout: ShardLayout

    def wait_reductions(self) -> None: ...
    def adopt_layouts(self, shard_groups: tuple[tuple[int, ...], ...], layouts: tuple[ShardLayout, ...]) -> None: ...


PieceState = dict[torch.optim.Optimizer, dict[str, Any]]  # one piece's state in every optimizer


@dataclass(frozen=True)
class _Moves:
    """How one unit's state moves for this rank: what of its old range goes to each world rank
    (ranges relative to the old range, in world order) and how much it receives from each."""

    send: tuple[tuple[int, int], ...]
    receive_sizes: tuple[int, ...]

    @property
    def send_sizes(self) -> list[int]:
        return [b - a for a, b in self.send]

    def outgoing(self, flat: torch.Tensor) -> torch.Tensor:
        """The send buffer: the pieces of ``flat`` (this rank's old range) in destination order; a
        view when they follow each other (one group: the new ranges are in world order), so the move
        copies nothing more than it sends."""
        pieces = [(a, b) for a, b in self.send if b > a]
        if not pieces:
            return flat[:0]
        if all(b == c for (_, b), (c, _) in zip(pieces, pieces[1:])):
            return flat[pieces[0][0] : pieces[-1][1]]
        return torch.cat([flat[a:b] for a, b in pieces])


@torch.no_grad()
def reshard(model: Resharded, shares: Sequence[float], optimizers: Sequence[torch.optim.Optimizer] = (),
            shard_groups: Sequence[Sequence[int]] | None = None) -> ShardLayout:
    """Collective: move every rank's state onto the layout of new ``shares`` and ``shard_groups``
    (None: the current groups; see :meth:`ShardedModel.reshard`). Peak memory: old share + new share
    (one unit's state in flight)."""
    if len(shares) != model.world_size:
        raise ValueError(f"{len(shares)} shares for a world of {model.world_size} ranks")
    if any(u.state is not UnitState.SHARDED for u in model.units):
        raise RuntimeError("reshard() between steps only: some units are gathered")
    model.wait_reductions()
    groups = check_shard_groups(shard_groups if shard_groups is not None else model.shard_groups, model.world_size)
    old_groups, old_layouts = model.shard_groups, model.layouts
    layout = model.layout
    new_layouts = group_layouts([u.numel for u in layout.units], list(shares), groups,
                                [u.name for u in layout.units], [u.params for u in layout.units])
    rank, world = model.rank, model.world
    new_group = next(g for g, ranks in enumerate(groups) if rank in ranks)
    new_place = groups[new_group].index(rank)
    index_of = {id(p): (opt, gi, pi) for opt in optimizers for gi, g in enumerate(opt.param_groups)
                for pi, p in enumerate(g["params"])}
    for u, unit in enumerate(model.units):
        moves = _overlaps([lay.units[u] for lay in old_layouts], old_groups, [lay.units[u] for lay in new_layouts],
                          groups, rank)
        new_unit = new_layouts[new_group].units[u]
        lo, hi = new_unit.shard_range(new_place)
        master = torch.empty(hi - lo, dtype=unit.master.dtype, device=unit.device)
        world.move(moves.outgoing(unit.shard_values()), master, moves.send_sizes, list(moves.receive_sizes),
                   name=unit.name)
        old_pieces = list(unit.local_params)
        moved_state = _move_optimizer_state(unit, old_pieces, new_unit, new_place, moves, optimizers, world)
        unit.relayout(new_unit, master, rank=new_place)
        for old, new, state in zip(old_pieces, unit.local_params, moved_state):
            for opt, key_state in state.items():
                opt.state.pop(old, None)
                opt.state[new] = key_state
            if id(old) in index_of:
                opt, gi, pi = index_of[id(old)]
                opt.param_groups[gi]["params"][pi] = new
    model.adopt_layouts(groups, new_layouts)
    return model.layout


def _move_optimizer_state(
    unit: FlatUnit, pieces: list[nn.Parameter], new: UnitLayout, rank: int, moves: _Moves,
    optimizers: Sequence[torch.optim.Optimizer], comm: Collectives,
) -> list[PieceState]:
    """Every optimizer's per-piece state, moved to the new layout like the master shard.

    State tensors shaped like the piece (Adam's moments, momentum) move; everything else
    (Adam's ``step``) is the same for every piece of a parameter and stays.
    """
    out: list[PieceState] = [{} for _ in pieces]
    new_lo, new_hi = new.shard_range(rank)
    for opt in optimizers:
        members = {id(p) for group in opt.param_groups for p in group["params"]}
        inside = [id(p) in members and p.requires_grad for p in pieces]
        states = [opt.state.get(p, {}) if ins else {} for p, ins in zip(pieces, inside)]
        shaped = [{k for k, v in st.items() if torch.is_tensor(v) and k != "step" and v.shape == p.shape}
                  for p, st, ins in zip(pieces, states, inside) if ins]
        agreed = _agree(shaped, comm, unit.name)
        for key in agreed:
            flat = torch.cat([st[key].reshape(-1) if ins else p.detach().new_zeros(p.numel())
                              for p, st, ins in zip(pieces, states, inside)]) if pieces else unit.master.new_zeros(0)
            moved = torch.empty(new_hi - new_lo, dtype=flat.dtype, device=flat.device)
            comm.move(moves.outgoing(flat), moved, moves.send_sizes, list(moves.receive_sizes), name=f"{unit.name}:{key}")
            for index, span in enumerate(new.params):
                if inside[index]:
                    a, b = new.param_piece(span, rank)
                    start = span.offset + a - new_lo
                    out[index].setdefault(opt, {})[key] = moved[start : start + b - a].view(piece_shape(span.shape, b - a)).clone()
        for index, st in enumerate(states):
            for key, value in st.items():
                if key not in agreed:
                    out[index].setdefault(opt, {})[key] = value
    return out


def _overlaps(old: Sequence[UnitLayout], old_groups: Sequence[Sequence[int]], new: Sequence[UnitLayout],
              new_groups: Sequence[Sequence[int]], rank: int) -> _Moves:
    """What ``rank`` sends to and receives from every world rank to move one unit from the old
    groups' layouts to the new ones: each rank's new range comes from its old group's owners.

    A rank receives from the ranks of its own old group, in world order, which is their order in
    the group and so the order of their ranges: what arrives are consecutive pieces of its new
    range and the receive buffer needs no copying.
    """
    def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
        return max(a[0], b[0]), min(a[1], b[1])

    def where(groups: Sequence[Sequence[int]], r: int) -> tuple[int, int]:
        g = next(g for g, ranks in enumerate(groups) if r in ranks)
        return g, groups[g].index(r)

    world = sum(len(ranks) for ranks in old_groups)
    old_group, old_place = where(old_groups, rank)
    mine_old = old[old_group].shard_range(old_place)
    new_group, new_place = where(new_groups, rank)
    mine_new = new[new_group].shard_range(new_place)
    send, receive = [], []
    for q in range(world):
        q_old_group, q_old_place = where(old_groups, q)
        if q_old_group != old_group:
            send.append((0, 0))
            receive.append(0)
            continue
        g, place = where(new_groups, q)
        a, b = overlap(mine_old, new[g].shard_range(place))
        send.append((a - mine_old[0], b - mine_old[0]) if b > a else (0, 0))
        a, b = overlap(old[old_group].shard_range(q_old_place), mine_new)
        receive.append(max(0, b - a))
    return _Moves(tuple(send), tuple(receive))


def _agree(per_piece: list[set[str]], comm: Collectives, unit: str) -> list[str]:
    """The optimizer-state keys every trainable piece of the unit has, on every rank.

    Every rank must move the same tensors: a key some pieces have and others lack (state created
    lazily, say) cannot be moved consistently, and every rank raises alike.
    """
    local = (sorted(set.union(*per_piece)) if per_piece else [], sorted(set.intersection(*per_piece)) if per_piece else None)
    everyone = gather_objects(local, comm.group)  # the world: every rank moves the same tensors
    union = {k for any_keys, _ in everyone for k in any_keys}
    common = [set(all_keys) for _, all_keys in everyone if all_keys is not None]
    complete = set.intersection(*common) if common else set()
    if union != complete:
        raise RuntimeError(
            f"unit {unit}: optimizer state {sorted(union - complete)} exists for some parameters but not others "
            "(created lazily?); take one optimizer step before re-sharding"
        )
    return sorted(union)
