"""Bring your own model: a Hugging Face-style transformer under Cephalo, two ways.

The model below is written from scratch in the layout Hugging Face GPT-2 uses
(``transformer.wte / wpe / h[i] / ln_f`` and ``lm_head``, blocks with ``forward(hidden_states)``);
nothing is downloaded and ``transformers`` is not imported. It trains on the byte-level Python help
corpus (``TextDataModule``) on an emulated heterogeneous pair of CPU ranks, in two ways:

(a) ``uniform``: the LightningModule is plain Lightning (``training_step`` calls the model). The
    strategy wraps every ``MyBlock`` as a shard unit (``CephaloStrategy(units=[MyBlock])``, the
    FSDP-style wrap policy); everything else (embeddings, final norm, head) forms the root unit.
    Ranks get different batch sizes and state shares, but every rank must run the SAME number of
    micro-batches (the plan is made with ``mode="uniform"``).

(b) ``layered``: the LightningModule also implements the layered protocol (``cephalo_layers``,
    ``cephalo_input``, ``cephalo_loss``). The strategy then runs Cephalo's layer-major gradient
    accumulation, so every rank may have its own micro-batch count: a fast GPU with little memory
    takes many small micro-batches. The protocol needs the model as a chain of layers that each map
    ONE tensor to ONE tensor, so the embedding (token ids -> hidden states, two tables) and the head
    (hidden states -> logits) get small adapter layers.

What Cephalo needs from an HF-style model:

* tied weights are fine: GPT-2 ties ``lm_head.weight`` to ``wte.weight``, and a parameter held by
  modules of two units goes to the root unit (gathered for the whole step, one gradient, reduced
  once). ``MyCausalLM`` has a head matrix of its own only so that (a) and (b) have the same
  parameters by the same names; tying it (``self.lm_head.weight = self.transformer.wte.weight``)
  is supported (models with tied embeddings train in ``tests/models/test_discovery.py``);
* in (b), every module registered once: the adapters take the embedding and head modules over
  (same weights, new names, see ``LayeredLM``) rather than keeping the original tree beside them;
* in (b), no parameters in ``cephalo_input``: nothing flows back past the first layer's input, so
  they would get no gradient. This one is NOT checked: keep such parameters in a layer.

Run (CPU, emulated; about 35 s for both variants at the default 20 steps)::

    python examples/bring_your_own_model.py                   # both variants, one after the other
    python examples/bring_your_own_model.py --variant layered --steps 50
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cephalo_lightning import CephaloCallback, CephaloStrategy
from cephalo_lightning.demo import TextDataModule

Batch = tuple[Tensor, Tensor]  # (input ids, next-token targets), both (batch, seq)

# An emulated heterogeneous pair (see configs/quickstart.yaml): fast with little memory, 3x slower
# with plenty. Every figure these runs print is emulated on CPU.
EMULATE = [{"slowdown": 1.0, "memory_gb": 0.03}, {"slowdown": 3.0, "memory_gb": 0.5}]


# ---------------------------------------------------------------------------------------------
# "Your" model: Hugging Face GPT-2 layout, written out in plain torch


@dataclass(frozen=True)
class MyConfig:
    vocab_size: int = 256  # byte-level: TextDataModule's vocabulary
    n_positions: int = 64
    n_embd: int = 96
    n_layer: int = 4
    n_head: int = 4


class MyAttention(nn.Module):
    """Causal self-attention with GPT-2's fused ``c_attn`` projection."""

    def __init__(self, config: MyConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, hidden_states: Tensor) -> Tensor:
        b, t, c = hidden_states.shape
        q, k, v = self.c_attn(hidden_states).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(b, t, c))


class MyMLP(nn.Module):
    def __init__(self, config: MyConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(hidden_states), approximate="tanh"))


