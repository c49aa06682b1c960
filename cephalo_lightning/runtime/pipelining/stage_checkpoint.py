"""A pipelined run's checkpoint in the format of every other: each parameter once, under its name in the model.

    saved(model.<name>)  = the pieces of every rank of the stage holding <name>, each at its offset
    saved(optimizer_<i>.state.<name>.<key>)  alike; Adam's step once per parameter, by its stage's
                           first rank; persistent buffers once, by the first stage's first rank holding them
    a parameter tied across stages   written by its first holding stage alone, under its first name in the model

so the directory is the one a non-pipelined run of the same model writes (the same keys and shapes,
``cephalo.json``'s shapes, units and aliases over the whole model), and loads under any plan.
Loading into a stage is :func:`cephalo_lightning.runtime.checkpoint.load` over the stage's own
group, each of its pieces asked for under the parameter's name in the model (``names``).

[Note: one save over the stages] The save is collective over every rank (the default process group):
every stage's ranks write their pieces in one DCP save; ``cephalo.json``'s model-side part is each
stage's, gathered and merged in stage order on rank 0.
"""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from cephalo_lightning.runtime.checkpoint.dcp_planners import Entry
from cephalo_lightning.runtime.checkpoint.entries import (
    buffers,
    local_pieces,
    optimizer_entries,
    replicated_entries,
    state_dict_aliases,
)
from cephalo_lightning.runtime.checkpoint.format import MODEL_PREFIX, TOKEN_KEY
from cephalo_lightning.runtime.checkpoint.safe_load import check_loadable
from cephalo_lightning.runtime.checkpoint.save_load import PreparedSave
from cephalo_lightning.runtime.distributed import broadcast_object, gather_objects
from cephalo_lightning.runtime.pipelining.runner import PipelineRunner


def prepare_stages(runner: PipelineRunner, optimizers: Sequence[torch.optim.Optimizer], meta: dict[str, Any],
                   safe_globals: Iterable[Any] = ()) -> PreparedSave:
    """Collective over every rank: what this rank writes of a pipelined run's checkpoint (see the
    module docstring); write it with ``write_prepared(path, prepared, info, None)``."""
    check_loadable(meta, safe_globals)
    token = broadcast_object(uuid.uuid4().hex[:12])
    rank, sharded, names = runner.rank, runner.sharded, runner.canonical
    first_of_stage = rank == runner.layout.stage_ranks(runner.stage)[0]
    later = {tie.name for tie in runner.ties if not tie.counted}  # a tie's later holders write nothing of it
    entries = [Entry(MODEL_PREFIX + names[name], shape, piece.dtype, piece.detach().reshape(-1), start)
               for name, piece, shape, start in local_pieces(sharded) if name not in later]
    held = {MODEL_PREFIX + name: t for name, t in buffers(sharded).items()} if first_of_stage else {}
    claims = gather_objects(sorted(held))
    owner = {name: r for r in reversed(range(len(claims))) for name in claims[r]}  # the lowest rank claiming it
    entries += replicated_entries({k: v for k, v in held.items() if owner[k] == rank}, 0)
    infos = []
    for i, optimizer in enumerate(optimizers):
        prefix = f"optimizer_{i}.state."
        saved = optimizer_entries(sharded, optimizer, f"optimizer_{i}")

        def renamed(fqn: str, prefix: str = prefix) -> tuple[str, str]:
            name, _, key = fqn[len(prefix):].rpartition(".")
            return f"{prefix}{names[name]}.{key}", name

        for entry in saved.entries:
            fqn, name = renamed(entry.fqn)
            if name not in later:
                entries.append(Entry(fqn, entry.shape, entry.dtype, entry.flat, entry.start))
        steps = {renamed(fqn)[0]: t for fqn, t in saved.replicated.items() if renamed(fqn)[1] not in later}
        entries += replicated_entries(steps, 0 if first_of_stage else 1)
        groups = [{**g, "params": [names[n] for n in g["params"] if n not in later]} for g in saved.info["param_groups"]]
        scalars = {}
        for key, value in saved.info["scalars"].items():
            name, _, state_key = key.rpartition(".")
            if name not in later:
                scalars[f"{names[name]}.{state_key}"] = value
        infos.append({"param_groups": groups, "scalars": scalars})
    part = None
    if first_of_stage:
        shapes = {names[name]: list(shape) for name, _, shape, _ in local_pieces(sharded) if name not in later}
        aliases = {**state_dict_aliases(sharded), **{name: names[name] for name in later}}
        part = (runner.stage, shapes, [[names[s.name] for s in unit.spans if s.name not in later] for unit in sharded.units],
                aliases, infos)
    parts = sorted((p for p in gather_objects(part) if p is not None), key=lambda p: p[0])
    buffer = io.BytesIO()
    if rank == 0:
        torch.save({**meta, TOKEN_KEY: token}, buffer)
    return PreparedSave(token, entries, buffer.getvalue(), _merged(parts, len(optimizers)), rank == 0)


def _merged(parts: list[tuple[Any, ...]], count: int) -> dict[str, Any]:
    """``cephalo.json``'s model-side part over the stages, in stage order."""
    document: dict[str, Any] = {"param_shapes": {}, "units": [], "aliases": {}, "optimizers": []}
    for _, shapes, units, aliases, _ in parts:
        document["param_shapes"].update(shapes)
        document["units"] += [unit for unit in units if unit]
        document["aliases"].update(aliases)
    for i in range(count):
        groups: list[dict[str, Any]] = []
        scalars: dict[str, Any] = {}
        for *_, infos in parts:
            for index, group in enumerate(infos[i]["param_groups"]):
                if index < len(groups):
                    groups[index]["params"] += group["params"]
                else:
                    groups.append({**group, "params": list(group["params"])})
            scalars.update(infos[i]["scalars"])
        document["optimizers"].append({"param_groups": groups, "scalars": scalars})
    return document
