"""What-if planning, offline: which mixed cluster trains GPT-2.7B or a 7B Llama shape fastest?

Nothing is measured and no GPU is needed: every cluster is described by GPU catalog names and
counts (``cephalo_lightning/planner/schema/catalog.py``: public datasheet figures plus a documented FLOP
and memory model), and the planner chooses every GPU's batch, micro-batches and state share. The
table compares each Cephalo plan with the planner's two baselines:

* even: plain FSDP, the same batch and state share on every GPU with gradient accumulation (the
  slowest GPU sets the pace; OOM when a GPU cannot hold its share next to one micro-batch);
* proportional: batches in proportion to each GPU's speed, still even state shares (what earlier
  heterogeneity-aware systems do; OOM when a small GPU cannot hold an even share).

ALL FIGURES ARE PREDICTIONS of the planner's cost model from catalog ESTIMATES, not measurements:
use them to compare clusters and batch sizes, not as promises. Profile the real cluster
(``CephaloCallback``) before trusting a number. The planner is torch-free, and so is this script::

    python examples/what_if_planning.py                 # the comparison table
    python examples/what_if_planning.py --plans         # plus every feasible plan's per-rank table
    python examples/what_if_planning.py --save-clusters runs/what_if   # cluster files to re-plan with
        python -m cephalo_lightning plan runs/what_if/gpt-2.7b__2x-l4-a6000-p40.yaml -b 64
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cephalo_lightning.demo.gpt_config import GPTConfig  # shapes and parameter counts only (torch-free)
from cephalo_lightning.planner import Cluster, Plan, PlanningError, cluster_from_dict, plan, save_cluster
from cephalo_lightning.planner.report import render_plan

SEQ_LEN = 2048


@dataclass(frozen=True)
class Model:
    """A model as the planner sees it: depth, width, sequence length and parameter count."""

    name: str
    preset: str  # a cephalo_lightning.demo preset (the same shapes as configs/model/*.yaml)
    vocab_size: int

    def spec(self) -> dict[str, Any]:
        config = GPTConfig.preset(self.preset, vocab_size=self.vocab_size, seq_len=SEQ_LEN)
        return {"name": self.name, "num_layers": config.n_layer, "parameters": config.num_parameters(),
                "hidden_size": config.n_embd, "seq_len": SEQ_LEN}


MODELS = (
    Model("gpt-2.7b", "gpt-2.7b", vocab_size=50257),  # GPT-2 BPE vocabulary
    Model("llama-7b-shape", "llama-7b-shape", vocab_size=32000),  # Llama-7B depth, width, vocabulary
)

# (label, [(catalog name, count), ...] in rank order, link GB/s per direction per rank).
# 16 GB/s: PCIe 4.0 x16 inside one host, about half achieved; 12.5 GB/s: a 100 Gbit/s Ethernet port per GPU.
CLUSTERS: tuple[tuple[str, list[tuple[str, int]], float], ...] = (
    ("4x L4", [("l4", 4)], 16.0),  # homogeneous: the plan should match plain FSDP
    ("2x L4 + A6000", [("l4", 2), ("a6000", 1)], 16.0),
    ("2x L4 + A6000 + P40", [("l4", 2), ("a6000", 1), ("p40", 1)], 16.0),  # configs/gpu/l4-a6000-p40.yaml
    ("2x A100-40GB + 2x V100-16GB", [("a100-40gb", 2), ("v100-16gb", 2)], 12.5),  # configs/gpu/a100x2-v100x2.yaml
    ("2x A100-80GB + 4x V100-16GB", [("a100-80gb", 2), ("v100-16gb", 4)], 12.5),
    ("4x A100-40GB + 4x L4", [("a100-40gb", 4), ("l4", 4)], 12.5),  # two nodes: configs/gpu/a100x4-l4x4.yaml
)
GLOBAL_BATCHES = (16, 64, 256)


def describe(model: Model, devices: Sequence[tuple[str, int]], link_gbps: float) -> Cluster:
    """The cluster file's content, built in Python: catalog devices need only a name and a count;
    ``link_gbps`` is each rank's link in GB/s per direction."""
    return cluster_from_dict({
        "model": model.spec(),
        "settings": {"link_bandwidth": f"{link_gbps:g} GB/s per rank"},
        "devices": [{"name": name, "count": count} for name, count in devices],
    })


