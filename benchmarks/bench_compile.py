"""torch.compile per block: compiled vs uncompiled step time under the Cephalo strategy, both modes.

A tiny Llama (built from a config, no download) with peft LoRA adapters, 2 gloo ranks, a plan with
different batches and micro-batch counts; the uncompiled and the compiled run (every decoder block
compiled in place in ``configure_model()``: ``block.compile()``, inductor) train the same steps.
Printed per mode: the median step time after the warm-up steps (the first steps hold the
compilation), their ratio, the compilation's own cost (the first steps' excess) and how far the
compiled run's adapters land from the uncompiled ones (inductor's fused kernels round otherwise).

    python benchmarks/bench_compile.py [--steps 8] [--warmup 3] [--backend inductor]

CPU figures (gloo ranks on one machine); a GPU's gain differs (fused kernels matter more there).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import _common as common  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

GLOBAL = 12
SEQ = 32


class Tokens(Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(1, 512, (n, SEQ), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": self.ids[i]}


class Lora(pl.LightningModule):
    def __init__(self, backend: str | None) -> None:
        super().__init__()
        self.backend = backend

    def configure_model(self) -> None:
        import transformers
        from peft import LoraConfig, get_peft_model

        if hasattr(self, "model"):
            return
        config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
        self.model = get_peft_model(transformers.LlamaForCausalLM(config),
                                    LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
        if self.backend is not None:
            for block in self.model.base_model.model.model.layers:
                block.compile(backend=self.backend)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


class StepTimes(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._t0)


def _rank(rank: int, world: int, steps: int, backend: str) -> dict:
    from cephalo_lightning import CephaloStrategy, Plan
    from cephalo_lightning.planner import RankPlan

    warnings.simplefilter("ignore")
    common.quiet_lightning()
    plans = {"layered": Plan(GLOBAL, "layered", (RankPlan(0, "a", 8, 2, 4, 0.6), RankPlan(1, "b", 4, 1, 4, 0.4))),
             "uniform": Plan(GLOBAL, "uniform", (RankPlan(0, "a", 8, 2, 4, 0.6), RankPlan(1, "b", 4, 2, 2, 0.4)))}
    out = {}
    for mode, plan in plans.items():
        for name, chosen in (("uncompiled", None), ("compiled", backend)):
            torch.manual_seed(0)
            timer = StepTimes()
            trainer = pl.Trainer(strategy=CephaloStrategy(plan=plan, mode=mode), accelerator="cpu", devices=world,
                                 max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, use_distributed_sampler=False, callbacks=[timer])
            module = Lora(chosen)
            trainer.fit(module, DataLoader(Tokens(GLOBAL * steps), batch_size=GLOBAL))
            adapters = {k: v.clone() for k, v in module.state_dict().items() if "lora_" in k}
            out[mode, name] = {"times": timer.times, "adapters": adapters}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median (compilation)")
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    before = common.load_average()
    results = common.run_ranks(_rank, 2, args.steps, args.backend)
    after = common.load_average()
    rows = []
    for mode in ("layered", "uniform"):
        got = {name: results[0][mode, name] for name in ("uncompiled", "compiled")}
        steady = {name: statistics.median(g["times"][args.warmup:]) for name, g in got.items()}
        compile_s = sum(got["compiled"]["times"][:args.warmup]) - args.warmup * steady["compiled"]
        drift = max((got["compiled"]["adapters"][k] - v).abs().max().item()
                    for k, v in got["uncompiled"]["adapters"].items())
        rows.append([mode, f"{1e3 * steady['uncompiled']:.1f}", f"{1e3 * steady['compiled']:.1f}",
                     f"{steady['uncompiled'] / steady['compiled']:.2f}x", f"{compile_s:.1f}", f"{drift:.1e}"])
    common.print_table(["mode", "uncompiled ms/step", "compiled ms/step", "speed-up", "compile s (first steps)",
                        "max |adapter diff|"], rows,
                       title=f"torch.compile per block ({args.backend}), LoRA Llama 4x256, 2 ranks, "
                             f"median of steps {args.warmup + 1}..{args.steps} (CPU, gloo)")
    print(common.environment_note())
    print(common.load_note(before, after))


if __name__ == "__main__":
    main()
