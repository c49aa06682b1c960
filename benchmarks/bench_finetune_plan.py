"""Planner figures for fine-tuning: an 8B model on 24 GB cards, full fine-tuning against LoRA.

    python -m benchmarks.bench_finetune_plan [--batch 16] [--quick] [--json PATH]

For every ~24 GB card of the shipped GPU catalog (L4, A10G, RTX 3090, RTX 4090, P40), 4 and 8 of
them, and a mixed box (2x L4 + 2x RTX 4090), the planner plans a Llama-3-8B-shaped model (32
layers, 8.03e9 parameters, hidden 4096, sequence 2048) twice:

* full fine-tuning: every parameter trains (fp32 master, gradient, AdamW moments: 16 bytes each);
* LoRA r = 16 on q_proj and v_proj (6.8e6 trainable parameters): the adapters cost 16 bytes each,
  the frozen base its stored fp32 weights, 4 bytes each (``model.trainable_parameters``).

The cards of a setup share one host, each on its own PCIe 4.0 x16 link (``LINK``).

Printed: feasible or why not, the predicted samples/s and every rank's predicted memory (GiB).
These are PREDICTIONS of the cost model for catalog-estimated devices (datasheet figures), not
measurements; torch is not imported.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.harness import Benchmark
from cephalo_lightning.planner import PlanningError, cluster_from_dict, plan

PARAMETERS = 8_030_261_248
LORA = 32 * (16 * 4096 + 4096 * 16 + 16 * 4096 + 1024 * 16)  # r=16 on q (4096->4096) and v (4096->1024)
CARDS = ("l4", "a10g", "rtx3090", "rtx4090", "p40")
MIXED = (("l4", 2), ("rtx4090", 2))
LINK = "16 GB/s per rank"  # one box of cards on PCIe 4.0 x16, about half its 32 GB/s achieved


def cluster(devices: tuple[tuple[str, int], ...], trainable: int | None) -> Any:
    model: dict[str, Any] = {"name": "llama-3-8b", "num_layers": 32, "parameters": PARAMETERS, "hidden_size": 4096,
                             "seq_len": 2048}
    if trainable is not None:
        model["trainable_parameters"] = trainable
    return cluster_from_dict({"model": model, "settings": {"link_bandwidth": LINK},
                              "devices": [{"name": n, "count": c} for n, c in devices]})


def row(devices: tuple[tuple[str, int], ...], batch: int, how: str) -> dict[str, Any]:
    label = " + ".join(f"{c}x {n}" for n, c in devices)
    try:
        p = plan(cluster(devices, LORA if how == "lora" else None), batch)
    except PlanningError as err:
        return {"cluster": label, "fine-tune": how, "feasible": False, "why": str(err).split(";")[0]}
    return {"cluster": label, "fine-tune": how, "feasible": True, "samples_per_s": p.predicted_samples_per_s,
            "memory_gb": [round(r.predicted_memory_gb, 2) for r in p.ranks],
            "limit_gb": [round(r.memory_limit_gb, 2) for r in p.ranks]}


def run(batch: int) -> list[dict[str, Any]]:
    setups = [((card, n),) for card in CARDS for n in (4, 8)] + [MIXED]
    return [row(devices, batch, how) for devices in setups for how in ("full", "lora")]


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences of 2048 tokens)")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``--quick`` is the full run: it takes about a second."""
    return {"batch": args.batch, "rows": run(args.batch)}


def print_report(result: dict[str, Any]) -> None:
    print(f"Llama-3-8B shape, global batch {result['batch']}: full fine-tuning vs LoRA r=16 on q/v "
          f"({LORA:,} trainable of {PARAMETERS:,}); PREDICTED by the cost model, catalog devices")
    print(f"{'cluster':<18} {'fine-tune':<9} {'samples/s':>9}  predicted/limit GiB per rank")
    for r in result["rows"]:
        if not r["feasible"]:
            print(f"{r['cluster']:<18} {r['fine-tune']:<9} {'-':>9}  infeasible: {r['why']}")
            continue
        memory = " ".join(f"{m:.1f}/{lim:.1f}" for m, lim in zip(r["memory_gb"], r["limit_gb"]))
        print(f"{r['cluster']:<18} {r['fine-tune']:<9} {r['samples_per_s']:>9.3g}  {memory}")


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
