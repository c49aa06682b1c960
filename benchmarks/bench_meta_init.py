"""Meta-device init: peak host memory per rank while a big model is built and sharded.

    python -m benchmarks.bench_meta_init           # a 220M-parameter Llama shape on 2 gloo ranks
    python -m benchmarks.bench_meta_init --quick   # a 40M-parameter one

A LightningModule builds a Hugging Face ``LlamaForCausalLM`` from a config in ``configure_model()``,
which the strategy runs on the meta device; ``setup()`` then materialises one unit at a time and
keeps only the rank's shard. Shares are [0.1, 0.9]. For each rank the script MEASURES the peak
resident set size (``VmHWM`` after resetting it) from just before the Trainer builds the model to
the end of setup, beside the bound ``its share of the state (fp32 master) + 2 units`` and the
full model's size. (CPU processes: the "device" is the host, so the shard is host memory too.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.harness import Benchmark

MIB = 2**20


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS


def _rank(rank: int, world: int, shape: dict) -> dict:
    import warnings

    import lightning.pytorch as pl
    import torch
    import transformers

    from cephalo_lightning import CephaloStrategy, Plan
    from cephalo_lightning.planner import RankPlan

    warnings.simplefilter("ignore")
    config = transformers.LlamaConfig(tie_word_embeddings=False, **shape)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = transformers.LlamaForCausalLM(config)

        def training_step(self, batch, batch_idx):  # never called: max_steps=0
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    shares = [0.1, 0.9]
    plan = Plan(2, "layered", tuple(RankPlan(r, "cpu", 1, 1, 1, s) for r, s in enumerate(shares)))
    data = torch.utils.data.DataLoader([{"input_ids": torch.zeros(8, dtype=torch.long),
                                         "labels": torch.zeros(8, dtype=torch.long)}] * 4, batch_size=2)
    trainer = pl.Trainer(strategy=CephaloStrategy(plan=plan), accelerator="cpu", devices=world, max_steps=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    import gc

    gc.collect()
    baseline = _status("VmRSS")
    _reset_peak()
    trainer.fit(Module(), data)
    peak = _status("VmHWM")
    sharded = trainer.strategy.sharded
    units = sorted((u.numel for u in sharded.layout.units), reverse=True)
    total = sharded.layout.total_numel
    return {"rank": rank, "share": shares[rank], "baseline_mib": baseline / MIB, "peak_mib": peak / MIB,
            "grew_mib": (peak - baseline) / MIB, "shard_mib": sharded.local_state_numel() * 4 / MIB,
            "two_units_mib": sum(units[:2]) * 4 / MIB, "model_mib": total * 4 / MIB, "parameters": total,
            "materialised_units": sharded.materialized_units}


def run_benchmark(quick: bool = False) -> list[dict]:
    from cephalo_lightning.testing.local_ranks import run_local_ranks

    shape = (dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=32000) if quick else
             dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                  num_key_value_heads=16, vocab_size=32000))
    return run_local_ranks(_rank, 2, shape)


def print_report(rows: list[dict]) -> None:
    print(f"Meta-device init, {rows[0]['parameters'] / 1e6:.0f}M parameters ({rows[0]['model_mib']:.0f} MiB in fp32), "
          "2 gloo ranks, shares [0.1, 0.9] (MEASURED peak RSS, CPU processes)")
    print(f"{'rank':>4} {'share':>6} {'grew MiB':>9} {'bound MiB':>10} {'= shard':>8} {'+ 2 units':>10} "
          f"{'full model':>11} {'ratio':>6}")
    for r in rows:
        bound = r["shard_mib"] + r["two_units_mib"]
        print(f"{r['rank']:>4} {r['share']:>6.1f} {r['grew_mib']:>9.0f} {bound:>10.0f} {r['shard_mib']:>8.0f} "
              f"{r['two_units_mib']:>10.0f} {r['model_mib']:>11.0f} {r['grew_mib'] / bound:>6.2f}")
    verdict = all(r["grew_mib"] <= r["shard_mib"] + r["two_units_mib"] for r in rows)
    print(f"goal: peak growth <= share + 2 units on every rank: {'met' if verdict else 'NOT met'}")


def measure(args: argparse.Namespace) -> list[dict]:
    """``--quick``: a 40M-parameter shape."""
    return run_benchmark(args.quick)


BENCHMARK = Benchmark(__doc__, measure, print_report)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
