"""What many test files share: a quiet CPU ``Trainer``, a fit on a dataset in a plan's global batches,
the single-process AdamW reference those fits are compared with, and the largest elementwise difference."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from cephalo_lightning import CephaloStrategy, Plan
from tests.lightning_models import loader, token_data
from tests.reference import make_optimizer, sliced, tiny_loss, train_steps
from tests.tiny_lm import TinyLM

NUM_SAMPLES = 48
QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False,
         "use_distributed_sampler": False}


def trainer(strategy: CephaloStrategy, world: int, steps: int, **kwargs) -> pl.Trainer:
    """A CPU ``Trainer`` with no logger, progress bar, summary or checkpointing unless ``kwargs`` ask
    (:data:`QUIET`); ``use_distributed_sampler=False`` keeps the DataLoader's own order."""
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=steps, **{**QUIET, **kwargs})


def fit(module: pl.LightningModule, plan: Plan, world: int, steps: int = 2, data=None, options: dict | None = None,
        ckpt_path: str | None = None, **strategy) -> pl.Trainer:
    """``steps`` optimizer steps of ``module`` under ``plan`` on ``data`` (a dataset, default: 48 token
    samples) taken in order in the plan's global batches, from ``ckpt_path`` if given; ``options``:
    the ``Trainer``'s beside :data:`QUIET`; ``strategy``: the ``CephaloStrategy``'s."""
    t = trainer(CephaloStrategy(plan=plan, **strategy), world, steps, **(options or {}))
    t.fit(module, loader(data if data is not None else token_data(NUM_SAMPLES), plan.global_batch_size),
          ckpt_path=ckpt_path)
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
