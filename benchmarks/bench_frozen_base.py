"""LoRA over an emulated slow link: collective bytes and step time with the frozen base held as before and now.

    before: frozen parameters kept in the fp32 master beside the trainable ones, their zero gradients
            reduce-scattered with the unit (ShardedModel(frozen_in_master=True), kept for this comparison)
    after:  frozen parameters stored and gathered in the compute dtype, only the trainable part reduced
    predicted reduce-scatter ratio = elements of the reduced units / trainable elements   (>= 1 / (1 - frozen fraction))

A tiny Llama (built from a config, no download) with peft LoRA adapters on q_proj and v_proj, in bf16
(fp32 masters), sharded evenly over 3 gloo ranks, each on its own emulated node behind a slow link
(:class:`~cephalo_lightning.runtime.emulation.links.EmulatedLinks`), trained by the uniform mode's hooks
with AdamW. Both variants run in the same processes, their steps interleaved round by round. Printed:
the bytes every rank sent per step in all-gathers and reduce-scatters (counted by the collectives
themselves, summed over the ranks), the median step time of each, and the ratios, with the ratio the
frozen fraction predicts for the reduce-scatters. EMULATED on CPU: the link is a sleep computed from the
bytes, the compute is the host's.

    python -m benchmarks.bench_frozen_base [--steps 8] [--gbps 0.02] [--world 3]
    python -m benchmarks.bench_frozen_base --quick   # 3 timed steps
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

import torch

from benchmarks import _common as common
from benchmarks.harness import Benchmark

SEQ = 64
BATCH = 4  # samples per rank and step
VOCAB = 512
OPS = ("all_gather", "reduce_scatter")


def lora_llama() -> torch.nn.Module:
    """A Llama of 4 layers of width 256 with rank-8 LoRA adapters, in bf16."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    model = get_peft_model(transformers.LlamaForCausalLM(config), LoraConfig(r=8, lora_alpha=16,
                                                                             target_modules=["q_proj", "v_proj"]))
    return model.to(torch.bfloat16)


def _rank(rank: int, world: int, steps: int, gbps: float) -> dict[str, Any]:
    from cephalo_lightning.runtime.emulation.links import EmulatedLinks
    from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

    warnings.simplefilter("ignore")
    links = EmulatedLinks(tuple(range(world)), gbps)
    variants = {}
    for name, before in (("before", True), ("after", False)):
        model = lora_llama()
        layers = model.base_model.model.model.layers
        sharded = ShardedModel(model, [1 / world] * world, units=[[layer] for layer in layers], links=links,
                               frozen_in_master=before)
        optimizer = torch.optim.AdamW([p for p in sharded.parameters() if p.requires_grad], lr=1e-3)
        variants[name] = (model, sharded, optimizer)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    sent: dict[str, list[dict[str, int]]] = {name: [] for name in variants}

    def step(name: str) -> None:
        model, sharded, optimizer = variants[name]
        start = dict(sharded.comm.sent_bytes)
        sharded.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
        sent[name].append({op: sharded.comm.sent_bytes.get(op, 0) - start.get(op, 0) for op in OPS})

    times = common.interleaved_times({name: (lambda name=name: step(name)) for name in variants}, steps, warmup=1)
    after = variants["after"][1]
    units = [(u.layout.numel, u.trainable_layout.numel) for u in after.units if u.trainable]
    stored = {name: v[1].local_state_bytes() for name, v in variants.items()}
    return {"times": times, "sent": {name: per_step[-1] for name, per_step in sent.items()},
            "units": units, "stored": stored,
            "parameters": sum(p.numel() for p in variants["after"][0].parameters()),
            "trainable": sum(p.numel() for p in variants["after"][0].parameters() if p.requires_grad)}


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, help="timed steps per variant (default 8; --quick 3)")
    parser.add_argument("--gbps", type=float, default=0.02, help="the emulated link's bandwidth, GB/s per rank")
    parser.add_argument("--world", type=int, default=3, help="ranks, each on its own emulated node (2 or 3)")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    if args.world not in (2, 3):
        raise SystemExit(f"--world {args.world}: choose 2 or 3 ranks (a CPU host's share)")
    steps = args.steps or (3 if args.quick else 8)
    load = common.load_average()
    started = time.perf_counter()
    ranks = common.run_ranks(_rank, args.world, steps, args.gbps)
    first = ranks[0]
    sent = {name: {op: sum(r["sent"][name][op] for r in ranks) for op in OPS} for name in ("before", "after")}
    # every step is fenced by barriers: each rank's time is the collective step as the slowest rank sees it
    step_s = {name: common.median(first["times"][name]) for name in ("before", "after")}
    reduced, trainable_reduced = sum(n for n, _ in first["units"]), sum(t for _, t in first["units"])
    return {
        "world": args.world, "gbps": args.gbps, "steps": steps,
        "parameters": first["parameters"], "trainable": first["trainable"],
        "frozen_fraction": 1 - first["trainable"] / first["parameters"],
        "predicted_reduce_scatter_ratio": reduced / trainable_reduced,
        "sent": sent, "step_s": step_s,
        "stored": {name: [r["stored"][name] for r in ranks] for name in ("before", "after")},
        "seconds": time.perf_counter() - started,
        "environment": common.environment_note(), "load": common.load_span(load),
    }


def print_report(result: dict[str, Any]) -> None:
    sent, step_s = result["sent"], result["step_s"]
    total = {name: sum(sent[name].values()) for name in sent}
    print(f"LoRA on a tiny Llama: {result['parameters']:,} parameters, {result['trainable']:,} trainable "
          f"(frozen fraction {result['frozen_fraction']:.4f}); {result['world']} ranks on their own emulated nodes, "
          f"{result['gbps']:g} GB/s links; median of {result['steps']} interleaved steps (EMULATED on CPU)")
    rows = []
    for label, key in (("all-gather MiB / step", "all_gather"), ("reduce-scatter MiB / step", "reduce_scatter")):
        b, a = sent["before"][key], sent["after"][key]
        rows.append([label, common.mib(b), common.mib(a), f"{b / a:.2f}x" if a else "-"])
    rows.append(["collective MiB / step", common.mib(total["before"]), common.mib(total["after"]),
                 f"{total['before'] / total['after']:.2f}x"])
    rows.append(["step time (s)", f"{step_s['before']:.3f}", f"{step_s['after']:.3f}",
                 f"{step_s['before'] / step_s['after']:.2f}x"])
    stored = result["stored"]
    rows.append(["stored state MiB, rank 0 (master + frozen)", common.mib(sum(stored["before"][0])),
                 common.mib(sum(stored["after"][0])), f"{sum(stored['before'][0]) / sum(stored['after'][0]):.2f}x"])
    common.print_table(["per step (summed over ranks)", "before", "after", "before / after"], rows)
    measured = sent["before"]["reduce_scatter"] / sent["after"]["reduce_scatter"]
    print(f"reduce-scatter bytes ratio {measured:.2f}x; the frozen fraction predicts at least "
          f"{result['predicted_reduce_scatter_ratio']:.2f}x (the reduced units' elements over their trainable ones)")
    print(result["environment"])
    print(common.load_note(*result["load"]))


def exit_status(result: dict[str, Any]) -> int:
    measured = result["sent"]["before"]["reduce_scatter"] / result["sent"]["after"]["reduce_scatter"]
    return 0 if measured >= result["predicted_reduce_scatter_ratio"] * (1 - 1e-9) else 1


BENCHMARK = Benchmark(__doc__, measure, print_report, options, exit_status)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
