"""A stage's own module: the model's modules of its layers, under their original names.

    view(stage).named_parameters() == [(name, p) for name, p in model.named_parameters()
                                       if p belongs to a module of the stage's layers]

The view is a tree of plain containers mirroring the model's module paths down to the stage's
modules, which it holds themselves (not copies): sharding the view shards those modules, the
layers' calls run them, and a checkpoint of the view names every parameter as the whole model does.

[Note: parameters tied across stages] A parameter held by modules of two stages (GPT-2's token
embedding, first stage, and its head, last stage) is in both views; both stages hold it (each
sharded over its own stage's ranks) and :func:`tied_across` names it with the stages holding it, so
the runtime can sum its gradient over them.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def module_paths(model: nn.Module) -> dict[int, str]:
    """Every module's first qualified name in ``model``."""
    paths: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), name)
    return paths


def stage_view(model: nn.Module, modules: Sequence[nn.Module], paths: dict[int, str] | None = None) -> nn.Module:
    """A module holding ``modules`` (of ``model``) at their original paths, and nothing else."""
    paths = paths if paths is not None else module_paths(model)
    view = nn.Module()
    for module in modules:
        path = paths.get(id(module))
        if path is None:
            raise ValueError(f"{type(module).__name__} is a layer's module but not part of the model")
        if path == "":
            raise ValueError("a layer's module is the whole model; a pipeline needs the model cut into layers")
        *parents, leaf = path.split(".")
        node = view
        for part in parents:
            child = node._modules.get(part)
            if child is None:
                child = nn.Module()
                node.add_module(part, child)
            node = child
        node.add_module(leaf, module)
    return view


def tied_across(views: Sequence[nn.Module]) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """Parameters held by several stages' views: (the stages, the parameter's name in each), in the
    order of the first view's names."""
    holders: dict[int, dict[int, str]] = {}
    for stage, view in enumerate(views):
        for name, param in view.named_parameters():
            holders.setdefault(id(param), {}).setdefault(stage, name)
    return [(tuple(by_stage), tuple(by_stage.values())) for by_stage in holders.values() if len(by_stage) > 1]
