"""``GPTModule``: the demo GPT as a LightningModule that implements Cephalo's layered protocol.

The layered protocol is three methods the Cephalo strategy looks for on a LightningModule:

* ``cephalo_layers()`` - the model as an ordered list of layers, each mapping one tensor to one
  tensor; each layer is one shard unit (gathered, run, released in turn);
* ``cephalo_input(batch)`` - the tensor fed to the first layer;
* ``cephalo_loss(output, batch)`` - the mean loss of a micro-batch from the last layer's output.

With them the strategy runs a *layer-major* schedule: every micro-batch goes through layer ``i``
before layer ``i + 1`` is gathered, so a rank accumulates gradients over many micro-batches while
holding only one layer's full parameters at a time. ``training_step`` is still a normal Lightning
step so the same module trains with any other strategy too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torchmetrics.text import Perplexity
from typing_extensions import override

from cephalo_lightning.demo.gpt import GPT, GPTConfig

Batch = tuple[Tensor, Tensor]


def no_weight_decay(name: str) -> bool:
    """Whether the parameter called ``name`` is exempt from weight decay.

    Decided by NAME, never by shape: under the Cephalo strategy the parameters that
    ``configure_optimizers`` sees are this rank's local pieces, registered under their original
    names, of shape ``(1, ..., 1, k)`` (``k`` possibly 0), so their sizes say nothing about the
    tensor they are a piece of; a name means the same under every strategy. Exempt: biases,
    LayerNorm parameters (``ln_1``, ``ln_2``, ``ln_f``, anything under a ``*norm*`` module) and
    embedding tables (``wte``, ``wpe``, anything under an ``*embed*`` module).
    """
    *owners, leaf = name.lower().split(".")
    if leaf == "bias":
        return True
    return any(o.startswith("ln") or "norm" in o or "embed" in o or o in ("wte", "wpe") for o in owners)


class GPTModule(pl.LightningModule):
    """Train :class:`~cephalo_lightning.demo.gpt.GPT` on next-token prediction.

    Args:
        preset: a :data:`~cephalo_lightning.demo.gpt.PRESETS` name giving the default shape.
        vocab_size: vocabulary size (256 for the byte-level :class:`TextDataModule`).
        seq_len: the longest sequence (block size).
        n_layer, n_head, n_embd: optional overrides of the preset's shape.
        dropout: dropout probability in embeddings, attention and MLP.
        learning_rate: peak learning rate reached after ``warmup_steps``.
        weight_decay: AdamW decoupled weight decay for matrices (see :func:`no_weight_decay`).
        warmup_steps: optimizer steps of linear warmup from 0.
        betas: AdamW betas.
        min_lr_ratio: cosine decay ends at ``min_lr_ratio * learning_rate``.
        lr_decay_steps: length of warmup + cosine decay in optimizer steps; ``None`` uses the
            trainer's ``estimated_stepping_batches`` (constant after warmup when that is unbounded).
    """

    def __init__(
        self,
        preset: str = "small",
        vocab_size: int = 256,
        seq_len: int = 64,
        n_layer: int | None = None,
        n_head: int | None = None,
        n_embd: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 10,
        betas: tuple[float, float] = (0.9, 0.95),
        min_lr_ratio: float = 0.1,
        lr_decay_steps: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = GPTConfig.preset(
            preset, vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
            dropout=dropout, bias=bias,
        )
        self.model: GPT | None = None  # built by configure_model(): on the meta device under Cephalo
        self.val_ppl = Perplexity()
        self.test_ppl = Perplexity()

    @override
    def configure_model(self) -> None:
        """Build the GPT here, not in ``__init__``: under Cephalo this runs on the meta device and every
        unit is materialised as this rank's shard alone, so no host ever holds the whole fp32 model (a
        7B shape is ~26 GB); other strategies build it on their device as usual. Outside a Trainer,
        call it once before using the module (``load_from_checkpoint`` does)."""
        if self.model is None:
            self.model = GPT(self.config)

    def cephalo_init_weights(self, module: nn.Module) -> None:
        """The GPT's own initialisation of one module built on the meta device (:meth:`GPT.init_module`)."""
        assert self.model is not None
        self.model.init_module(module)

    # ---- Cephalo layered protocol ----------------------------------------------------------------

    def cephalo_layers(self) -> Sequence[nn.Module]:
        """The shard units in order: ``[embed, *blocks, head]``; chaining them equals ``forward``."""
        return self._built().layers()

    def _built(self) -> GPT:
        if self.model is None:
            raise RuntimeError("GPTModule builds its GPT in configure_model(): call module.configure_model() first "
                               "(a Trainer and load_from_checkpoint call it)")
        return self.model

    def cephalo_input(self, batch: Batch) -> Tensor:
        """The first layer's input: the token ids ``x`` of an ``(x, y)`` (micro-)batch."""
        return batch[0]

    def cephalo_loss(self, output: Tensor, batch: Batch) -> Tensor:
        """Mean cross entropy of one micro-batch, from the last layer's logits and the targets ``y``."""
        return GPT.loss(output, batch[1])

    # ---- plain Lightning -------------------------------------------------------------------------

    @override
    def forward(self, idx: Tensor) -> Tensor:
        """Token ids ``(B, T)`` -> logits ``(B, T, vocab_size)``."""
        return self._built()(idx)

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        x, y = batch
        loss = GPT.loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True, batch_size=x.size(0))
        return loss

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_ppl)

    @override
    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_ppl)

    @override
    def predict_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        """Per window of an ``(x, y)`` batch: its mean next-token loss (``nll``, nats per token; the
        window's perplexity is ``exp(nll)``) and the model's greedy next byte after it (``next_token``)."""
        x, y = batch
        logits = self(x).float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)
        return {"nll": nll, "next_token": logits[:, -1].argmax(dim=-1)}

    def _evaluate(self, batch: Batch, stage: str, perplexity: Perplexity) -> None:
        x, y = batch
        logits = self(x)
        loss = GPT.loss(logits, y)
        # the metric accumulates summed NLL and token counts, so the epoch value is exact perplexity
        perplexity.update(logits.float(), y)
        self.log(f"{stage}_loss", loss, prog_bar=True, sync_dist=True, batch_size=x.size(0))
        self.log(f"{stage}_ppl", perplexity, prog_bar=True, sync_dist=True, batch_size=x.size(0))

    # ---- optimisation ----------------------------------------------------------------------------

    def parameter_groups(self) -> list[dict[str, Any]]:
        """Two AdamW groups, decay and no-decay, chosen by parameter name (see :func:`no_weight_decay`).

        Both groups are always returned, even when empty, so that every rank's optimizer has the
        same group structure whatever shards (possibly 0-element ones) it holds.
        """
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for name, p in self.named_parameters():
            if p.requires_grad:
                (no_decay if no_weight_decay(name) else decay).append(p)
        return [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW with linear warmup then cosine decay, stepped every optimizer step.

        The parameters seen here may be Cephalo's local pieces, of shape ``(1, ..., 1, k)`` (some with
        ``k = 0``): the grouping is by name and AdamW handles empty tensors, so the same code serves
        every strategy.
        """
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.parameter_groups(), lr=hp.learning_rate, betas=tuple(hp.betas))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_lambda(self._total_steps()))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _total_steps(self) -> int | None:
        if self.hparams.lr_decay_steps is not None:
            return int(self.hparams.lr_decay_steps)
        try:
            steps = self.trainer.estimated_stepping_batches
        except (RuntimeError, AttributeError):  # not attached to a trainer, or no dataloader yet
            return None
        return int(steps) if math.isfinite(steps) else None

    def _lr_lambda(self, total_steps: int | None) -> Callable[[int], float]:
        warmup = max(0, int(self.hparams.warmup_steps))
        floor = float(self.hparams.min_lr_ratio)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            if total_steps is None or total_steps <= warmup:
                return 1.0
            progress = min(1.0, (step - warmup) / (total_steps - warmup))
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

        return factor

    def num_parameters(self) -> int:
        """Parameters of the full (unsharded) model, computed from the config."""
        return self.config.num_parameters()
