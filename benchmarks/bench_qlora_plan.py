"""Planner figures for LoRA and QLoRA: the frozen base stored in fp32, bf16 or NF4 (PREDICTED).

    python -m benchmarks.bench_qlora_plan [--batch 16] [--quick] [--json PATH]

Llama-shaped models (Llama 3.x 1B, 3B, 8B, 70B, 405B; Llama 2 13B; Code Llama 34B; sequences of 2048 tokens) fine-tuned with
LoRA r = 16 on q_proj and v_proj. The adapters cost 16 bytes a parameter (fp32 master, gradient,
AdamW moments); the frozen base is priced by how it is stored
(:mod:`cephalo_lightning.planner.cost.base_storage`):

* ``fp32``: 4 bytes a frozen parameter (the master dtype: what LoRA stored before the base was stored
  in the compute dtype);
* ``bf16``: 2 bytes (LoRA with the base in the compute dtype);
* ``nf4``: QLoRA, every frozen matrix (the embedding and head too) as 4-bit NF4 blocks of 64 with an
  fp32 scale each (0.5625 bytes), the norms in bf16.

Three parts:

* **Clusters**: 8B LoRA (bf16 base) and QLoRA on 4x RTX 4090 (one box), on 2x RTX 3090 (one box) and on
  the lab's 4x A100 40GB + 4x RTX 3090 (two nodes, 10 Gbit/s between them); 70B QLoRA on each.
  Printed: feasible or why not, samples/s, and every rank's predicted memory against its limit (GiB).
* **Largest fit**: for 4 of each of the catalog's ~24 GB cards and a mixed box (2x L4 + 2x RTX 4090),
  the largest model of the family that fits each storage, and the largest global batch it fits at
  (searched by doubling, then bisection; capped at ``MAX_BATCH``: the layered schedule splits any
  batch into micro-batches and stashes their activations in host memory, so a model that fits at
  all mostly fits at the cap).

Only trainable gradients are reduced (the frozen base's are not), so the reduce-scatter's buffers
are priced for one layer's adapters (``largest_reduced_parameters``). The cards of one box share a host, each on its own PCIe 4.0 x16 link. These are PREDICTIONS of the
cost model for catalog-estimated devices (datasheet figures), not measurements; torch is not imported.
The cost model prices an NF4 base's all-gathers at its stored bytes (``gathered_bytes_per_param``), the
adapters' at bf16; the per-rank state column shows the replicas a plan chooses (a shard group per rank
holds the whole state on every rank).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import Benchmark
from cephalo_lightning._common.vocabulary import BaseStorage
from cephalo_lightning.planner import PlanningError, cluster_from_dict, plan
from cephalo_lightning.planner.cost.base_storage import llama_matrix_fraction, weight_bytes_per_param

LINK = "16 GB/s per rank"  # one box of cards on PCIe 4.0 x16, about half its 32 GB/s achieved
INTER_NODE = "10 Gbit/s per link"
MAX_BATCH = 1024
RANK = 16


@dataclass(frozen=True)
class Llama:
    """A Llama shape: layers, parameters, hidden size, key-value width."""

    name: str
    layers: int
    parameters: int
    hidden: int
    kv: int

    @property
    def lora(self) -> int:
        """LoRA r = 16 on q (hidden -> hidden) and v (hidden -> kv)."""
        return self.layers * (RANK * self.hidden + self.hidden * RANK + RANK * self.hidden + self.kv * RANK)

    def model(self, storage: str) -> dict[str, Any]:
        fraction = llama_matrix_fraction(self.parameters, self.layers, self.hidden)
        kind, compute_bytes = STORAGE_KINDS[storage]
        return {"name": f"{self.name}-lora-{storage}", "num_layers": self.layers, "parameters": self.parameters,
                "hidden_size": self.hidden, "seq_len": 2048, "trainable_parameters": self.lora,
                # only the adapters' gradients are reduced: the largest reduction is one layer's adapters
                "largest_reduced_parameters": self.lora // self.layers,
                "weight_bytes_per_param": round(weight_bytes_per_param(kind, compute_bytes, fraction), 6)}


FAMILY = (
    Llama("llama-1b", 16, 1_235_814_400, 2048, 512),
    Llama("llama-3b", 28, 3_212_749_824, 3072, 1024),
    Llama("llama-8b", 32, 8_030_261_248, 4096, 1024),
    Llama("llama-2-13b", 40, 13_015_864_320, 5120, 5120),
    Llama("codellama-34b", 48, 33_743_970_304, 8192, 1024),
    Llama("llama-70b", 80, 70_553_706_496, 8192, 1024),
    Llama("llama-405b", 126, 405_853_388_800, 16384, 1024),
)
BY_NAME = {m.name: m for m in FAMILY}
# a column's base: (storage kind, compute dtype bytes); "fp32" is the base kept at the master's 4 bytes
STORAGE_KINDS = {"fp32": (BaseStorage.COMPUTE, 4.0), "bf16": (BaseStorage.COMPUTE, 2.0), "nf4": (BaseStorage.NF4, 2.0)}
STORAGES = tuple(STORAGE_KINDS)
CLUSTERS = {
    "4x RTX 4090": [{"devices": [{"name": "rtx4090", "count": 4}]}],
    "2x RTX 3090": [{"devices": [{"name": "rtx3090", "count": 2}]}],
    "4x A100 40GB + 4x RTX 3090": [{"devices": [{"name": "a100-40gb", "count": 4}]},
                                   {"devices": [{"name": "rtx3090", "count": 4}]}],
}
JOBS = (("llama-8b", "bf16"), ("llama-8b", "nf4"), ("llama-70b", "nf4"))
CARDS = ("l4", "a10g", "rtx3090", "rtx4090", "p40")
BOXES = {**{f"4x {card}": [{"devices": [{"name": card, "count": 4}]}] for card in CARDS},
         "2x l4 + 2x rtx4090": [{"devices": [{"name": "l4", "count": 2}, {"name": "rtx4090", "count": 2}]}]}


def planned(nodes: list[dict[str, Any]], model: dict[str, Any], batch: int) -> Any:
    settings = {"link_bandwidth": LINK, **({"inter_node_bandwidth": INTER_NODE} if len(nodes) > 1 else {})}
    return plan(cluster_from_dict({"model": model, "settings": settings, "nodes": nodes}), batch)


def job_row(cluster: str, name: str, storage: str, batch: int) -> dict[str, Any]:
    row: dict[str, Any] = {"cluster": cluster, "model": name, "base": storage, "batch": batch}
    try:
        p = planned(CLUSTERS[cluster], BY_NAME[name].model(storage), batch)
    except PlanningError as err:
        return {**row, "feasible": False, "why": str(err).split(";")[0]}
    model = BY_NAME[name].model(storage)
    state = model["trainable_parameters"] * 16 + (model["parameters"] - model["trainable_parameters"]) * \
        model["weight_bytes_per_param"]
    return {**row, "feasible": True, "samples_per_s": p.predicted_samples_per_s,
            "state_gb": [round(r.state_share * state / 2**30, 2) for r in p.ranks],
            "memory_gb": [round(r.predicted_memory_gb, 2) for r in p.ranks],
            "limit_gb": [round(r.memory_limit_gb, 2) for r in p.ranks]}


def fits(nodes: list[dict[str, Any]], model: dict[str, Any], batch: int) -> bool:
    try:
        planned(nodes, model, batch)
    except PlanningError:
        return False
    return True


def largest_batch(nodes: list[dict[str, Any]], model: dict[str, Any]) -> int:
    """The largest global batch (at most MAX_BATCH) that fits, 0 if none: doubling from 1, then bisection."""
    if not fits(nodes, model, 1):
        return 0
    low = 1
    while low < MAX_BATCH and fits(nodes, model, min(2 * low, MAX_BATCH)):
        low = min(2 * low, MAX_BATCH)
    high = min(2 * low, MAX_BATCH + 1)  # high does not fit (or is past the cap)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(nodes, model, mid) else (low, mid)
    return low


def largest_fit(box: str, storage: str) -> dict[str, Any]:
    best: dict[str, Any] = {"box": box, "base": storage, "model": None, "batch": 0}
    for llama in FAMILY:  # ascending: the last that fits is the largest
        batch = largest_batch(BOXES[box], llama.model(storage))
        if not batch:
            break
        best = {**best, "model": llama.name, "batch": batch}
    return best


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=16, help="global batch of the cluster rows (sequences of 2048 tokens)")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``--quick``: the cluster rows and the largest fit of the 24 GB RTX 4090 box and the mixed box only."""
    boxes = ("4x rtx4090", "2x l4 + 2x rtx4090") if args.quick else tuple(BOXES)
    return {"batch": args.batch,
            "jobs": [job_row(cluster, name, storage, args.batch) for cluster in CLUSTERS for name, storage in JOBS],
            "largest": [largest_fit(box, storage) for box in boxes for storage in STORAGES]}