class MyBlock(nn.Module):
    """A pre-norm transformer block: ``hidden_states -> hidden_states`` (one tensor in, one out).

    Hugging Face blocks usually return a tuple ``(hidden_states, present, ...)``; for the layered
    protocol wrap such a block in a one-line module returning ``block(x)[0]``.
    """

    def __init__(self, config: MyConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = MyAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MyMLP(config)

    def forward(self, hidden_states: Tensor) -> Tensor:
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states))
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class MyCausalLM(nn.Module):
    """GPT-2's module tree, with a head matrix of its own (tying it to ``wte`` is supported too)."""

    def __init__(self, config: MyConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.n_positions, config.n_embd),
            h=nn.ModuleList(MyBlock(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden_states = self.transformer.wte(input_ids) + self.transformer.wpe(positions)
        for block in self.transformer.h:
            hidden_states = block(hidden_states)
        return self.lm_head(self.transformer.ln_f(hidden_states))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross entropy (the mean over a micro-batch: the strategy weights it)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ---------------------------------------------------------------------------------------------
# (a) plain Lightning: uniform mode, MyBlock as the wrap policy


class _LanguageModelSteps(pl.LightningModule):
    """Training, validation and optimizer shared by both wrappers (plain Lightning code)."""

    def __init__(self, config: MyConfig, learning_rate: float) -> None:
        super().__init__()
        self.config = config
        self.learning_rate = learning_rate
        # what CephaloCallback profiles when the module has no layered protocol (uniform mode)
        self.example_input_array = torch.zeros(1, config.n_positions, dtype=torch.long)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        # Uniform mode: called once per micro-batch, so this logs the rank's own micro-batch loss
        # (ranks have different batch sizes). Layered mode: not called at all; the strategy logs
        # the global mean as train_loss.
        x, y = batch
        loss = lm_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True, batch_size=x.shape[0])
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", lm_loss(self(x), y), prog_bar=True, sync_dist=True, batch_size=x.shape[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Under Cephalo self.parameters() are this rank's flat 1-D shards (some may be empty): build
        # the optimizer from them as usual, but never choose weight decay by p.dim() (use names).
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate, weight_decay=0.0)


class PlainLM(_LanguageModelSteps):
    """(a) The HF-style model as-is, trained in the uniform mode (asked for: auto would layer it by its blocks)."""

    def __init__(self, config: MyConfig = MyConfig(), learning_rate: float = 3e-3) -> None:
        super().__init__(config, learning_rate)
        self.model = MyCausalLM(config)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids)


# ---------------------------------------------------------------------------------------------
# (b) the layered protocol: adapters for the embedding and the head


class EmbeddingLayer(nn.Module):
    """Token ids -> hidden states: the model's ``wte`` and ``wpe`` tables as ONE layer."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.wte(input_ids) + self.wpe(positions)


class HeadLayer(nn.Module):
    """Hidden states -> logits: the final norm and the LM head as ONE layer."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(hidden_states))


class LayeredLM(_LanguageModelSteps):
    """(b) The same model as a chain of layers: ``[embedding, *blocks, head]``.

    The model is built as usual and taken apart: the adapters OWN the embedding and head modules
    and ``blocks`` is the model's own ``transformer.h``, so every parameter has exactly one name
    (keeping ``self.model`` as well would register every block twice). The weights are the model's; only the state-dict names move:
    ``transformer.wte/wpe`` -> ``embed.wte/wpe``, ``transformer.h`` -> ``blocks``,
    ``transformer.ln_f`` and ``lm_head`` -> ``head.ln_f`` and ``head.lm_head``.
    """

    def __init__(self, config: MyConfig = MyConfig(), learning_rate: float = 3e-3) -> None:
        super().__init__(config, learning_rate)
        model = MyCausalLM(config)
        self.embed = EmbeddingLayer(model.transformer.wte, model.transformer.wpe)
        self.blocks = model.transformer.h
        self.head = HeadLayer(model.transformer.ln_f, model.lm_head)

    # ---- the layered protocol: what the strategy calls instead of training_step

    def cephalo_layers(self) -> Sequence[nn.Module]:
        """The shard units in execution order; chaining them is :meth:`forward`."""
        return [self.embed, *self.blocks, self.head]

    def cephalo_input(self, batch: Batch) -> Tensor:
        """The first layer's input. No gradient flows back into it: use no parameters here."""
        return batch[0]

    def cephalo_loss(self, output: Tensor, batch: Batch) -> Tensor:
        """A micro-batch's mean loss from the last layer's output (the logits)."""
        return lm_loss(output, batch[1])

    def forward(self, input_ids: Tensor) -> Tensor:  # validation, and any non-Cephalo strategy
        x = input_ids
        for layer in self.cephalo_layers():
            x = layer(x)
        return x


