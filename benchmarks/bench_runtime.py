"""Runtime benchmark: step time vs FSDP2, padded vs exact collectives, memory vs the plan.

    python -m benchmarks.bench_runtime            # W = 2, 3, 4 for the collectives; a few minutes
    python -m benchmarks.bench_runtime --quick    # W = 2, 3, fewer repeats; under a minute
    python -m benchmarks.bench_runtime --json -   # the result as JSON on stdout (--json PATH: to a file)

Three measurements, all on CPU processes talking over gloo (NOT GPUs over NCCL), each reported as
ratios of variants measured side by side in ONE run, in alternating rounds:

1. step time: the Cephalo runtime (``ShardedModel``, uniform mode, even shares, one micro-batch)
   vs FSDP2 (``fully_shard`` on every block and the root) on the same GPT, same data, AdamW, 2 ranks;
2. collectives: one unit's all-gather and reduce-scatter, ``padded`` vs ``exact``, at max shares rho
   from 1/W (even) to 1, relative to the even case; the fitted slope s of
   time(rho) / time(even) ~= 1 + s * (W * rho - 1) is what ``planner/cost/collective_prices.py:UNEVEN_SLOPE`` holds;
3. memory: peak accounted bytes per rank (``MemoryTracker``) at uneven shares vs the planner's
   predicted state bytes (state_bytes_per_param x parameters x share).

``run_benchmark()`` returns the rows as data (for report scripts); ``main()`` prints the tables.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from benchmarks import _common as common
from benchmarks.harness import Benchmark, comma_list

STATE_BYTES_PER_PARAM = 16.0  # fp32 params + fp32 grads + two AdamW moments: the planner's default
MODES = ("padded", "exact")
PARTS = ("step", "collectives", "memory")


@dataclass(frozen=True)
class Config:
    # the model: a GPT whose training step takes ~0.1-0.2 s on one CPU thread
    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 192
    batch_per_rank: int = 8
    step_rounds: int = 15
    step_warmup: int = 3
    # collectives: one unit of 4 MiB in fp32 (divisible by 2, 3 and 4 so that even is exact)
    unit_numel: int = 12 * (2**20 // 12)
    worlds: tuple[int, ...] = (2, 3, 4)
    max_shares: tuple[float, ...] = (0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    collective_rounds: int = 12
    calls_per_timing: int = 3
    # memory
    memory_shares: tuple[float, ...] = (0.7, 0.3)
    memory_steps: int = 2


QUICK = Config(step_rounds=5, step_warmup=1, worlds=(2, 3), max_shares=(0.45, 0.6, 0.8, 1.0), collective_rounds=5,
               calls_per_timing=2)


def gpt_config(cfg: Config):
    from cephalo_lightning.demo.gpt import GPTConfig

    return GPTConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, n_layer=cfg.n_layer, n_head=cfg.n_head,
                     n_embd=cfg.n_embd)


def _batch(cfg: Config, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, cfg.vocab_size, (cfg.batch_per_rank, cfg.seq_len + 1),
                         generator=torch.Generator().manual_seed(1000 + rank))
    return data[:, :-1], data[:, 1:]


# ----------------------------------------------------------------------------- 1. step time vs FSDP2


def _step_time(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from cephalo_lightning.demo.gpt import GPT
    from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

    torch.manual_seed(0)
    ceph = GPT(gpt_config(cfg))
    fsdp = GPT(gpt_config(cfg))
    fsdp.load_state_dict(ceph.state_dict())
    initial = {k: v.detach().clone() for k, v in ceph.state_dict().items()}
    parameters = sum(p.numel() for p in ceph.parameters())
    sharded = ShardedModel(ceph, [1.0 / world] * world)  # units: the blocks; root: embedding + head
    opt_c = torch.optim.AdamW(ceph.parameters(), lr=1e-3, weight_decay=0.1)
    mesh = init_device_mesh("cpu", (world,))
    for block in fsdp.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    opt_f = torch.optim.AdamW(fsdp.parameters(), lr=1e-3, weight_decay=0.1)
    x, y = _batch(cfg, rank)

    # Cephalo sums gradients over ranks (loss weighted by b_i / B); FSDP2 averages them: same gradient.
    def cephalo_fwd_bwd() -> None:
        sharded.backward(ceph.loss(ceph(x), y) / world)

    def fsdp2_fwd_bwd() -> None:
        fsdp.loss(fsdp(x), y).backward()

    def cephalo_step() -> None:
        cephalo_fwd_bwd()
        opt_c.step()
        opt_c.zero_grad()

    def fsdp2_step() -> None:
        fsdp2_fwd_bwd()
        opt_f.step()
        opt_f.zero_grad()

    def cephalo_grads_only() -> None:
        cephalo_fwd_bwd()
        opt_c.zero_grad()

    def fsdp2_grads_only() -> None:
        fsdp2_fwd_bwd()
        opt_f.zero_grad()

    times = common.interleaved_times(
        {"cephalo_step": cephalo_step, "fsdp2_step": fsdp2_step,
         "cephalo_fwd_bwd": cephalo_grads_only, "fsdp2_fwd_bwd": fsdp2_grads_only},
        repeats=cfg.step_rounds, warmup=cfg.step_warmup,
    )
    times = {k: common.max_over_ranks(v) for k, v in times.items()}
    # both models took the same optimizer steps on the same data: they must agree
    ours = sharded.full_state_dict()
    theirs = {k: v.full_tensor() for k, v in fsdp.state_dict().items()}
    diff = max((ours[k] - theirs[k].reshape(ours[k].shape)).abs().max().item() for k in ours)
    moved = max((ours[k] - initial[k]).abs().max().item() for k in ours)
    return {"times": times, "parameters": parameters, "max_abs_param_diff": diff, "max_abs_param_change": moved}


def step_rows(result: dict[str, Any], cfg: Config, world: int) -> list[dict[str, Any]]:
    times = result["times"]
    rows = []
    for what in ("step", "fwd_bwd"):
        c, f = times[f"cephalo_{what}"], times[f"fsdp2_{what}"]
        rows.append({
            "measure": "fwd+bwd+AdamW step" if what == "step" else "fwd+bwd only",
            "world_size": world, "parameters": result["parameters"],
            "tokens_per_rank": cfg.batch_per_rank * cfg.seq_len, "rounds": len(c),
            "cephalo_ms": 1e3 * common.median(c), "fsdp2_ms": 1e3 * common.median(f),
            "ratio_cephalo_over_fsdp2": common.paired_ratio(c, f),
            "max_abs_param_diff": result["max_abs_param_diff"],
            "max_abs_param_change": result["max_abs_param_change"],
        })
    return rows


# ----------------------------------------------------------------------------- 2. padded vs exact


def shares_for(rho: float, world: int) -> list[float]:
    """Rank 0 stores ``rho`` of the unit, the others split the rest evenly."""
    return [rho] + [(1.0 - rho) / (world - 1)] * (world - 1)


def max_shares_for(cfg: Config, world: int) -> list[float]:
    return [r for r in cfg.max_shares if r > 1.0 / world + 1e-9]


def _collectives(rank: int, world: int, cfg: Config) -> dict[Any, list[float]]:
    from cephalo_lightning.runtime.collectives import Collectives
    from cephalo_lightning.runtime.sharding.layout import build_layout

    comms = {mode: Collectives(None, mode) for mode in MODES}
    full = torch.randn(cfg.unit_numel)  # this rank's whole-unit gradient
    out = torch.empty(cfg.unit_numel)  # the gathered unit
    k = cfg.calls_per_timing
    variants = {}
    for rho in [1.0 / world, *max_shares_for(cfg, world)]:
        unit = build_layout([cfg.unit_numel], shares_for(rho, world)).units[0]
        lo, hi = unit.shard_range(rank)
        shard = torch.randn(hi - lo)
        for mode in (("even",) if unit.is_even else MODES):
            comm = comms["padded" if mode == "even" else mode]

            def all_gather(comm=comm, shard=shard, unit=unit) -> None:
                for _ in range(k):
                    comm.all_gather(shard, out, unit).wait()

            def reduce_scatter(comm=comm, unit=unit) -> None:
                for _ in range(k):
                    comm.reduce_scatter(full, unit)

            variants[("all_gather", mode, rho)] = all_gather
            variants[("reduce_scatter", mode, rho)] = reduce_scatter
    times = common.interleaved_times(variants, repeats=cfg.collective_rounds, warmup=2)
    return {key: [t / k for t in common.max_over_ranks(v)] for key, v in times.items()}


def collective_rows(times: dict[Any, list[float]], world: int, cfg: Config) -> list[dict[str, Any]]:
    rows = []
    for op in ("all_gather", "reduce_scatter"):
        even = times[(op, "even", 1.0 / world)]
        rows.append({"world_size": world, "op": op, "max_share": 1.0 / world, "imbalance": 0.0,
                     "even_ms": 1e3 * common.median(even), "padded_ms": 1e3 * common.median(even),
                     "exact_ms": 1e3 * common.median(even), "padded_ratio": 1.0, "exact_ratio": 1.0,
                     "padded_over_exact": 1.0, "faster": "same (even path)", "unit_mib": cfg.unit_numel * 4 / 2**20})
        for rho in max_shares_for(cfg, world):
            p, e = times[(op, "padded", rho)], times[(op, "exact", rho)]
            p_over_e = common.paired_ratio(p, e)
            rows.append({
                "world_size": world, "op": op, "max_share": rho, "imbalance": world * rho - 1.0,
                "even_ms": 1e3 * common.median(even), "padded_ms": 1e3 * common.median(p),
                "exact_ms": 1e3 * common.median(e),
                "padded_ratio": common.paired_ratio(p, even), "exact_ratio": common.paired_ratio(e, even),
                "padded_over_exact": p_over_e, "faster": "exact" if p_over_e > 1.0 else "padded",
                "unit_mib": cfg.unit_numel * 4 / 2**20,
            })
    return rows


def _free_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + s x: the jump at the first imbalance (a - 1) and the slope."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    s = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return my - s * mx, s


def fit_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Slopes per (mode, op, W), per mode over all W and both ops (the planner's figure)."""
    uneven = [r for r in rows if r["imbalance"] > 0]
    fits = []
    groups: list[tuple[str, str, Any]] = []
    for mode in MODES:
        for op in ("all_gather", "reduce_scatter"):
            for world in sorted({r["world_size"] for r in uneven}):
                groups.append((mode, op, world))
        groups.append((mode, "both", "all"))
    for mode, op, world in groups:
        pts = [r for r in uneven if (op == "both" or r["op"] == op) and (world == "all" or r["world_size"] == world)]
        xs = [r["imbalance"] for r in pts]
        ys = [r[f"{mode}_ratio"] for r in pts]
        a, s = _free_fit(xs, ys)
        fits.append({"mode": mode, "op": op, "world_size": world, "points": len(pts),
                     "slope_through_even": common.fit_slope(xs, ys), "free_intercept": a, "free_slope": s})
    return fits


