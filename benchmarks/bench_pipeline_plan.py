"""A lab's two nodes with pipelines and idle devices weighed: the planner's choice against the best
shard grouping, the best subset and the A100 node alone (PREDICTED).

    python -m benchmarks.bench_pipeline_plan [--quick] [--json PATH]

The cluster of ``bench_lab_cluster``: node 0 with 4x A100 40GB, node 1 with 4x RTX 3090 (catalog
estimates), ``16 GB/s per rank`` inside a node, ``10 Gbit/s per link`` between. Jobs: full training
of an 8B Llama shape at a global batch of 64, of a 1B Llama shape at 64 and 512, and LoRA on the 8B
shape at 64 (sequences of 2048 tokens). Each is planned with ``plan(..., pipelines=True,
subsets=True)`` under two settings of the same cluster: the collectives hidden behind compute
(``overlap 1``, the cost model's default when the lab case was first planned) and serial with it
(``overlap 0``, the default for an unmeasured overlap now).

Printed per job: the plan over every rank without pipelines (``no pipeline``, what the planner
picked before), the A100 node alone, the best subset, the best pipelined plan (its stages, micro-batch
count and the bytes it sends between the nodes per step), and the planner's choice with its step and
its speed-up over ``no pipeline`` and over the A100 node alone. PREDICTIONS of the cost model for
catalog-estimated devices, not measurements; torch is not imported.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.harness import Benchmark
from cephalo_lightning.planner import Plan, cluster_from_dict, plan
from cephalo_lightning.planner.search.subsets import sub_cluster

LINKS = {"link_bandwidth": "16 GB/s per rank", "inter_node_bandwidth": "10 Gbit/s per link"}
NODES = [{"devices": [{"name": "a100-40gb", "count": 4}]}, {"devices": [{"name": "rtx3090", "count": 4}]}]
# num_layers: what the layered schedule runs (embedding, every decoder block, norm with head), as profiling counts it
FULL_8B = {"name": "llama-8b", "num_layers": 34, "parameters": 8_030_261_248, "hidden_size": 4096, "seq_len": 2048}
LORA_8B = {**FULL_8B, "name": "llama-8b-lora",
           "trainable_parameters": 32 * (16 * 4096 + 4096 * 16 + 16 * 4096 + 1024 * 16)}
FULL_1B = {"name": "llama-1b", "num_layers": 18, "parameters": 1_235_814_400, "hidden_size": 2048, "seq_len": 2048}
JOBS = (("8B full", FULL_8B, 64), ("1B full", FULL_1B, 64), ("1B full", FULL_1B, 512), ("8B LoRA", LORA_8B, 64))
OVERLAPS = (1.0, 0.0)
A100_NODE = (0, 1, 2, 3)


def _rate(p: Plan | None) -> float | None:
    return None if p is None else p.predicted_samples_per_s


def _alone(cluster: Any, batch: int) -> Plan | None:
    try:
        return plan(sub_cluster(cluster, A100_NODE), batch)
    except Exception:  # noqa: BLE001 - the node cannot hold the job: reported as infeasible
        return None


def _chosen_kind(p: Plan) -> str:
    if p.pipelined:
        return "pipelined"
    return "subset" if p.idle_ranks else "no pipeline"


def planned(model: dict[str, Any], batch: int, overlap: float) -> dict[str, Any]:
    cluster = cluster_from_dict({"model": model, "settings": {**LINKS, "overlap": overlap}, "nodes": NODES})
    chosen = plan(cluster, batch, pipelines=True, subsets=True)
    base = chosen.baselines["no pipeline"]
    subset = chosen.baselines["best subset"]
    piped = chosen.baselines["pipelined"]
    alone = _alone(cluster, batch)
    return {
        "no_pipeline": {"samples_per_s": base.predicted_samples_per_s, "step_s": base.predicted_step_s},
        "a100_alone": {"samples_per_s": _rate(alone), "step_s": None if alone is None else alone.predicted_step_s},
        "best_subset": {"samples_per_s": subset.predicted_samples_per_s, "shape": subset.reason},
        "pipelined": {"samples_per_s": piped.predicted_samples_per_s, "shape": piped.reason},
        "chosen": {"kind": _chosen_kind(chosen), "samples_per_s": chosen.predicted_samples_per_s,
                   "step_s": chosen.predicted_step_s, "stage_layers": list(chosen.stage_layers),
                   "idle": list(chosen.idle_ranks)},
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``--quick`` is the full run: it takes a few seconds."""
    rows = [{"job": job, "batch": batch, "overlap": overlap, **planned(model, batch, overlap)}
            for overlap in OVERLAPS for job, model, batch in JOBS]
    return {"links": LINKS, "rows": rows}


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def print_report(result: dict[str, Any]) -> None:
    print("4x A100 40GB (node 0) + 4x RTX 3090 (node 1), "
          f"{result['links']['link_bandwidth']} inside a node, {result['links']['inter_node_bandwidth']} between; "
          "PREDICTED by the cost model, catalog devices")
    print("samples/s; no pipeline: the best shard grouping over all 8 GPUs; A100 node: the 4 A100s alone; "
          "chosen: the planner's pick (pipelines and subsets weighed)")
    print(f"{'overlap':>7} {'job':<8} {'B':>4}  {'no pipeline':>16}  {'A100 node':>9}  {'pipelined':>9}  "
          f"{'chosen':>24}  {'x no pipe':>9}  {'x A100':>6}")
    for r in result["rows"]:
        base, alone, chosen = r["no_pipeline"], r["a100_alone"], r["chosen"]
        picked = f"{chosen['kind']} {chosen['samples_per_s']:.3g} ({chosen['step_s']:.3g} s)"
        versus_alone = "-" if alone["samples_per_s"] is None else f"{chosen['samples_per_s'] / alone['samples_per_s']:.2f}"
        print(f"{r['overlap']:>7g} {r['job']:<8} {r['batch']:>4}  "
              f"{_cell(base['samples_per_s']) + ' (' + _cell(base['step_s']) + ' s)':>16}  "
              f"{_cell(alone['samples_per_s']):>9}  {_cell(r['pipelined']['samples_per_s']):>9}  {picked:>24}  "
              f"{chosen['samples_per_s'] / base['samples_per_s']:>9.2f}  {versus_alone:>6}")
    print("pipelined plans weighed (stages, micro-batches, bytes between the nodes per step):")
    for r in result["rows"]:
        print(f"  overlap {r['overlap']:g}, {r['job']} B={r['batch']}: {r['pipelined']['shape']}")


BENCHMARK = Benchmark(__doc__, measure, print_report)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
