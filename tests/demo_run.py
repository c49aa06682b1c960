"""The fp64 demo-GPT run the callback tests train on an emulated two-rank cluster, and its reference:

    for each step s:  θ <- AdamW(θ, ∇ loss(batch_s)),  lr <- scheduler(s)

on the demo's text in global batches of :data:`GLOBAL_BATCH`, taken in the sampler's documented order
(one ``randperm(N, seed 0)``). fp64 on both sides: Adam's first steps are sign-like and would turn fp32
roundoff in (near-)zero gradients into lr-sized differences between any two summation orders."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from cephalo_lightning import CephaloStrategy
from tests.helpers import trainer
from tests.reference import train_steps, whole

SEQ = 32
GLOBAL_BATCH = 16
# rank 0: fast with little memory; rank 1: twice as slow with plenty of memory (all emulated)
EMULATE = [{"slowdown": 1.0, "memory_gb": 0.018}, {"slowdown": 2.0, "memory_gb": 0.5}]  # fp64 sizes


def module(steps: int) -> pl.LightningModule:
    from cephalo_lightning.demo import GPTModule

    built = GPTModule(preset="small", seq_len=SEQ, warmup_steps=2, lr_decay_steps=steps)
    built.configure_model()  # now, from the seed: the single-process reference starts from the same weights
    return built


def datamodule(steps: int) -> pl.LightningDataModule:
    from cephalo_lightning.demo import TextDataModule

    return TextDataModule(seq_len=SEQ, batch_size=GLOBAL_BATCH, max_train_samples=GLOBAL_BATCH * steps)


def emulated_trainer(world: int, steps: int, root: str, callbacks: list, emulate: list[dict] = EMULATE,
                     **options) -> pl.Trainer:
    """An fp64 ``Trainer`` on the emulated cluster (``emulate``), the strategy planning it; no validation."""
    return trainer(CephaloStrategy(emulate=emulate), world, steps, callbacks=callbacks, limit_val_batches=0,
                   default_root_dir=root, precision="64-true", **options)


def reference_params(steps: int) -> dict[str, torch.Tensor]:
    """Single process on the same global batches: the sampler's documented order (seeded permutation)."""
    pl.seed_everything(0)
    model = module(steps).double()
    data = datamodule(steps)
    data.setup("fit")
    dataset = data.train_dataset
    optimizer_config = model.configure_optimizers()
    optimizer, scheduler = optimizer_config["optimizer"], optimizer_config["lr_scheduler"]["scheduler"]
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))
    batches = []
    for step in range(steps):
        idx = order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        batches.append((torch.stack([dataset[int(i)][0] for i in idx]), torch.stack([dataset[int(i)][1] for i in idx])))
    # token ids: no dtype change needed
    train_steps(optimizer, lambda xy: model.model.loss(model(xy[0]), xy[1]), whole(batches), after_step=scheduler.step)
    return {k: v.detach() for k, v in model.state_dict().items()}
