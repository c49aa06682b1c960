"""Peak memory under skewed state shares: the planner's prediction vs the emulated run, full and LoRA.

A tiny Llama (``bench_compile``'s, built from a config, no download), fully trainable or with peft
LoRA adapters on a frozen base, on 2 gloo ranks with accounted (emulated) memory. One 1-step fit with
``CephaloCallback`` profiles the ranks and gives the planner's cluster; then each plan below is pinned
(``CephaloStrategy(plan=...)``) and trained a few steps while the callback records every rank's peak.
The prediction is :func:`~cephalo_lightning.planner.cost.cluster_cost.evaluate` of the same plan on that
cluster. Printed per rank: the batch and state share, predicted and measured peak, and ``UNDER`` where
the prediction is below the measurement (a plan that fits on paper and not on the card).

    python -m benchmarks.bench_memory_shares                 # 5 layered plans per model, 3 steps each
    python -m benchmarks.bench_memory_shares --quick         # 3 plans per model, 2 steps each
    python -m benchmarks.bench_memory_shares --mode uniform  # uniform plans, 2 micro-batches per rank

THE MEMORY IS EMULATED: CPU ranks whose tensor storages are counted by the runtime's tracker (see
docs/emulation.md), not a GPU allocator. The plans are skewed on purpose: the planner gives a slow
rank no samples and most of the state when its collectives alone fill the step, and the uneven
reduce-scatter's buffers grow with a rank's share of each unit.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

from benchmarks import _common as common
from benchmarks.harness import Benchmark

GLOBAL = 12
MEMORY_GB = 1.0  # emulated capacity: large enough that no plan here runs out, so every peak is seen
# (batch of rank 0, batch of rank 1, state share of rank 0): layered, one micro-batch each; uniform
# (every rank has samples), two micro-batches each
PLANS = {"layered": ((6, 6, 0.5), (6, 6, 0.1), (12, 0, 0.003), (0, 12, 0.997), (12, 0, 0.5)),
         "uniform": ((6, 6, 0.5), (6, 6, 0.1), (10, 2, 0.003), (2, 10, 0.997), (10, 2, 0.5))}
MICRO_BATCHES = {"layered": 1, "uniform": 2}


def _modules() -> dict[str, Any]:
    import torch

    from benchmarks.bench_compile import Lora, tiny_llama

    class Full(Lora):
        """The same Llama without adapters, every parameter trained."""

        def configure_model(self) -> None:
            if not hasattr(self, "model"):
                self.model = tiny_llama()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return {"full": Full, "lora": Lora}


def _rank(rank: int, world: int, steps: int, mode: str, plans: tuple[tuple[int, int, float], ...]) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from benchmarks.bench_compile import Tokens
    from cephalo_lightning import CephaloCallback, CephaloStrategy, Plan
    from cephalo_lightning.planner import RankPlan

    warnings.simplefilter("ignore")
    common.quiet_lightning()
    emulate = [{"slowdown": 1, "memory_gb": MEMORY_GB}, {"slowdown": 2, "memory_gb": MEMORY_GB}]

    def fit(module_class: Any, plan: Any, fit_steps: int) -> Any:
        watcher = CephaloCallback(max_micro_batch=3, cache_dir=None, watch_every_n_steps=1, print_plan=False,
                                  quiet=True, calibrate_after_windows=0, adapt=False)
        trainer = pl.Trainer(strategy=CephaloStrategy(emulate=emulate, plan=plan), accelerator="cpu", devices=world,
                             max_steps=fit_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, use_distributed_sampler=False, callbacks=[watcher])
        torch.manual_seed(0)
        trainer.fit(module_class(None), DataLoader(Tokens(GLOBAL * fit_steps), batch_size=GLOBAL))
        return watcher

    n = MICRO_BATCHES[mode]
    out: dict[str, Any] = {}
    for name, module_class in _modules().items():
        cluster = fit(module_class, None, 1).cluster
        runs = []
        for b0, b1, r0 in plans:
            plan = Plan(GLOBAL, mode, (RankPlan(0, "cpu", b0, n, b0 // n, r0), RankPlan(1, "cpu", b1, n, b1 // n, 1 - r0)))
            history = fit(module_class, plan, steps).history
            runs.append({"plan": (b0, b1, r0),
                         "measured_gb": [max(w["ranks"][i]["peak_memory_gb"] for w in history) for i in range(world)]})
        out[name] = {"cluster": cluster, "runs": runs}
    return out


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, help="steps per pinned plan (default 3; --quick 2)")
    parser.add_argument("--mode", choices=tuple(PLANS), default="layered", help="the pinned plans' schedule")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from cephalo_lightning.planner.cost.cluster_cost import evaluate

    steps = args.steps or (2 if args.quick else 3)
    plans = PLANS[args.mode][:3] if args.quick else PLANS[args.mode]
    n = MICRO_BATCHES[args.mode]
    result = common.run_ranks(_rank, 2, steps, args.mode, plans)[0]
    rows = []
    for model, got in result.items():
        for run in got["runs"]:
            b0, b1, r0 = run["plan"]
            shares = (r0, 1 - r0)
            predicted = evaluate(got["cluster"], [b0, b1], [n, n], list(shares), mode=args.mode)
            for rank, (batch, share) in enumerate(zip((b0, b1), shares)):
                rows.append({"model": model, "plan": f"{b0}+{b1}, shares {r0:g}/{1 - r0:g}", "rank": rank,
                             "batch": batch, "share": share, "predicted_gb": predicted[rank].memory_gb,
                             "measured_gb": run["measured_gb"][rank]})
    return {"steps": steps, "mode": args.mode, "rows": rows}


def print_report(result: dict[str, Any]) -> None:
    from cephalo_lightning._common.units import GIB

    rows = result["rows"]
    common.print_table(
        ["model", "plan (batches, shares)", "rank", "batch", "share", "predicted MiB", "measured MiB", "measured/predicted", ""],
        [[r["model"], r["plan"], r["rank"], r["batch"], f"{r['share']:.3f}", common.mib(r["predicted_gb"] * GIB),
          common.mib(r["measured_gb"] * GIB), f"{r['measured_gb'] / r['predicted_gb']:.2f}",
          "UNDER" if r["measured_gb"] > r["predicted_gb"] else ""] for r in rows],
        title=f"Peak memory per rank, predicted vs measured, pinned {result['mode']} plans ({result['steps']} steps, "
              "EMULATED memory, 2 CPU ranks)")
    under = [r for r in rows if r["measured_gb"] > r["predicted_gb"]]
    print(f"{len(under)} of {len(rows)} ranks measured above their prediction")
    print(common.environment_note())


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
