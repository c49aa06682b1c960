"""Run a model's own code up to its first block and keep what it would pass to every block.

An adapter must call each block exactly as the model's ``forward`` does: with the attention mask
the model builds from the batch's padding, the position ids, the rotary embeddings, ... That code
differs between models and library versions, so it is not re-implemented here: the model's
forward runs until its first block is called, and a forward pre-hook takes the block's arguments
and stops the forward there (:func:`first_block_call`). The embedding the prefix computed is the
first layer's output; the remaining arguments are the side inputs of every block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cephalo_lightning._common.errors import UnsupportedError


class _Reached(Exception):
    """Raised by the pre-hook: the forward got to its first block (not an error)."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.args = args
        self.kwargs = kwargs


@dataclass(frozen=True)
class BlockCall:
    """What the model passes to its blocks: the hidden state, and everything else (side inputs)."""

    hidden: torch.Tensor
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def run(self, block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        out = block(hidden, *self.args, **self.kwargs)
        return out[0] if isinstance(out, tuple) else out


def first_block_call(first_block: nn.Module, forward: Callable[[], Any]) -> BlockCall:
    """Run ``forward()`` until ``first_block`` is called; its arguments, without running it."""

    def stop(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        raise _Reached(args, kwargs)

    handle = first_block.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        forward()
    except _Reached as reached:
        args = reached.args
        if not args or not isinstance(args[0], torch.Tensor):
            hidden = reached.kwargs.pop("hidden_states", None)
            if not isinstance(hidden, torch.Tensor):
                raise UnsupportedError(f"{type(first_block).__name__} was not called with a hidden state tensor") from None
            return BlockCall(hidden, tuple(args), dict(reached.kwargs))
        return BlockCall(args[0], tuple(args[1:]), dict(reached.kwargs))
    finally:
        handle.remove()
    raise RuntimeError(f"the model's forward returned without calling its first block {type(first_block).__name__}")
