"""The layered form of a model no adapter knows, found from the structure its own forward shows.

Most transformers are an embedding stage, a ``ModuleList`` of blocks each called on the previous
one's output (plus side inputs: masks, position ids, rotary tables, ALiBi biases), and a head with
a loss. :func:`adapt` takes the largest ``ModuleList`` as the candidate block sequence; the first
training step checks it (:meth:`Discovery.observe`: forward hooks on an ordinary forward of the
first micro-batch) and the strategy compares the layered loss with the ordinary one before it
trains a step this way. The user's ``training_step`` is "the model's forward" here: it is what
defines the loss, so no head or label convention is assumed.

How each layer of the schedule runs the model's own code (``forward`` = ``training_step`` on a
micro-batch), with the blocks temporarily replaced in their ``ModuleList`` by stand-ins
(:class:`_StandIn`: each records what the model passes to its block and answers with the hidden
state it was given, without computing anything; the model's code itself is untouched):

* ``prepare``: the forward up to the LAST stand-in, which stops it; every block's side inputs are
  recorded, and block 0's hidden state is the first layer's input;
* layer 1: block 0 on that hidden state; in the backward's recompute the forward runs again up
  to stand-in 0, so the embedding stage is in layer 1's graph (and in the forward too when the
  stage draws random numbers, so both draw the same);
* layers 2 .. L-1: block i called with its recorded side inputs;
* layer L: the whole forward again, blocks 0 .. L-2 as stand-ins and block L-1 live on the
  schedule's hidden state (a pre-hook puts it in): its output is the loss, whose gradient reaches
  the schedule through block L-1.

A stand-in answers with its INPUT, so any use of a block's output other than by the next block
changes the layered loss, and the first step's comparison catches it (then the uniform mode runs).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cephalo_lightning.models.protocol import LayeredModel, LossWeighting
from cephalo_lightning.runtime.batching import tensors_in
from cephalo_lightning.runtime.layered import Layer

Slot = int | str  # where a block call carries the hidden state: a position or a keyword
Forward = Callable[[Any], Any]  # micro-batch -> the loss (the user's training_step)
HIDDEN_NAMES = ("hidden_states", "hidden", "x", "src", "input", "inputs")


def block_list(module: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The ``ModuleList`` holding the most parameters (at least two members with parameters):
    the candidate block sequence. Nested lists (experts inside a block) hold fewer than the outer one."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, sub in module.named_modules():
        if not isinstance(sub, nn.ModuleList) or len(sub) < 2:
            continue
        if not all(any(True for _ in m.parameters()) for m in sub):
            continue
        size = sum(p.numel() for p in {id(p): p for p in sub.parameters()}.values())
        if best is None or size > best[0]:
            best = (size, name, sub)
    return None if best is None else (best[1], best[2])


def _loss_of(output: Any) -> torch.Tensor:
    return output["loss"] if isinstance(output, dict) else output


def _get(args: tuple, kwargs: dict, slot: Slot) -> Any:
    return args[slot] if isinstance(slot, int) else kwargs[slot]


def _put(args: tuple, kwargs: dict, slot: Slot, value: Any) -> tuple[tuple, dict]:
    if isinstance(slot, int):
        return args[:slot] + (value,) + args[slot + 1:], kwargs
    return args, {**kwargs, slot: value}


def _first_slot(args: tuple, kwargs: dict) -> Slot | None:
    """Block 0's hidden state: its first positional tensor, or a keyword named like one."""
    if args and isinstance(args[0], torch.Tensor):
        return 0
    return next((name for name in HIDDEN_NAMES if isinstance(kwargs.get(name), torch.Tensor)), None)


def _slots_holding(args: tuple, kwargs: dict, tensor: torch.Tensor) -> list[Slot]:
    return [i for i, a in enumerate(args) if a is tensor] + [k for k, v in kwargs.items() if v is tensor]


def _hidden_of(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def _is_cache(value: Any) -> bool:
    """A key/value cache the model made for this forward (Hugging Face ``Cache``): blocks append to it."""
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str, tuple)):
        return False
    if "transformers" not in sys.modules:
        return False
    from transformers.cache_utils import Cache

    return isinstance(value, Cache)