def fitted_uneven_slope(fits: list[dict[str, Any]]) -> dict[str, float]:
    """What planner/cost/collective_prices.py:UNEVEN_SLOPE should hold: the through-even slope per mode, >= 0, 2 digits.

    A negative fit (uneven faster than even: the even path uses a slower algorithm on this backend)
    is clamped to 0: the planner's rho search needs a non-negative slope.
    """
    return {f["mode"]: round(max(0.0, f["slope_through_even"]), 2) for f in fits if f["op"] == "both"}


# ----------------------------------------------------------------------------- 3. memory vs the plan


def _memory(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    from cephalo_lightning.demo.gpt import GPT
    from cephalo_lightning.runtime.emulation.memory import MemoryTracker
    from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

    shares = list(cfg.memory_shares)
    torch.manual_seed(0)
    model = GPT(gpt_config(cfg))  # built before tracking: the unsharded originals are not resident later
    parameters = sum(p.numel() for p in model.parameters())
    x, y = _batch(cfg, rank)
    batch = [cfg.batch_per_rank] * world
    with MemoryTracker() as tracker:  # started before sharding: it sees the master shards being made
        sharded = ShardedModel(model, shares, observers=[tracker])  # it sees the buffers resized by hand too
        after_shard = tracker.current_bytes
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step_peaks, states = [], []
        for _ in range(cfg.memory_steps):
            tracker.reset_peak()
            sharded.backward(model.loss(model(x), y) * (batch[rank] / sum(batch)))
            optimizer.step()
            gc.collect()
            states.append(tracker.current_bytes)  # masters + grads + moments (+ Adam's step scalars)
            optimizer.zero_grad()
            step_peaks.append(tracker.peak_bytes)
    layout = sharded.layout
    return {
        "rank": rank, "share": shares[rank], "parameters": parameters,
        "owned_numel": layout.owned_numel(rank),
        "uneven_units": sum(not u.is_even for u in layout.units), "units": len(layout.units),
        "masters_bytes": after_shard, "state_bytes": states[-1], "peak_bytes": step_peaks[-1],
    }


def memory_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        predicted = STATE_BYTES_PER_PARAM * r["parameters"] * r["share"]
        rows.append({
            **r,
            "predicted_state_bytes": predicted,
            "state_over_predicted": r["state_bytes"] / predicted,
            "compute_bytes": r["peak_bytes"] - r["state_bytes"],
            "peak_over_predicted_state": r["peak_bytes"] / predicted,
        })
    return rows


# ----------------------------------------------------------------------------- driver


def _rank_main(rank: int, world: int, cfg: Config, parts: tuple[str, ...]) -> dict[str, Any]:
    return common.run_parts(parts, {"step": lambda: _step_time(rank, world, cfg),
                                    "collectives": lambda: _collectives(rank, world, cfg),
                                    "memory": lambda: _memory(rank, world, cfg)})


def run_benchmark(cfg: Config = Config(), parts: tuple[str, ...] = PARTS) -> dict[str, Any]:
    """Every measurement, as rows of plain data. Spawns gloo ranks (one group per world size)."""
    from cephalo_lightning.planner.cost.collective_prices import UNEVEN_SLOPE

    load = common.load_average()
    result: dict[str, Any] = {"config": asdict(cfg), "environment": common.environment_note(),
                              "step_time": [], "collectives": [], "collective_fits": [], "memory": [], "wall_s": {}}
    worlds = {2} if {"step", "memory"} & set(parts) else set()
    if "collectives" in parts:
        worlds |= set(cfg.worlds)
    for world in sorted(worlds):  # step time and memory run on 2 ranks, beside the W=2 collectives
        here = tuple(p for p in parts if p == "collectives" or world == 2)
        start = time.perf_counter()
        ranks = common.run_ranks(_rank_main, world, cfg, here)
        result["wall_s"][f"W={world}"] = time.perf_counter() - start
        if "step" in here:
            result["step_time"] += step_rows(ranks[0]["step"], cfg, world)
        if "collectives" in here:
            result["collectives"] += collective_rows(ranks[0]["collectives"], world, cfg)
        if "memory" in here:
            result["memory"] += memory_rows([r["memory"] for r in ranks])
    result["load_average"] = common.load_span(load)
    if result["collectives"]:
        result["collective_fits"] = fit_rows(result["collectives"])
        result["fitted_uneven_slope"] = fitted_uneven_slope(result["collective_fits"])
        result["uneven_slope_in_code"] = dict(UNEVEN_SLOPE)
    return result


def print_report(result: dict[str, Any]) -> None:
    print(result["environment"])
    print("Ratios compare variants measured in the same run, in alternating rounds (median of per-round ratios).\n")
    if result["step_time"]:
        row0 = result["step_time"][0]
        common.print_table(
            ["measure", "cephalo ms", "FSDP2 ms", "cephalo / FSDP2"],
            [[r["measure"], f"{r['cephalo_ms']:.1f}", f"{r['fsdp2_ms']:.1f}", f"{r['ratio_cephalo_over_fsdp2']:.3f}"]
             for r in result["step_time"]],
            title=(f"1. Step time, {row0['world_size']} gloo ranks, GPT {row0['parameters'] / 1e6:.2f}M params, "
                   f"{row0['tokens_per_rank']} tokens/rank, fp32, even shares, 1 micro-batch, {row0['rounds']} rounds "
                   "(goal: cephalo / FSDP2 <= 1.10)"),
        )
        print(f"   same data, same init, same AdamW steps ({row0['rounds'] + result['config']['step_warmup']}): "
              f"max |param difference| cephalo vs FSDP2 = {row0['max_abs_param_diff']:.2e} (the parameters moved by "
              f"up to {row0['max_abs_param_change']:.2e} from their init)\n")
    if result["collectives"]:
        slope = result["fitted_uneven_slope"]
        rows = []
        for r in result["collectives"]:
            model_p = 1 + slope["padded"] * r["imbalance"]
            model_e = 1 + slope["exact"] * r["imbalance"]
            rows.append([r["world_size"], r["op"], f"{r['max_share']:.2f}", f"{r['imbalance']:.2f}",
                         f"{r['even_ms']:.2f}", f"{r['padded_ratio']:.2f}", f"{model_p:.2f}",
                         f"{r['exact_ratio']:.2f}", f"{model_e:.2f}", f"{r['padded_over_exact']:.2f}", r["faster"]])
        mib = result["collectives"][0]["unit_mib"]
        common.print_table(
            ["W", "op", "rho", "W*rho-1", "even ms", "padded/even", "model", "exact/even", "model",
             "padded/exact", "faster"],
            rows,
            title=(f"2. One unit's collective ({mib:.0f} MiB fp32), time relative to the even split "
                   "(rank 0 stores rho, the others share the rest); model = 1 + s*(W*rho-1) with the fitted s"),
        )
        common.print_table(
            ["mode", "op", "W", "points", "s (through even)", "free fit: jump", "free fit: slope"],
            [[f["mode"], f["op"], f["world_size"], f["points"], f"{f['slope_through_even']:.2f}",
              f"{f['free_intercept'] - 1:+.2f}", f"{f['free_slope']:.2f}"] for f in result["collective_fits"]],
            title="   Fitted slopes: time(rho)/time(even) ~= 1 + s*(W*rho - 1)",
        )
        print(f"   -> UNEVEN_SLOPE fitted here: {slope}  (planner/cost/collective_prices.py held "
              f"{result['uneven_slope_in_code']} when this ran)")
        for world in sorted({r["world_size"] for r in result["collectives"]}):
            per = [r for r in result["collectives"] if r["world_size"] == world and r["imbalance"] > 0]
            for op in ("all_gather", "reduce_scatter"):
                wins = {r["max_share"]: r["faster"] for r in per if r["op"] == op}
                kinds = set(wins.values())
                if len(kinds) == 1:
                    verdict = f"{kinds.pop()} is faster at every tested imbalance"
                else:
                    verdict = ", ".join(f"rho={k:.2f}: {v}" for k, v in wins.items())
                print(f"   W={world} {op}: {verdict}")
        print()
    if result["memory"]:
        rows = [[r["rank"], f"{r['share']:.2f}", r["owned_numel"], common.mib(r["predicted_state_bytes"]),
                 common.mib(r["state_bytes"]), f"{r['state_over_predicted']:.4f}", common.mib(r["peak_bytes"]),
                 common.mib(r["compute_bytes"]), f"{r['peak_over_predicted_state']:.2f}"] for r in result["memory"]]
        r0 = result["memory"][0]
        common.print_table(
            ["rank", "share", "owned params", "predicted state MiB", "measured state MiB", "measured/predicted",
             "peak MiB", "peak - state MiB", "peak/predicted state"],
            rows,
            title=(f"3. Accounted memory per rank (MemoryTracker, active from before sharding), shares "
                   f"{[r['share'] for r in result['memory']]}, {r0['parameters']} params, AdamW; "
                   f"{r0['uneven_units']} of {r0['units']} units uneven"),
        )
        print("   predicted state = 16 B/param (fp32 master + fp32 grad + 2 AdamW moments) x parameters x share, "
              "as the planner prices it;\n   measured state = live accounted bytes right after optimizer.step() "
              "(before zero_grad); peak includes gathered units and activations (the planner's compute memory).\n")
    print("wall time per spawned group: " + ", ".join(f"{k} {v:.1f} s" for k, v in result["wall_s"].items()))
    print(common.load_note(*result["load_average"]))
    if "total_s" in result:
        print(f"total {result['total_s']:.1f} s")


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", type=comma_list(PARTS), default=PARTS, help=f"comma-separated subset of {','.join(PARTS)}")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``--quick``: fewer rounds, W = 2 and 3 only (under a minute)."""
    start = time.perf_counter()
    result = run_benchmark(QUICK if args.quick else Config(), args.parts)
    return {**result, "total_s": time.perf_counter() - start}


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