def print_report(result: dict[str, Any]) -> None:
    print(f"LoRA r={RANK} on q/v, global batch {result['batch']}, base stored as bf16 or NF4 (QLoRA); "
          "PREDICTED by the cost model, catalog devices")
    print("per rank: the training state it stores (its share; GiB), then its predicted memory (the state, the "
          "plan's batch and buffers) against its limit")
    print(f"{'cluster':<27} {'model':<10} {'base':<5} {'samples/s':>9}  state | predicted/limit GiB per rank")
    for r in result["jobs"]:
        head = f"{r['cluster']:<27} {r['model']:<10} {r['base']:<5}"
        if not r["feasible"]:
            print(f"{head} {'-':>9}  infeasible: {r['why']}")
            continue
        memory = " ".join(f"{m:.1f}/{lim:.1f}" for m, lim in zip(r["memory_gb"], r["limit_gb"]))
        state = " ".join(f"{g:.1f}" for g in r["state_gb"])
        print(f"{head} {r['samples_per_s']:>9.3g}  {state} | {memory}")
    print()
    print(f"The largest model of the Llama family that fits, and its largest global batch (capped at {MAX_BATCH}); "
          "PREDICTED")
    print((f"{'box':<20} " + "  ".join(f"{s + ' base':<25}" for s in STORAGES)).rstrip())
    for box in dict.fromkeys(r["box"] for r in result["largest"]):
        cells = {r["base"]: r for r in result["largest"] if r["box"] == box}
        print((f"{box:<20} " + "  ".join(
            f"{(c['model'] + ' at B = ' + str(c['batch'])) if c['model'] else 'nothing fits':<25}"
            for c in (cells[s] for s in STORAGES))).rstrip())


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