# ---------------------------------------------------------------------------------------------
# training


def train(variant: str, steps: int, devices: int, out: Path) -> dict[str, float]:
    """Fit one variant on the emulated pair; returns the final metrics (on rank 0, else {})."""
    pl.seed_everything(0, workers=True)
    config = MyConfig()
    if variant == "uniform":
        module: pl.LightningModule = PlainLM(config)
        # the wrap policy: classes (or import paths, in a config file) whose instances become units
        # mode="uniform": with "auto" the strategy would discover the blocks and run layered itself
        strategy = CephaloStrategy(mode="uniform", units=[MyBlock], emulate=EMULATE[:devices])
    else:
        module = LayeredLM(config)
        strategy = CephaloStrategy(mode="layered", emulate=EMULATE[:devices])  # mode="auto" would find it too
    watcher = CephaloCallback(max_micro_batch=4, cache_dir=out / variant / "profiles",
                              settings={"usable_memory_fraction": 0.9}, watch_every_n_steps=0)
    trainer = pl.Trainer(
        strategy=strategy, callbacks=[watcher], accelerator="cpu", devices=devices, max_steps=steps,
        check_val_every_n_epoch=None, val_check_interval=steps, limit_val_batches=2,  # validate at the end
        logger=False, enable_checkpointing=False, enable_model_summary=False, default_root_dir=out / variant,
        log_every_n_steps=max(1, min(10, steps)),
    )
    data = TextDataModule(seq_len=config.n_positions, batch_size=16)
    trainer.fit(module, data)
    if not trainer.is_global_zero:
        return {}
    logged = trainer.callback_metrics
    train_key = "train_loss_step" if "train_loss_step" in logged else "train_loss"  # the last step's loss
    metrics = {k: float(logged[k]) for k in (train_key, "val_loss") if k in logged}
    print(f"[{variant}] after {trainer.global_step} steps: "
          + ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
          + f" (an untrained byte model scores about ln(256) = {math.log(256):.2f})")
    return metrics


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=("uniform", "layered", "both"), default="both")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per variant (default: 20)")
    parser.add_argument("--devices", type=int, default=2, choices=(1, 2), help="emulated CPU ranks (default: 2)")
    parser.add_argument("--out", type=Path, default=Path("runs/bring_your_own_model"))
    args = parser.parse_args(argv)
    # Every rank runs this whole script (Lightning relaunches it per rank), so both variants run
    # in the same order everywhere; the second fit reuses the ranks the first one started.
    results = {variant: train(variant, args.steps, args.devices, args.out)
               for variant in (("uniform", "layered") if args.variant == "both" else (args.variant,))}
    val = [r["val_loss"] for r in results.values() if "val_loss" in r]
    if len(val) == 2:  # rank 0 only (the other ranks return no metrics)
        # Both modes compute the gradient of the mean loss over the same global batches, whatever
        # each rank's slice and micro-batches: the two runs train the same weights (up to rounding).
        print(f"val_loss uniform {val[0]:.4f} vs layered {val[1]:.4f}: difference {abs(val[0] - val[1]):.1e}")


if __name__ == "__main__":
    main()
