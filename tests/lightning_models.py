"""Tiny LightningModules for strategy tests: one with the layered protocol, one without."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.reference import make_optimizer
from tests.tiny_lm import TinyLM


class TinyUniform(pl.LightningModule):
    """A plain LightningModule: the strategy has to use its training_step (uniform mode)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyLM(seed=seed)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.model.loss(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=x.size(0))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", self.model.loss(self(x), y), sync_dist=True, batch_size=x.size(0))

    def configure_optimizers(self):
        return make_optimizer(self.parameters())


class TinyLayered(TinyUniform):
    """The same model with the layered protocol."""

    def cephalo_layers(self):
        m = self.model
        return [m.embed, *m.blocks, m.norm, m.head]

    def cephalo_input(self, batch):
        return batch[0]

    def cephalo_loss(self, output, batch):
        return self.model.loss(output, batch[1])


def token_data(num_samples: int, seq: int = 5, vocab: int = 17, seed: int = 1) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (num_samples, seq + 1), generator=gen)
    return TensorDataset(data[:, :-1], data[:, 1:])


def loader(dataset: TensorDataset, batch_size: int, shuffle: bool = False) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle)
