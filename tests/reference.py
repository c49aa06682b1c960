"""Independent reference: single-process training on the global batch."""

from __future__ import annotations

import torch

from tests.models import TinyLM, batches


def split(batch_size: int, num_micro_batches: int) -> list[int]:
    """Near-equal micro-batch sizes (written out here, not imported from the code under test)."""
    if batch_size == 0:
        return []
    q, r = divmod(batch_size, num_micro_batches)
    return [q + 1] * r + [q] * (num_micro_batches - r)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def train_reference(steps: int, global_batch: int, clip: float | None = None, start: int = 0,
                    model: TinyLM | None = None, optimizer: torch.optim.Optimizer | None = None, vocab: int = 17):
    """Train TinyLM on global batches ``start .. start+steps``; return (model, optimizer)."""
    model = model or TinyLM()
    optimizer = optimizer or make_optimizer(model.parameters())
    for x, y in batches(start + steps, global_batch, vocab=vocab)[start:]:
        loss = model.loss(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def reference_state(model: TinyLM, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and Adam moments by name (``name`` and ``name.exp_avg`` ...), flattened."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.detach().reshape(-1).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{key}"] = optimizer.state[p][key].reshape(-1).clone()
    return out