def _without_caches(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Side inputs with a fresh-for-this-forward cache left out: the schedule runs each block twice
    (forward, recompute) and must not append its keys twice; a block with no cache attends exactly
    as with the empty one the model made."""
    return (tuple(None if _is_cache(a) else a for a in args),
            {k: (None if _is_cache(v) else v) for k, v in kwargs.items()})


@dataclass(frozen=True)
class BlockInputs:
    """What the model passed to one block, the hidden state's slot noted."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    slot: Slot

    def run(self, block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        args, kwargs = _put(self.args, self.kwargs, self.slot, hidden)
        return _hidden_of(block(*args, **kwargs))


@dataclass(frozen=True)
class Structure:
    """What the first step's ordinary forward showed: per block, where its hidden state goes in
    and what else its output carries (non-tensor values a stand-in gives back unchanged)."""

    slots: tuple[Slot, ...]
    rest: tuple[tuple[Any, ...] | None, ...]  # None: the block returns a tensor; else output[1:], tensors as None
    makes_cache: bool = False  # the forward made a key/value cache and passed it to the blocks


@dataclass(frozen=True)
class _Side:
    micro_batch: Any
    calls: tuple[BlockInputs, ...]
    reusable: bool  # the embedding stage drew no random numbers: the forward may use prepare's hidden state


def _rng_states(like: torch.Tensor | None) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if like is not None and like.is_cuda:  # pragma: no cover - CUDA only
        states.append(torch.cuda.get_rng_state(like.device))
    return states


class _Stop(Exception):
    """Raised by a stand-in to end the model's forward where the caller needs no more (not an error)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


class _StandIn(nn.Module):
    """Takes a block's place in its list for one pass: records the call, answers with its input.
    Made once per block and kept (a pass swaps it in, sets what it answers, swaps it out); any
    attribute the model's code reads from its blocks (``attention_type``, ...) is the block's."""

    def __init__(self, index: int, block: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_block", block)  # not a submodule: its parameters stay where they are
        object.__setattr__(self, "_answer", None)
        self.index = index

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._answer(self.index, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_block"), name)


class Observation:
    """Calls of the real blocks during one ordinary forward (pre- and forward hooks)."""

    def __init__(self, blocks: tuple[nn.Module, ...]) -> None:
        self.blocks = blocks
        self.calls: list[tuple[int, tuple, dict]] = []
        self.outputs: list[tuple[int, Any]] = []

    def pre_hook(self, index: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.calls.append((index, args, kwargs))

    def hook(self, index: int, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.outputs.append((index, output))

    def structure(self) -> tuple[Structure | None, str]:
        """The blocks' structure, or ``(None, why they do not form a sequence)``."""
        n = len(self.blocks)
        order = [i for i, _, _ in self.calls]
        twice = sorted({i for i in order if order.count(i) > 1})
        if twice:
            return None, f"block {twice[0]} is called {order.count(twice[0])} times in one forward"
        if sorted(order) != list(range(n)):
            return None, f"blocks {sorted(set(range(n)) - set(order))} of {n} are not called in the forward"
        if order != list(range(n)):
            return None, f"the blocks are called in the order {order}, not in their list's order"
        outputs = dict(self.outputs)
        slots: list[Slot] = []
        rest: list[tuple[Any, ...] | None] = []
        earlier: dict[int, int] = {}  # id of an earlier block's hidden output -> that block
        previous: torch.Tensor | None = None
        for index, args, kwargs in self.calls:
            if index == 0:
                slot = _first_slot(args, kwargs)
                if slot is None:
                    return None, "block 0 is not called with a hidden-state tensor"
            else:
                held = _slots_holding(args, kwargs, previous)
                if len(held) != 1:
                    return None, (f"block {index} is not called on block {index - 1}'s output" if not held else
                                  f"block {index} receives block {index - 1}'s output {len(held)} times")
                slot = held[0]
            args_rest, kwargs_rest = _put(args, kwargs, slot, None)
            for tensor in tensors_in((args_rest, kwargs_rest)):
                if id(tensor) in earlier:
                    return None, (f"block {index} takes block {earlier[id(tensor)]}'s output besides its hidden "
                                  "state (a skip between blocks)")
                if tensor.requires_grad:
                    return None, (f"block {index} takes a side input computed with trained parameters outside the "
                                  "blocks (it would get no gradient)")
            out = outputs.get(index)
            if isinstance(out, torch.Tensor):
                rest.append(None)
            elif isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
                # what else it returns (attention weights, ...) a stand-in gives back as None: if the model
                # used it, the layered pass fails or its loss differs, and the check falls back
                rest.append(tuple(None if next(tensors_in(item), None) is not None else item for item in out[1:]))
            else:
                return None, f"block {index} returns {type(out).__name__}, not its hidden state (a tensor or a tuple)"
            if previous is not None:
                earlier[id(previous)] = index - 1
            previous = _hidden_of(out)
            slots.append(slot)
        makes_cache = any(_is_cache(v) for _, args, kwargs in self.calls for v in (*args, *kwargs.values()))
        return Structure(tuple(slots), tuple(rest), makes_cache), ""


class Discovery:
    """A model's candidate block sequence and the passes of its layered form (module docstring).

    ``root``: the model the forward runs. Where the first step saw its forward make a key/value
    cache for the blocks (Hugging Face ``use_cache``), the layered passes run with that cache off
    (``config.use_cache`` False for the pass, then restored): training reads no cache, the passes
    give the blocks none anyway (:func:`_without_caches`), and making one per pass is most of the
    cost of re-entering the forward."""

    def __init__(self, blocks: nn.ModuleList, forward: Forward, path: str, root: nn.Module | None = None) -> None:
        self.block_list = blocks
        self.blocks = tuple(blocks)
        self.forward = forward
        self.path = path
        self.structure: Structure | None = None  # set by the first step's check
        self._in_pass = False
        self._stand_in_modules = tuple(_StandIn(index, block) for index, block in enumerate(self.blocks))
        self._configs = () if root is None else tuple(
            {id(c): c for c in (getattr(sub, "config", None) for sub in root.modules())
             if isinstance(getattr(c, "use_cache", None), bool)}.values())

    @contextlib.contextmanager
    def observe(self) -> Iterator[Observation]:
        """Hooks on the real blocks for one ordinary forward (removed afterwards)."""
        seen = Observation(self.blocks)
        handles = []
        for index, block in enumerate(self.blocks):
            handles.append(block.register_forward_pre_hook(
                lambda m, a, k, i=index: seen.pre_hook(i, m, a, k), with_kwargs=True))
            handles.append(block.register_forward_hook(
                lambda m, a, k, o, i=index: seen.hook(i, m, a, k, o), with_kwargs=True))
        try:
            yield seen
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def _stand_ins(self, count: int, answer: Callable[[int, tuple, dict], Any]) -> Iterator[None]:
        """Blocks 0 .. count-1 replaced by their stand-ins in the list for one pass (the model's
        cache off, when it makes one), then put back."""
        if self._in_pass:
            raise RuntimeError(f"a pass of the discovered blocks {self.path} began inside another one")
        self._in_pass = True
        configs = self._configs if self._structure().makes_cache else ()
        use_cache = [config.use_cache for config in configs]
        for config in configs:
            config.use_cache = False
        for index in range(count):
            stand_in = self._stand_in_modules[index]
            object.__setattr__(stand_in, "_answer", answer)
            object.__setattr__(stand_in, "training", self.blocks[index].training)
            self.block_list[index] = stand_in
        try:
            yield
        finally:
            for index in range(count):
                self.block_list[index] = self.blocks[index]
                object.__setattr__(self._stand_in_modules[index], "_answer", None)
            for config, value in zip(configs, use_cache):
                config.use_cache = value
            self._in_pass = False

    def _structure(self) -> Structure:
        if self.structure is None:
            raise RuntimeError("the discovered block sequence is used before the first step checked it")
        return self.structure

    def _answer(self, index: int, hidden: torch.Tensor) -> Any:
        rest = self._structure().rest[index]
        return hidden if rest is None else (hidden, *rest)

    def prepare(self, micro_batch: Any) -> tuple[torch.Tensor, _Side]:
        """The forward up to the last block: block 0's hidden state and every block's side inputs."""
        structure, last = self._structure(), len(self.blocks) - 1
        calls: list[BlockInputs] = []
        firsts: list[torch.Tensor] = []

        def record(index: int, args: tuple, kwargs: dict) -> Any:
            slot = structure.slots[index]
            hidden = _get(args, kwargs, slot)
            if index == 0:
                firsts.append(hidden)
            args, kwargs = _without_caches(*_put(args, kwargs, slot, None))
            calls.append(BlockInputs(args, kwargs, slot))
            if index == last:
                raise _Stop(hidden)
            return self._answer(index, hidden)

        device_hint = next(iter(self.blocks[0].parameters()), None)
        before = _rng_states(device_hint)
        with self._stand_ins(len(self.blocks), record), contextlib.suppress(_Stop):
            self.forward(micro_batch)
        if len(calls) != len(self.blocks):
            raise RuntimeError(f"the forward called {len(calls)} of the {len(self.blocks)} blocks it called on the first step")
        reusable = all(torch.equal(a, b) for a, b in zip(before, _rng_states(device_hint)))
        return firsts[0], _Side(micro_batch, tuple(calls), reusable)

    def _hidden_at_block0(self, micro_batch: Any) -> torch.Tensor:
        """The forward up to block 0: the hidden state the embedding stage makes (with its graph
        when a gradient is being computed)."""
        slot = self._structure().slots[0]

        def stop(index: int, args: tuple, kwargs: dict) -> Any:
            raise _Stop(_get(args, kwargs, slot))

        try:
            with self._stand_ins(1, stop):
                self.forward(micro_batch)
        except _Stop as stopped:
            return stopped.hidden
        raise RuntimeError("the forward returned without calling block 0")

    def _first_layer(self, hidden: torch.Tensor, side: _Side) -> torch.Tensor:
        """The embedding stage (the forward up to block 0) and block 0. Under a gradient (the
        recompute) the stage runs again, to be in the graph; without one it reuses ``prepare``'s
        hidden state unless the stage draws random numbers (dropout): then it runs here too, so the
        recompute draws the same ones as the forward did."""
        if torch.is_grad_enabled() or not side.reusable:
            hidden = self._hidden_at_block0(side.micro_batch)
        return side.calls[0].run(self.blocks[0], hidden)

    def _last_layer(self, hidden: torch.Tensor, side: _Side) -> torch.Tensor:
        """The whole forward, blocks before the last as stand-ins, the last live on ``hidden``."""
        last, slot = len(self.blocks) - 1, self._structure().slots[-1]

        def answer(index: int, args: tuple, kwargs: dict) -> Any:
            return self._answer(index, _get(args, kwargs, self._structure().slots[index]))

        def put_hidden(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return _put(args, kwargs, slot, hidden)

        handle = self.blocks[last].register_forward_pre_hook(put_hidden, with_kwargs=True)
        try:
            with self._stand_ins(last, answer):
                return _loss_of(self.forward(side.micro_batch))
        finally:
            handle.remove()

    def layered(self, weighting: LossWeighting, name: str) -> LayeredModel:
        n = len(self.blocks)
        layers = [Layer((self.blocks[0],), self._first_layer, f"{self.path}.0 (with the embedding stage)")]
        layers += [Layer((self.blocks[i],), lambda h, side, i=i: side.calls[i].run(self.blocks[i], h), f"{self.path}.{i}")
                   for i in range(1, n - 1)]
        layers.append(Layer((self.blocks[-1],), self._last_layer, f"{self.path}.{n - 1} (with the head and loss)"))
        return LayeredModel(tuple(layers), self.prepare, lambda out, mb, side: out, weighting,
                            f"{name}, blocks {self.path}[0..{n - 1}] discovered", derived=True, discovery=self)


def routed_model(module: nn.Module) -> nn.Module | None:
    """A module under ``module`` whose config adds the router's auxiliary loss (``output_router_logits``)."""
    return next((sub for sub in module.modules()
                 if getattr(getattr(sub, "config", None), "output_router_logits", False) is True), None)


def router_aux_reason(routed: nn.Module) -> str:
    """Why a loss with the router's auxiliary term stays in the uniform mode."""
    return (f"{type(routed).__name__} adds the router's auxiliary loss (config.output_router_logits=True), one function "
            "of every block's router probabilities and top-k choices over the micro-batch together; the layered loss "
            "pass runs only the last block live (the others answer from the layered pass and their routers do not "
            "run), so its loss would hold the last block's router term alone and give the other blocks' routers no "
            "gradient (carrying the statistics through the schedule would need a loss term of its own for each layer's "
            "backward). CephaloStrategy(router_aux_loss='exclude') trains the token loss alone, layered and exact")


def adapt(module: nn.Module, weighting: LossWeighting, name: str,
          router_aux_excluded: bool = False) -> tuple[LayeredModel | None, str]:
    """The discovered layered form of ``module`` (a LightningModule: its ``training_step`` is the
    forward), or ``(None, why not)``; the first step still checks it (:meth:`Discovery.observe`).
    ``router_aux_excluded``: the fit turns the router's auxiliary loss off at setup
    (``router_aux_loss="exclude"``), so a model that adds it now is layered once it is off."""
    routed = routed_model(module)
    if routed is not None and not router_aux_excluded:
        return None, router_aux_reason(routed)
    found = block_list(module)
    if found is None:
        return None, f"{name} has no ModuleList of two or more blocks with parameters (a block sequence to layer)"
    path, blocks = found
    discovery = Discovery(blocks, lambda micro_batch: module.training_step(micro_batch, 0), path, root=module)
    return discovery.layered(weighting, name), ""
