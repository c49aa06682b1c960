"""What many test files share: a quiet CPU ``Trainer``, a fit on token data, the single-process
AdamW reference those fits are compared with, and the largest elementwise difference."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from cephalo_lightning import CephaloStrategy, Plan
from tests.lightning_models import loader, token_data
from tests.reference import make_optimizer, sliced, tiny_loss, train_steps
from tests.tiny_lm import TinyLM

NUM_SAMPLES = 48


def trainer(strategy: CephaloStrategy, world: int, steps: int, **kwargs) -> pl.Trainer:
    """A CPU ``Trainer`` with no logger, progress bar, summary or (unless asked) checkpointing;
    ``use_distributed_sampler=False`` keeps the DataLoader's own order."""
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        **{"enable_checkpointing": False, **kwargs},
    )


def fit(module: pl.LightningModule, plan: Plan, world: int, steps: int = 2, data=None, **strategy) -> pl.Trainer:
    """``steps`` optimizer steps of ``module`` under ``plan`` on ``data`` (default: 48 token samples)."""
    t = trainer(CephaloStrategy(plan=plan, **strategy), world, steps)
    t.fit(module, loader(data if data is not None else token_data(NUM_SAMPLES), plan.global_batch_size))
    return t


def reference(steps: int, global_batch: int, clip: float | None = None, accumulate: int = 1, samples: int = NUM_SAMPLES):
    """Single-process training on the same global batches (sequential order): state and losses."""
    model = TinyLM()
    optimizer = make_optimizer(model.parameters())
    parts = sliced(token_data(samples), steps * accumulate, global_batch)
    accumulated = [[(batch, 1 / accumulate) for batch in parts[s * accumulate : (s + 1) * accumulate]] for s in range(steps)]
    losses = train_steps(optimizer, tiny_loss(model), accumulated, clip)
    return {f"model.{k}": v.detach() for k, v in model.state_dict().items()}, losses


def max_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest elementwise difference over ``want``'s entries."""
    return max((got[k] - v).abs().max().item() for k, v in want.items())
