"""What a model's constructor computed on the meta device, computed again on the host.

A module built on the meta device holds buffers without values. Persistent buffers come back from
the model's initialisation or from the weight files; a non-persistent one (rotary ``inv_freq``,
a causal mask, position ids, ALiBi slopes) is neither saved nor, in general, written by an
initialisation: only the module's constructor computed it. :class:`ConstructionRecord` is a torch
function mode held while a model is built on meta; it records every torch call whose result is a
meta tensor. :meth:`ConstructionRecord.replay` then runs, on the host, the calls a given buffer
depends on, in their original order and nothing else:

    needed(c)  <=>  c writes a tensor that a buffer, or a needed call, reads
    replay     =    [c(args with each meta tensor replaced by its host value) for c in calls if needed(c)]

so a buffer's host value is the one the constructor would have produced on the host, whatever
the model, with no copy of its parameters (a parameter is read by no buffer's calls, so none is
allocated). Random calls are replayed under one fixed seed, so every rank gets the same values.

[Note: the two values of a non-persistent buffer]
A meta-built buffer can get a value two ways: from the initialisation the strategy runs on its
module (Hugging Face's ``_init_weights`` recomputes rotary frequencies; ``reset_parameters()`` may),
and from this replay of its constructor. A model built normally holds the initialisation's value
where it writes one, else the constructor's. Where both exist they must agree to rounding, or the
fit is refused naming the buffer: one of the two computations is not what its author meant, and
training on either would be a guess.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

_REPLAY_SEED = 0x5EED


@dataclass(frozen=True)
class _Call:
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    returned: tuple[tuple[int, torch.Tensor], ...]  # (position among the output's leaves, meta tensor)
    mutated: tuple[torch.Tensor, ...]  # meta inputs it wrote in place
    default_dtype: torch.dtype  # what factories without a dtype made

    def writes(self) -> list[int]:
        return [id(t) for _, t in self.returned] + [id(t) for t in self.mutated]

    def reads(self) -> list[torch.Tensor]:
        return [t for t in tree_flatten((self.args, self.kwargs))[0] if _is_meta_tensor(t)]


def _is_meta_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


_IN_PLACE_OPERATORS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "lshift", "rshift", "and", "or", "xor"))


def _writes_in_place(func: Any) -> bool:
    """``x.mul_(2)``, ``x[i] = v``, ``x += 1``: calls that write their first argument."""
    name = getattr(func, "__name__", "")
    if name == "__setitem__" or name in _IN_PLACE_OPERATORS:
        return True
    return name.endswith("_") and not name.startswith("__")


class ConstructionRecord(TorchFunctionMode):
    """A torch function mode that records the calls producing meta tensors (see the module docstring).

    Enter it inside ``torch.device("meta")`` while the model is built; the record keeps the meta
    tensors it saw alive (they hold no memory), so identities stay unique."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[_Call] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        returned = tuple((i, t) for i, t in enumerate(tree_flatten(out)[0]) if _is_meta_tensor(t))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if _is_meta_tensor(t)]
        mutated = tuple(inputs[:1]) if inputs and _writes_in_place(func) else ()
        mutated += tuple(t for t in tree_flatten(kwargs.get("out"))[0] if _is_meta_tensor(t))
        if returned or mutated:
            self.calls.append(_Call(func, tuple(args), dict(kwargs), returned, mutated, torch.get_default_dtype()))
        return out

    def replay(self, tensors: Iterable[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Host values for those of ``tensors`` (meta) the record can recompute, by ``id``; a tensor
        the record never saw made, or one that depends on such a tensor, is left out."""
        wanted = [t for t in tensors if t.is_meta]
        needed_ids = {id(t) for t in wanted}
        needed: list[_Call] = []
        for call in reversed(self.calls):
            if needed_ids.intersection(call.writes()):
                needed.append(call)
                needed_ids.update(id(t) for t in call.reads())
        values: dict[int, torch.Tensor] = {}

        def host(x: Any) -> Any:
            if _is_meta_tensor(x):
                return values[id(x)]  # KeyError: made outside the record
            if isinstance(x, torch.device) and x.type == "meta":
                return torch.device("cpu")
            if isinstance(x, str) and x == "meta":
                return "cpu"
            return x

        with torch.random.fork_rng(devices=[]), torch.no_grad(), _default_dtype_restored():
            torch.manual_seed(_REPLAY_SEED)
            for call in reversed(needed):
                torch.set_default_dtype(call.default_dtype)
                try:
                    out = call.func(*tree_map(host, call.args), **tree_map(host, call.kwargs))
                except Exception:  # noqa: BLE001 - it reads a tensor made outside the record, or cannot run on the host
                    for unknown in call.writes():
                        values.pop(unknown, None)  # a tensor it would have written in place is unknown too
                    continue
                leaves = tree_flatten(out)[0]
                for position, meta_out in call.returned:
                    if position < len(leaves) and isinstance(leaves[position], torch.Tensor):
                        values[id(meta_out)] = leaves[position]
        return {id(t): values[id(t)] for t in wanted if id(t) in values}


@contextlib.contextmanager
def _default_dtype_restored() -> Iterator[None]:
    before = torch.get_default_dtype()
    try:
        yield
    finally:
        torch.set_default_dtype(before)
