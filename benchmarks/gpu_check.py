"""One-shot GPU check: the CUDA paths the CPU test suite cannot run, on one GPU, in a few minutes.

    python -m benchmarks.gpu_check            # on a machine with one CUDA GPU; writes docs/benchmarks/gpu.md
    python -m benchmarks.gpu_check --dry-run  # the same skeleton on CPU (tiny sizes; CUDA-only rows say skipped)

Rows (every figure MEASURED on the GPU it ran on; nothing emulated except where a row says so):

1. ``profiling``: one layer's forward + backward timed by the profiler (CUDA events) beside the
   kernel time ``torch.profiler`` records for the same calls (ratio near 1: the events time kernels);
2. ``layered fit``: ``strategy="cephalo"``, 1 rank, bf16-mixed, layered schedule with the stash
   offloaded to pinned host memory on the copy stream, under an EMULATED memory cap
   (``torch.cuda.set_per_process_memory_fraction``): tokens/s and peak memory;
3. ``fsdp2``: the same model, data and precision under Lightning's ``ModelParallelStrategy``
   (FSDP2): tokens/s and peak memory; the ratio to row 2;
4. ``two ranks, one GPU``: NCCL refuses two ranks on one device, so two processes on the one GPU
   try NCCL, then gloo with CUDA tensors (``collective="exact"``), and the gloo run's parameters are
   compared with single-process training on the same global batches.

The table is printed and written as markdown (``--out``).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPORT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "gpu.md"


@dataclass(frozen=True)
class Row:
    check: str
    status: str  # ok | failed | skipped | refused (an expected refusal)
    figure: str
    note: str = ""


@dataclass(frozen=True)
class Sizes:
    preset: str = "gpt2-124m"
    seq_len: int = 512
    batch: int = 16
    steps: int = 30
    warmup: int = 5
    memory_cap_gb: float = 8.0


DRY = Sizes(preset="tiny", seq_len=32, batch=4, steps=4, warmup=1, memory_cap_gb=1.0)


def _device() -> Any:
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _data(sizes: Sizes) -> Any:
    from cephalo_lightning.demo import TextDataModule

    return TextDataModule(seq_len=sizes.seq_len, batch_size=sizes.batch,
                          max_train_samples=sizes.batch * (sizes.steps + 2), max_val_samples=sizes.batch)


def _module(sizes: Sizes, fsdp2: bool = False) -> Any:
    from cephalo_lightning.demo import GPTModule

    if not fsdp2:
        module = GPTModule(preset=sizes.preset, seq_len=sizes.seq_len, warmup_steps=2)
        module.configure_model()  # built now, from the seed: every strategy compared starts from the same weights
        return module
    from torch.distributed.fsdp import fully_shard

    class FSDP2Module(GPTModule):
        def configure_model(self) -> None:
            super().configure_model()  # builds the GPT (a no-op when built already)
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    module = FSDP2Module(preset=sizes.preset, seq_len=sizes.seq_len, warmup_steps=2)
    GPTModule.configure_model(module)  # built now, from the seed: every strategy compared starts from the same weights
    return module


# ----------------------------------------------------------------------------- 1. profiling


def check_profiling(sizes: Sizes) -> Row:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from cephalo_lightning.demo.gpt import GPT, GPTConfig
    from cephalo_lightning.profiling import profile_layer

    device = _device()
    if device.type != "cuda":
        return Row("profiling: CUDA events vs torch.profiler", "skipped", "-", "no CUDA device (dry run)")
    config = GPTConfig.preset(sizes.preset, seq_len=sizes.seq_len)
    block = GPT(config).blocks[0].to(device)
    x = torch.randn(4, sizes.seq_len, config.n_embd, device=device)
    measured = profile_layer(block, lambda m: x[:m], [4], device=device, repeats=5, min_region_ms=5.0)
    events_ms = measured.fwd_ms[0] + measured.backward_pass_ms[0]
    work = block
    grad = torch.randn_like(x)
    for _ in range(3):  # warm
        work(x.requires_grad_(True)).backward(grad)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            with torch.no_grad():
                work(x)
            y = work(x.detach().requires_grad_(True))
            y.backward(grad)
        torch.cuda.synchronize()
    kernel_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / 10
    return Row("profiling: CUDA events vs torch.profiler", "ok",
               f"events {events_ms:.3f} ms, kernels {kernel_ms:.3f} ms, ratio {events_ms / kernel_ms:.2f}",
               "one block, micro-batch 4: the no-grad forward plus the recompute and backward")


# ----------------------------------------------------------------------------- 2. and 3. fits


def _fit(sizes: Sizes, strategy: Any, module: Any, precision: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch

    device = _device()
    times: list[float] = []

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if device.type == "cuda":
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = pl.Trainer(strategy=strategy, accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                         max_steps=sizes.steps, precision=precision, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[Clock()])
    trainer.fit(module, _data(sizes))
    steady = sorted(times[sizes.warmup:]) or times
    step_s = steady[len(steady) // 2]
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"tokens_per_s": sizes.batch * sizes.seq_len / step_s, "peak_gb": peak, "step_s": step_s,
            "trainer": trainer}


def check_layered_fit(sizes: Sizes) -> tuple[Row, dict[str, Any] | None]:
    from cephalo_lightning import CephaloStrategy, Plan
    from cephalo_lightning.planner import RankPlan

    device = _device()
    plan = Plan(sizes.batch, "layered", (RankPlan(0, "gpu", sizes.batch, 4, -(-sizes.batch // 4), 1.0),))
    cap = [{"memory_gb": sizes.memory_cap_gb}] if device.type == "cuda" else None  # a CPU dry run caps nothing
    strategy = CephaloStrategy(plan=plan, offload=True, emulate=cap, check_devices=False)
    precision = "bf16-mixed" if device.type == "cuda" else "32-true"
    result = _fit(sizes, strategy, _module(sizes), precision)
    run = result["trainer"].strategy.fit_runtime
    streams = run.sharded.comm.streams is not None
    note = (f"4 micro-batches, stash offloaded (pinned host, copy stream: {'yes' if streams else 'no'}), "
            f"emulated cap {sizes.memory_cap_gb:g} GiB" if device.type == "cuda" else "CPU dry run: no cap, no streams")
    return Row("layered fit (cephalo, 1 rank)", "ok",
               f"{result['tokens_per_s']:.0f} tokens/s, peak {result['peak_gb']:.2f} GiB", note), result


def check_fsdp2(sizes: Sizes, layered: dict[str, Any] | None) -> Row:
    from lightning.pytorch.strategies import ModelParallelStrategy

    device = _device()
    if device.type != "cuda":
        return Row("fsdp2 (ModelParallelStrategy, 1 rank)", "skipped", "-", "dry run: FSDP2's comparison needs the GPU")
    result = _fit(sizes, ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), _module(sizes, True),
                  "bf16-mixed")
    ratio = f", cephalo/fsdp2 tokens/s {layered['tokens_per_s'] / result['tokens_per_s']:.2f}" if layered else ""
    return Row("fsdp2 (ModelParallelStrategy, 1 rank)", "ok",
               f"{result['tokens_per_s']:.0f} tokens/s, peak {result['peak_gb']:.2f} GiB{ratio}",
               "same model, data and precision; one micro-batch per step")


# ----------------------------------------------------------------------------- 4. two ranks on one GPU


def _tiny_gpt() -> Any:
    import torch

    from cephalo_lightning.demo.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", seq_len=16))


def _token_batches(steps: int) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (8, 17), generator=gen) for _ in range(steps)]


def _two_ranks(rank: int, world: int, backend: str, sizes: dict) -> dict[str, Any]:
    import warnings

    import torch
    import torch.distributed as dist

    from cephalo_lightning.demo.gpt import GPT
    from cephalo_lightning.runtime.layered import LayeredSchedule, plain_input
    from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

    warnings.simplefilter("ignore")
    device = _device()
    if backend != dist.get_backend():  # run_local_ranks starts gloo; switch for the NCCL attempt
        dist.destroy_process_group()
        dist.init_process_group(backend, rank=rank, world_size=world)
    model = _tiny_gpt().to(device)
    layers = model.layers()
    sharded = ShardedModel(model, [0.3, 0.7], units=layers, collective="exact", device=device)
    schedule = LayeredSchedule(sharded, layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    local = [5, 3]
    lo = sum(local[:rank])
    for tokens in _token_batches(sizes["steps"]):
        x, y = tokens[lo : lo + local[rank], :-1].to(device), tokens[lo : lo + local[rank], 1:].to(device)
        forward_pass = schedule.forward([x], plain_input, lambda k, out, side: GPT.loss(out, y), [local[rank] / 8])
        schedule.backward(forward_pass)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.cpu() for k, v in sharded.full_state_dict().items()}


def check_two_ranks(sizes: Sizes) -> list[Row]:
    import torch

    from cephalo_lightning.demo.gpt import GPT
    from cephalo_lightning.testing.local_ranks import run_local_ranks

    rows = []
    steps = {"steps": max(2, sizes.steps // 10)}
    device = _device()
    if device.type == "cuda":
        try:
            run_local_ranks(_two_ranks, 2, "nccl", steps)
            rows.append(Row("two ranks, one GPU: NCCL", "ok", "ran", "NCCL accepted two ranks on one device"))
        except Exception as err:  # noqa: BLE001 - the refusal is the finding
            rows.append(Row("two ranks, one GPU: NCCL", "refused", "-", str(err).strip().splitlines()[-1][:160]))
    try:
        got = run_local_ranks(_two_ranks, 2, "gloo", steps)[0]
    except Exception as err:  # noqa: BLE001
        return rows + [Row("two ranks, one GPU: gloo, CUDA tensors", "failed", "-",
                           str(err).strip().splitlines()[-1][:160])]
    reference = _tiny_gpt().to(device)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for tokens in _token_batches(steps["steps"]):
        GPT.loss(reference(tokens[:, :-1].to(device)), tokens[:, 1:].to(device)).backward()
        optimizer.step()
        optimizer.zero_grad()
    error = max((got[k] - v.detach().cpu()).abs().max().item() for k, v in reference.named_parameters())
    tensors = "CUDA tensors" if device.type == "cuda" else "CPU tensors (dry run)"
    return rows + [Row(f"two ranks, one GPU: gloo, {tensors}", "ok" if error < 1e-5 else "failed",
                       f"max |param - single process| = {error:.1e}",
                       "layered schedule, shares [0.3, 0.7], exact collectives (point-to-point gathers)")]


# ----------------------------------------------------------------------------- report


def run(dry_run: bool) -> list[Row]:
    import torch

    sizes = DRY if dry_run else Sizes()
    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; use --dry-run for the CPU skeleton")
    rows: list[Row] = []
    for name, check in (("profiling", lambda: [check_profiling(sizes)]),):
        rows += _guarded(name, check)
    layered: list[dict[str, Any] | None] = [None]

    def fit_rows() -> list[Row]:
        row, layered[0] = check_layered_fit(sizes)
        return [row]

    rows += _guarded("layered fit", fit_rows)
    rows += _guarded("fsdp2", lambda: [check_fsdp2(sizes, layered[0])])
    rows += _guarded("two ranks", lambda: check_two_ranks(sizes))
    return rows


def _guarded(name: str, check: Any) -> list[Row]:
    try:
        return check()
    except Exception as err:  # noqa: BLE001 - every check reports instead of stopping the others
        return [Row(name, "failed", "-", f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                    + ("" if str(err) else traceback.format_exc().splitlines()[-1]))]


def render(rows: list[Row], dry_run: bool) -> str:
    import torch

    where = (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}" if torch.cuda.is_available()
             else f"CPU dry run, torch {torch.__version__}")
    lines = [f"# GPU check ({where})", "", "| check | status | figure (measured) | note |", "|---|---|---|---|"]
    lines += [f"| {r.check} | {r.status} | {r.figure} | {r.note} |" for r in rows]
    if dry_run:
        lines += ["", "A dry run on CPU: the figures say nothing about GPUs; it only proves the script runs."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="the CPU skeleton, tiny sizes (what the tests run)")
    parser.add_argument("--out", default=None,
                        help=f"where to write the markdown table (default: {REPORT.name} in the report folder; a dry run "
                             "writes only where this says)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = run(args.dry_run)
    text = render(rows, args.dry_run)
    print(json.dumps([asdict(r) for r in rows], indent=1) if args.json else text)
    print(f"({time.perf_counter() - started:.0f} s)")
    out = Path(args.out) if args.out else (None if args.dry_run else REPORT)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    return 0 if all(r.status in ("ok", "skipped", "refused") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
