"""Every benchmark, once: its module, its heading, whether the results page runs it, its smoke-run flags.

``benchmarks/report.py`` (``make bench``) runs the entries with ``in_report`` and writes the results
page; ``python -m benchmarks`` (``make bench-smoke``) runs any of them with ``quick_args``. A
``bench_<name>.py`` file without an entry here fails ``tests/test_benchmarks.py``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from benchmarks.harness import Benchmark


@dataclass(frozen=True)
class Entry:
    """``name``: the module ``benchmarks/bench_<name>.py``; ``title``: its results-page heading."""

    name: str
    title: str
    in_report: bool
    quick_args: tuple[str, ...] = ("--quick",)

    @property
    def module(self) -> str:
        return f"benchmarks.bench_{self.name}"

    def load(self) -> Benchmark:
        """The benchmark's entry points (imports its module: torch, for most)."""
        return importlib.import_module(self.module).BENCHMARK


BENCHMARKS: tuple[Entry, ...] = (
    Entry("planner", "Planner at cluster scale, bounded in the batch, plan quality vs every baseline", True),
    Entry("runtime", "Sharding runtime vs FSDP2, padded vs exact, memory", True),
    Entry("layered", "Layered accumulation: memory vs micro-batches, predicted vs measured", True),
    Entry("strategy", "strategy=\"cephalo\" vs FSDP2 and DDP through Trainer.fit", True),
    Entry("emulated", "Emulated heterogeneous cluster: Cephalo vs even vs proportional", True),
    Entry("meta_init", "Meta-device init: peak host memory per rank while a 220M model is sharded", True),
    Entry("startup", "Planner CLI start-up beside `python -c pass`", True),
    Entry("fidelity", "Plan fidelity: predicted vs measured step time and peak memory per rank", True),
    Entry("frozen_base", "LoRA over a slow link: collective bytes and step time, the frozen base before and now "
          "(emulated)", True),
    Entry("ft_overhead", "Fault tolerance's cost per step: the same 2-group plan with it on and off (emulated on CPU)",
          True),
    Entry("ft_failures", "A run with failures: fault tolerance against checkpoint-restart, a group killed every K steps "
          "(emulated on CPU)", True),
    Entry("preemption", "The preemption budget: SIGUSR1 to a checkpoint on disk and the job exited, sync and async, "
          "by state size (measured on CPU)", True),
    Entry("lab_cluster", "A lab's two nodes (4x A100 + 4x RTX 3090, 10 GbE): plans under the old and new cost-model "
          "defaults (predicted)", True),
    Entry("pipeline_plan", "The lab's two nodes with pipelines and idle GPUs weighed: the planner's choice vs the best "
          "shard grouping and the A100 node alone (predicted)", True),
    Entry("qlora_plan", "LoRA and QLoRA at the cards' limit: a bf16 or 4-bit base on 24 GB cards and the lab cluster "
          "(predicted)", True),
    # Not on the results page: each answers one question its docs page quotes, and most take minutes.
    Entry("finetune_plan", "Fine-tuning plans: an 8B model on 24 GB cards, full vs LoRA (predicted)", False),
    Entry("topology", "Shard groups over an emulated network topology: the planner's choice vs full shard, HSDP, DDP",
          False),
    Entry("straggler", "A straggler mid-run: the static plan, the adaptive one and the offline optimum", False),
    Entry("host", "What the host does to an emulated cluster's compute", False),
    Entry("emulation", "Emulated compute regions on a shared host: wall time vs emulated length", False),
    Entry("discovery", "Discovered layered mode vs the named adapter vs uniform", False),
    Entry("compile", "torch.compile per block: compiled vs uncompiled step time", False),
    Entry("memory_shares", "Peak memory under skewed state shares: predicted vs emulated, full and LoRA", False),
    Entry("checkpoint", "Checkpoint saves: synchronous vs background, and the kill loop", False, ("--quick", "--no-kills")),
    Entry("fault_tolerance", "Losing a node: torchft against the torchrun elastic restart", False),
    Entry("pipeline", "A pipelined plan vs every non-pipelined one on 2 emulated nodes with a slow link, predicted and "
          "measured", True),
)

BY_NAME = {entry.name: entry for entry in BENCHMARKS}
