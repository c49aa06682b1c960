"""torch.compile per block: compiled vs uncompiled step time under the Cephalo strategy, both modes.

A tiny Llama (built from a config, no download) with peft LoRA adapters, 2 gloo ranks, a plan with
different batches and micro-batch counts; the uncompiled and the compiled run (every decoder block
compiled in place in ``configure_model()``: ``block.compile()``, inductor) train the same steps.
Printed per mode: the median step time after the warm-up steps (the first steps hold the
compilation), their ratio, the compilation's own cost (the first steps' excess) and how far the
compiled run's adapters land from the uncompiled ones (inductor's fused kernels round otherwise).

    python -m benchmarks.bench_compile [--steps 8] [--warmup 3] [--backend inductor]
    python -m benchmarks.bench_compile --quick   # 5 steps, 2 of them warm-up

CPU figures (gloo ranks on one machine); a GPU's gain differs (fused kernels matter more there).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks import _common as common
from benchmarks.harness import Benchmark

GLOBAL = 12
SEQ = 32


class Tokens(Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(1, 512, (n, SEQ), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": self.ids[i]}


def tiny_llama() -> torch.nn.Module:
    """A Llama of 4 layers of width 256, from a config (no download)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config)


class Lora(pl.LightningModule):
    def __init__(self, backend: str | None) -> None:
        super().__init__()
        self.backend = backend

    def configure_model(self) -> None:
        from peft import LoraConfig, get_peft_model

        if hasattr(self, "model"):
            return
        self.model = get_peft_model(tiny_llama(), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
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


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, help="steps per fit (default 8; --quick 5)")
    parser.add_argument("--warmup", type=int, help="steps left out of the median (compilation; default 3, --quick 2)")
    parser.add_argument("--backend", default="inductor")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    steps = args.steps or (5 if args.quick else 8)
    warmup = args.warmup or (2 if args.quick else 3)
    before = common.load_average()
    results = common.run_ranks(_rank, 2, steps, args.backend)
    load = common.load_span(before)
    rows = []
    for mode in ("layered", "uniform"):
        got = {name: results[0][mode, name] for name in ("uncompiled", "compiled")}
        steady = {name: statistics.median(g["times"][warmup:]) for name, g in got.items()}
        compile_s = sum(got["compiled"]["times"][:warmup]) - warmup * steady["compiled"]
        drift = max((got["compiled"]["adapters"][k] - v).abs().max().item()
                    for k, v in got["uncompiled"]["adapters"].items())
        rows.append({"mode": mode, "uncompiled_s": steady["uncompiled"], "compiled_s": steady["compiled"],
                     "compile_s": compile_s, "max_adapter_diff": drift})
    return {"backend": args.backend, "steps": steps, "warmup": warmup, "rows": rows, "load": load}


def print_report(result: dict[str, Any]) -> None:
    common.print_table(["mode", "uncompiled ms/step", "compiled ms/step", "speed-up", "compile s (first steps)",
                        "max |adapter diff|"],
                       [[r["mode"], f"{1e3 * r['uncompiled_s']:.1f}", f"{1e3 * r['compiled_s']:.1f}",
                         f"{r['uncompiled_s'] / r['compiled_s']:.2f}x", f"{r['compile_s']:.1f}",
                         f"{r['max_adapter_diff']:.1e}"] for r in result["rows"]],
                       title=f"torch.compile per block ({result['backend']}), LoRA Llama 4x256, 2 ranks, "
                             f"median of steps {result['warmup'] + 1}..{result['steps']} (CPU, gloo)")
    print(common.environment_note())
    print(common.load_note(*result["load"]))


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
