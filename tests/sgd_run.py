"""The fp64 SGD run the checkpoint, resume, preemption and elastic tests train and compare with:
TinyLayered under SGD on :data:`SAMPLES` token samples in global batches of :data:`GLOBAL` (its
``Trainer``: :func:`sgd_trainer`; the uninterrupted run: :data:`PLAN2` for :data:`TOTAL` steps), and its
single-process reference on the sampler's documented order (``randperm(N, seed + epoch)`` per epoch).

[Note: fp64 SGD] a resume on the wrong samples is off by ~1e-2, summation-order noise by ~1e-15, so
1e-7 separates the two cleanly (in fp32 the noise alone is ~1e-7)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from cephalo_lightning import CephaloStrategy, Plan
from tests import helpers
from tests.lightning_models import TinyLayered, token_data
from tests.plans import plan_of
from tests.reference import tiny_loss, train_steps, whole

SAMPLES, GLOBAL = 60, 12  # 5 steps per epoch
SEED = 11
PLAN2 = plan_of(batches=[8, 4], micro=[2, 1], shares=[0.3, 0.7])
TOTAL = 8  # steps of every uninterrupted run: across an epoch boundary


class SGDModule(TinyLayered):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def sgd_trainer(plan: Plan, world: int, steps: int, root: str | None = None, strategy: dict | None = None,
                **kwargs) -> pl.Trainer:
    """A quiet fp64 ``Trainer`` (:data:`tests.helpers.QUIET`) under ``plan`` with the run's seed and the
    ``strategy`` options; ``kwargs``: the Trainer's."""
    return helpers.trainer(CephaloStrategy(plan=plan, seed=SEED, **(strategy or {})), world, steps,
                           **{"precision": "64-true", "default_root_dir": root, **kwargs})


def data_loader(shuffle: bool) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(token_data(SAMPLES), batch_size=GLOBAL, shuffle=shuffle)


def sgd_on(indices: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Single-process fp64 SGD from SGDModule's initialisation, one step per global batch of these sample indices."""
    data = token_data(SAMPLES)
    module = SGDModule().double()
    train_steps(module.configure_optimizers(), tiny_loss(module.model), whole(data[at] for at in indices))
    return {f"model.{k}": v.detach().clone() for k, v in module.model.state_dict().items()}


def reference(steps: int, shuffle: bool) -> dict[str, torch.Tensor]:
    """Single-process SGD on the sampler's documented order: randperm(N, seed + epoch) per epoch."""
    per_epoch = SAMPLES // GLOBAL
    indices = []
    for step in range(steps):
        epoch, at = divmod(step, per_epoch)
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch)) if shuffle else torch.arange(SAMPLES)
        indices.append(order[at * GLOBAL : (at + 1) * GLOBAL])
    return sgd_on(indices)