def speedup(result: Plan, baseline: str) -> str:
    """How much faster the Cephalo plan is predicted to be than a baseline, or why it is not comparable."""
    base = result.baselines.get(baseline)
    if base is None:
        return "-"
    if not base.feasible or not base.predicted_samples_per_s:
        return "OOM"  # the baseline fits no memory at this batch
    return f"{result.predicted_samples_per_s / base.predicted_samples_per_s:.2f}x"


def percent_list(values: Sequence[float]) -> str:
    return "/".join(f"{100 * v:.0f}" for v in values)


def row(label: str, model: Model, batch: int, cluster: Cluster) -> tuple[list[str], Plan | str]:
    """One table row: the plan's predicted throughput against the baselines, or why none fits."""
    try:
        result = plan(cluster, batch)
    except PlanningError as err:
        return [label, model.name, str(batch), "-", "-", "-", "-"], str(err)
    fraction = result.fraction_of_upper_bound
    return [
        label, model.name, str(batch), f"{result.predicted_samples_per_s:.3g}", speedup(result, "even"),
        speedup(result, "proportional"), f"{100 * fraction:.0f}%" if fraction else "-",
        f"{'/'.join(map(str, result.batch_sizes))}; {'/'.join(map(str, result.num_micro_batches))}; "
        f"{percent_list(result.state_shares)}",
    ], result


HEADER = ["cluster", "model", "batch", "samples/s", "vs even", "vs prop.", "of bound",
          "per GPU: batch; micro-batches; state %"]


def format_table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    numeric = {2, 3, 4, 5, 6}

    def line(cells: Sequence[str]) -> str:
        padded = (c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    return "\n".join([line(HEADER), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=list(GLOBAL_BATCHES), help="global batch sizes")
    parser.add_argument("--plans", action="store_true", help="also print every feasible plan's per-rank table")
    parser.add_argument("--save-clusters", type=Path, default=None,
                        help="write each described cluster as a cluster file here "
                             "(to re-plan with `python -m cephalo_lightning plan`)")
    args = parser.parse_args(argv)

    rows: list[list[str]] = []
    plans: list[tuple[str, Plan]] = []
    reasons: list[str] = []  # why a cluster cannot train a model: footnotes, numbered in order
    for model in MODELS:
        for label, devices, link in CLUSTERS:
            cluster = describe(model, devices, link)
            if args.save_clusters:
                slug = label.lower().replace(" + ", "-").replace(" ", "-")
                save_cluster(cluster, args.save_clusters / f"{model.name}__{slug}.yaml")
            results = [row(label, model, batch, cluster) for batch in args.batches]
            failures = {r for _, r in results if isinstance(r, str)}
            if len(failures) == 1 and len(results) > 1 and all(isinstance(r, str) for _, r in results):
                # the training state does not fit whatever the batch: one row says so
                results = [([label, model.name, "any", "-", "-", "-", "-"], failures.pop())]
            for cells, result in results:
                if isinstance(result, str):
                    if result not in reasons:
                        reasons.append(result)
                    cells.append(f"infeasible [{reasons.index(result) + 1}]")
                else:
                    plans.append((label, result))
                rows.append(cells)

    print(f"What-if plans at sequence length {SEQ_LEN}, Adam in fp32 (16 bytes of state per parameter).")
    print("PREDICTED from GPU catalog estimates (datasheet peak x 40% utilisation), not measured.\n")
    print(format_table(rows))
    print("\nsamples/s: the Cephalo plan's predicted throughput; vs even / vs prop.: its predicted speedup over")
    print("plain FSDP (even split) and a compute-proportional split (OOM: that split fits no memory);")
    print("of bound: the fraction of an upper bound that ignores memory limits and communication.")
    for number, reason in enumerate(reasons, start=1):
        print(f"[{number}] {reason}")
    if args.plans:
        for label, result in plans:
            print(f"\n{label}, {result.model.name}:")
            print(render_plan(result), end="")
    if args.save_clusters:
        print(f"\ncluster files written to {args.save_clusters}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
