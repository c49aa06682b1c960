"""A lab's two-node cluster planned under the cost model's old and new defaults (PREDICTED).

    python -m benchmarks.bench_lab_cluster [--quick] [--json PATH]

The cluster: node 0 with 4x A100 40GB, node 1 with 4x RTX 3090 (catalog estimates), PCIe inside a
node (``16 GB/s per rank``), 10 GbE between them (``10 Gbit/s per link``). Two jobs, each at a
global batch of 64 and 512 sequences of 2048 tokens:

* LoRA on a Llama-3-8B-shaped model (32 layers, 8.03e9 parameters, r = 16 on q_proj and v_proj:
  6.8e6 trainable; the frozen base charged its fp32 weights);
* full training of a Llama-shaped 1B model (16 layers, 1.24e9 parameters, hidden 2048).

Each job is planned three ways, every one an explicit setting of the same cluster:

* ``free``: ``settings.free_links``, what a file without bandwidths planned before it was refused
  (the collectives at 0 s);
* ``overlap 1``: the links priced, the collectives fully hidden behind compute (the old default of
  an unmeasured ``settings.overlap``);
* ``overlap 0``: the links priced, the collectives serial with compute (the default now).

The catalog's RTX 3090 figure (71 TFLOPS, dense bf16 with fp32 accumulate) is the same in every
column: it was already the fp32-accumulate figure, the fp16-accumulate one being 142.

Printed per job and batch: predicted samples/s, the shard grouping and the A100 / RTX 3090 batches
of each, and the change from ``overlap 1`` to ``overlap 0``. PREDICTIONS of the cost model for
catalog-estimated devices, not measurements; torch is not imported; it takes about a second.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.harness import Benchmark
from cephalo_lightning.planner import cluster_from_dict, plan

LINKS = {"link_bandwidth": "16 GB/s per rank", "inter_node_bandwidth": "10 Gbit/s per link"}
NODES = [{"devices": [{"name": "a100-40gb", "count": 4}]}, {"devices": [{"name": "rtx3090", "count": 4}]}]
LORA_8B = {"name": "llama-3-8b-lora", "num_layers": 32, "parameters": 8_030_261_248, "hidden_size": 4096,
           "seq_len": 2048, "trainable_parameters": 32 * (16 * 4096 + 4096 * 16 + 16 * 4096 + 1024 * 16)}
FULL_1B = {"name": "llama-1b", "num_layers": 16, "parameters": 1_235_814_400, "hidden_size": 2048, "seq_len": 2048}
JOBS = {"8B LoRA": LORA_8B, "1B full": FULL_1B}
BATCHES = (64, 512)
VARIANTS = {"free": {"free_links": True}, "overlap 1": {**LINKS, "overlap": 1.0}, "overlap 0": dict(LINKS)}


def planned(model: dict[str, Any], settings: dict[str, Any], batch: int) -> dict[str, Any]:
    """One plan's figures: samples/s, its shard groups and the batch of an A100 and of an RTX 3090."""
    p = plan(cluster_from_dict({"model": model, "settings": settings, "nodes": NODES}), batch)
    return {"samples_per_s": p.predicted_samples_per_s, "groups": [list(g) for g in p.shard_groups],
            "a100_batch": p.ranks[0].batch_size, "rtx3090_batch": p.ranks[4].batch_size}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``--quick`` is the full run: it takes about a second."""
    rows = [{"job": job, "batch": batch, **{name: planned(model, settings, batch) for name, settings in VARIANTS.items()}}
            for job, model in JOBS.items() for batch in BATCHES]
    return {"links": LINKS, "rows": rows}


def _groups(groups: list[list[int]]) -> str:
    return "+".join(str(len(g)) for g in groups)


def print_report(result: dict[str, Any]) -> None:
    print("4x A100 40GB (node 0) + 4x RTX 3090 (node 1), "
          f"{result['links']['link_bandwidth']} inside a node, {result['links']['inter_node_bandwidth']} between; "
          "PREDICTED by the cost model, catalog devices")
    print("samples/s (shard groups, A100/3090 batch per rank); free: no link priced; overlap 1: collectives hidden "
          "(the old default); overlap 0: serial (the new default)")
    print(f"{'job':<8} {'B':>4}  {'free':>22}  {'overlap 1':>22}  {'overlap 0':>22}  {'0 vs 1':>6}")
    for r in result["rows"]:
        cells = [f"{r[v]['samples_per_s']:.3g} ({_groups(r[v]['groups'])}, {r[v]['a100_batch']}/{r[v]['rtx3090_batch']})"
                 for v in VARIANTS]
        change = r["overlap 0"]["samples_per_s"] / r["overlap 1"]["samples_per_s"] - 1
        print(f"{r['job']:<8} {r['batch']:>4}  " + "  ".join(f"{c:>22}" for c in cells) + f"  {100 * change:>+5.0f}%")


BENCHMARK = Benchmark(__doc__, measure, print_report)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
