"""Independent reference: single-process training on the global batch.

    for each step:  sum over its pieces (batch_i, w_i) of  d(loss(batch_i) * w_i)/dθ,  clip,  θ <- optimizer(θ)

Every test that checks a distributed run compares it with :func:`train_steps`, the one loop here: a
whole global batch is one piece of weight 1; a batch cut as a plan cuts it (or accumulated over several
batches) is several pieces, each weighted by its share of the samples or of the label tokens
(:func:`cut`, :func:`cut_by`); summed as data parallelism sums it, each rank's pieces accumulate apart
(``per_rank``). Nothing here imports the code under test."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from tests.tiny_lm import TinyLM, batches

Piece = tuple[Any, "float | torch.Tensor"]  # a (micro-)batch and the weight its loss is multiplied by


def split(batch_size: int, num_micro_batches: int) -> list[int]:
    """Near-equal micro-batch sizes (written out here, not imported from the code under test)."""
    if batch_size == 0:
        return []
    q, r = divmod(batch_size, num_micro_batches)
    return [q + 1] * r + [q] * (num_micro_batches - r)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def train_steps(optimizer: torch.optim.Optimizer, loss_of: Callable[[Any], torch.Tensor],
                steps: Iterable[Sequence[Any]], clip: float | None = None,
                after_step: Callable[[], None] | None = None, per_rank: bool = False) -> list[float]:
    """One optimizer step per entry of ``steps``: every piece's ``loss_of(batch) * weight`` backward (the
    gradients add up), the gradients clipped to global norm ``clip`` (over the optimizer's parameters),
    the step, the gradients cleared, then ``after_step`` (a scheduler's step). Returns each piece's loss.

    ``per_rank``: each step is a list of ranks' pieces, as data parallelism sums them: each rank's
    gradient accumulated alone, then the ranks' gradients added in rank order."""
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    losses: list[float] = []
    for step in steps:
        if per_rank:
            summed = [torch.zeros_like(p) for p in parameters]
            for pieces in step:
                _backward(loss_of, pieces, losses)
                for total, p in zip(summed, parameters):
                    total += p.grad
                    p.grad = None
            for total, p in zip(summed, parameters):
                p.grad = total
        else:
            _backward(loss_of, step, losses)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(parameters, clip)
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step()
    return losses


def _backward(loss_of: Callable[[Any], torch.Tensor], pieces: Sequence[Piece], losses: list[float]) -> None:
    for batch, weight in pieces:
        loss = loss_of(batch)
        losses.append(loss.item())
        (loss * weight).backward()


def whole(global_batches: Iterable[Any]) -> list[list[Piece]]:
    """Each global batch as one step of one piece (weight 1)."""
    return [[(batch, 1.0)] for batch in global_batches]


def cut(batch: Any, sizes: Sequence[int], whole: int) -> list[Piece]:
    """``batch`` (a tuple of tensors) cut into consecutive pieces of ``sizes``, each weighted by ``size / whole``."""
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return [(tuple(t[lo : lo + size] for t in batch), size / whole) for lo, size in zip(starts, sizes)]


def cut_by(batch_of: Callable[[int, int], Any], start: int, sizes: Sequence[int],
           count: Callable[[Any], Any]) -> list[Piece]:
    """Samples ``start ..`` cut into consecutive pieces of ``sizes`` (``batch_of(lo, hi)`` builds one),
    each weighted by its share of the whole's ``count`` (its label tokens, its samples)."""
    total, pieces = count(batch_of(start, start + sum(sizes))), []
    for size in sizes:
        piece = batch_of(start, start + size)
        pieces.append((piece, count(piece) / total))
        start += size
    return pieces


def steps_of(batch_of: Callable[[int, int], Any], steps: int, global_batch: int, cuts: Sequence[int] | None = None,
             count: Callable[[Any], Any] | None = None) -> list[list[Piece]]:
    """``steps`` global batches in order (``batch_of(lo, hi)`` builds one): each whole, one piece of weight
    1, or cut into ``cuts`` weighted by ``count`` (:func:`cut_by`)."""
    return [[(batch_of(s * global_batch, (s + 1) * global_batch), 1.0)] if cuts is None
            else cut_by(batch_of, s * global_batch, cuts, count) for s in range(steps)]


def target_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A causal LM batch's target tokens: the labels from position 1 on that are not -100."""
    return (batch["labels"][:, 1:] != -100).sum()


def sliced(data: Any, steps: int, global_batch: int, start: int = 0) -> list[Any]:
    """Global batches ``start .. start + steps`` of ``data`` taken in order: ``data[k * global_batch : ...]``."""
    return [data[k * global_batch : (k + 1) * global_batch] for k in range(start, start + steps)]


def tiny_loss(model: TinyLM) -> Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """TinyLM's loss on a batch ``(x, y)``."""
    return lambda batch: model.loss(model(batch[0]), batch[1])


def train_reference(steps: int, global_batch: int, clip: float | None = None, start: int = 0,
                    model: TinyLM | None = None, optimizer: torch.optim.Optimizer | None = None, vocab: int = 17):
    """Train TinyLM on global batches ``start .. start+steps``; return (model, optimizer)."""
    model = model or TinyLM()
    optimizer = optimizer or make_optimizer(model.parameters())
    train_steps(optimizer, tiny_loss(model), whole(batches(start + steps, global_batch, vocab=vocab)[start:]), clip)
    return model, optimizer


def reference_state(model: TinyLM, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and Adam moments by name (``name`` and ``name.exp_avg`` ...), flattened."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.detach().reshape(-1).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{key}"] = optimizer.state[p][key].reshape(-1).clone()
    return out


def with_moments(params: dict[str, torch.Tensor], named: Iterable[tuple[str, torch.nn.Parameter]],
                 optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``params`` and, for each named parameter the optimizer holds Adam moments of, ``name.exp_avg`` ..."""
    out = dict(params)
    for name, p in named:
        for key in ("exp_avg", "exp_avg_sq"):
            if key in optimizer.state.get(p, {}):
                out[f"{name}.{key}"] = optimizer.state[p][key].clone()
    return out
