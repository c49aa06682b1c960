"""Re-sharding in place: every rank's state moves onto the layout of new shares.

Each unit's master shard, and every optimizer-state tensor shaped like the pieces, moves by the
overlap of the old and new ranges (one ``all_to_all_single`` per unit and tensor, no full gather,
no disk); the optimizers' parameter groups and state are re-keyed to the new local pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from cephalo_lightning.runtime.collectives import Collectives
from cephalo_lightning.runtime.distributed import gather_objects
from cephalo_lightning.runtime.sharding.flat_unit import FlatUnit, UnitState, piece_shape
from cephalo_lightning.runtime.sharding.layout import ShardLayout, UnitLayout, build_layout

if TYPE_CHECKING:
    from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

PieceState = dict[torch.optim.Optimizer, dict[str, Any]]  # one piece's state in every optimizer


@torch.no_grad()
def reshard(model: ShardedModel, shares: Sequence[float], optimizers: Sequence[torch.optim.Optimizer] = ()) -> ShardLayout:
    """Collective: move every rank's state onto the layout of new ``shares`` (see
    :meth:`ShardedModel.reshard`). Peak memory: old share + new share (one unit's state in flight)."""
    if len(shares) != model.world_size:
        raise ValueError(f"{len(shares)} shares for a world of {model.world_size} ranks")
    if any(u.state is not UnitState.SHARDED for u in model.units):
        raise RuntimeError("reshard() between steps only: some units are gathered")
    layout = model.layout
    new_layout = build_layout([u.numel for u in layout.units], list(shares),
                              [u.name for u in layout.units], [u.params for u in layout.units])
    index_of = {id(p): (opt, gi, pi) for opt in optimizers for gi, g in enumerate(opt.param_groups)
                for pi, p in enumerate(g["params"])}
    rank, comm = model.rank, model.comm
    for unit, new_unit in zip(model.units, new_layout.units):
        old_unit = unit.layout
        send, receive = _overlaps(old_unit, new_unit, rank)
        lo, hi = new_unit.shard_range(rank)
        master = torch.empty(hi - lo, dtype=unit.master.dtype, device=unit.device)
        comm.move(unit.master, master, send, receive, name=unit.name)
        old_pieces = list(unit.local_params)
        moved_state = _move_optimizer_state(unit, old_pieces, new_unit, send, receive, optimizers, comm)
        unit.relayout(new_unit, master)
        for old, new, state in zip(old_pieces, unit.local_params, moved_state):
            for opt, key_state in state.items():
                opt.state.pop(old, None)
                opt.state[new] = key_state
            if id(old) in index_of:
                opt, gi, pi = index_of[id(old)]
                opt.param_groups[gi]["params"][pi] = new
    model.layout = new_layout
    return new_layout


def _move_optimizer_state(
    unit: FlatUnit, pieces: list[nn.Parameter], new: UnitLayout, send: list[int], receive: list[int],
    optimizers: Sequence[torch.optim.Optimizer], comm: Collectives,
) -> list[PieceState]:
    """Every optimizer's per-piece state, moved to the new layout like the master shard.

    State tensors shaped like the piece (Adam's moments, momentum) move; everything else
    (Adam's ``step``) is the same for every piece of a parameter and stays.
    """
    out: list[PieceState] = [{} for _ in pieces]
    rank = comm.rank
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
            comm.move(flat, moved, send, receive, name=f"{unit.name}:{key}")
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


def _overlaps(old: UnitLayout, new: UnitLayout, rank: int) -> tuple[list[int], list[int]]:
    """Split sizes moving ``rank``'s old range to every rank's new range, and back.

    Both layouts cut the unit into consecutive ranges in rank order, so what rank r sends to
    ranks 0..W-1 are consecutive pieces of its old range, and what it receives from them are
    consecutive pieces of its new range: the buffers need no copying.
    """
    def overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
        return max(0, min(a[1], b[1]) - max(a[0], b[0]))

    world = old.world_size
    send = [overlap(old.shard_range(rank), new.shard_range(q)) for q in range(world)]
    receive = [overlap(old.shard_range(q), new.shard_range(rank)) for q in range(world)]
    return send, receive


def _agree(per_piece: list[set[str]], comm: Collectives, unit: str) -> list[str]:
    """The optimizer-state keys every trainable piece of the unit has, on every rank.

    Every rank must move the same tensors: a key some pieces have and others lack (state created
    lazily, say) cannot be moved consistently, and every rank raises alike.
    """
    local = (sorted(set.union(*per_piece)) if per_piece else [], sorted(set.intersection(*per_piece)) if per_piece else None)
    everyone = gather_objects(local, comm.group)
    union = {k for any_keys, _ in everyone for k in any_keys}
    common = [set(all_keys) for _, all_keys in everyone if all_keys is not None]
    complete = set.intersection(*common) if common else set()
    if union != complete:
        raise RuntimeError(
            f"unit {unit}: optimizer state {sorted(union - complete)} exists for some parameters but not others "
            "(created lazily?); take one optimizer step before re-sharding"
        )
    return sorted(union)
