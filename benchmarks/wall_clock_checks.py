"""Wall-clock acceptance checks: the speed properties that tests must not time.

    python -m benchmarks.wall_clock_checks            # every check; exit 1 if one fails
    python -m benchmarks.wall_clock_checks planner    # only the planner's (a few seconds)
    python -m benchmarks.wall_clock_checks emulated   # only the emulated speed-up (about a minute)
    python -m benchmarks.wall_clock_checks profiled   # only the profiled slowdown (about 20 s)

The test suite asserts what is deterministic (valid plans, clear refusals, the plan's shape, the
planner's predicted speed-up); how long something takes on this machine is measured here, on a
machine quiet enough to mean it. Each check prints its figure and its bound.

1. ``planner``: 64 GPUs of 4 kinds at B = 4,096 plan in under a second (best of 3); the two
   requests above the planner's limits (B = 10^9 on 4 GPUs, 10^6 GPUs) are refused in under 10 s
   and the largest batch on 4 GPUs plans in under 60 s, each in a fresh torch-free interpreter
   under a 2 GiB address-space limit.
2. ``emulated``: on 2 gloo ranks, rank 1 EMULATED 4x slower (``slowdown`` sleeps after each
   compute region; no memory cap), profiled once by ``CephaloCallback``, the Cephalo plan trains
   the demo GPT faster than the ``even`` plan of the same profiled cluster: measured side by side,
   alternating rounds of short ``Trainer.fit`` runs (same seed, same data), samples/s = global
   batch / median over batches of the slowest rank's time for that batch.

   Why the bound 1.2: the planner predicts 2.2-2.8x here (the profile varies a little run to run).
   Measured on a shared 2-core machine already loaded by other programs (load average 2-3), the
   ratio came out 1.79-2.54 in 10 runs (per-round ratios 1.43-2.75), and 1.66 and 1.83 in 2 runs
   with a second 2-rank benchmark running beside it (per-round 1.55-2.03). Host contention only
   slows the fast rank's real compute, never the slow rank's emulated wait, so load pulls the
   ratio towards 1; 1.2 leaves that margin and still fails if the plan stopped helping: with both
   ranks at x1 (the two plans then coincide) the same check measured 0.93 and 0.95.

3. ``profiled``: on 2 gloo ranks, rank 1 EMULATED 3x slower (with a 0.05 GiB cap), the profiler
   recovers the slowdown: the slow device's summed layer times over the fast one's within 15% of 3.
   The two ranks are measured at different moments, so one burst of foreign load on a shared host
   can inflate a whole turn; run it on a quiet machine.

   Exits: the ranks return their raw per-batch times and the parent combines them, so a rank's
   last collective is not an all-reduce of its own (gloo's worker thread may still be releasing
   the last collective's tensors when the spawned process finalizes Python; pytorch#190489).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from cephalo_lightning.planner import (
    load_cluster,  # noqa: E402 - torch-free
    plan,  # noqa: E402 - torch-free
)
from cephalo_lightning.planner.schema.limits import MAX_GLOBAL_BATCH  # noqa: E402

CLUSTERS = ROOT / "configs" / "clusters"
KINDS = ["h100", "a100-80gb", "a100-40gb", "l40s", "a6000", "v100-32gb", "l4", "t4"]
GPT67 = {"name": "gpt-6.7b", "num_layers": 32, "parameters": 6658203648, "hidden_size": 4096, "seq_len": 1024}
MEMORY_LIMIT = 2 * 2**30

EMULATE = [{"slowdown": 1.0}, {"slowdown": 4.0}]
SEQ = 64
GLOBAL_BATCH = 16
ROUNDS = 3
WARMUP = 2  # batches skipped at the start of every fit
MEASURED = 5
MIN_SPEEDUP = 1.2


def _check(name: str, value: float, bound: float, unit: str, below: bool = True) -> bool:
    ok = value < bound if below else value > bound
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {value:.3g}{unit} ({'<' if below else '>'} {bound:g}{unit})")
    return ok


# ----------------------------------------------------------------------------- planner


def _limited_plan_seconds(args: list[str]) -> tuple[int, float]:
    """The ``plan`` CLI in a fresh torch-free interpreter under the memory limit: (rc, seconds)."""
    code = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))
        for name in ("torch", "lightning", "pytorch_lightning"):
            sys.modules[name] = None
        from cephalo_lightning.planner.command import main
        sys.exit(main({args!r}))
    """)
    env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    return result.returncode, time.perf_counter() - start


def _exit_code(name: str, rc: int, want: int) -> bool:
    if rc != want:
        print(f"FAIL {name}: exit code {rc}, expected {want}")
    return rc == want


def check_planner(workdir: Path) -> bool:
    cluster = load_cluster(CLUSTERS / "hetero-64.yaml")
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        plan(cluster, 4096)
        best = min(best, time.perf_counter() - start)
    ok = _check("64 GPUs at B=4096 plan", best, 1.0, " s")
    rc, seconds = _limited_plan_seconds([str(CLUSTERS / "l4-a6000-p40.yaml"), "--global-batch-size", "1000000000"])
    ok &= _exit_code("B=10^9 on 4 GPUs", rc, 2) and _check("B=10^9 on 4 GPUs refused", seconds, 10, " s")
    million = workdir / "million.json"
    million.write_text(json.dumps({"model": GPT67, "settings": {"link_bandwidth_gbps": 50},
                                   "devices": [{"name": k, "count": 125_000} for k in KINDS]}))
    rc, seconds = _limited_plan_seconds([str(million), "-b", "65536"])
    ok &= _exit_code("10^6 GPUs", rc, 2) and _check("10^6 GPUs refused", seconds, 10, " s")
    rc, seconds = _limited_plan_seconds([str(CLUSTERS / "l4-a6000-p40.yaml"), "-b", str(MAX_GLOBAL_BATCH), "--json"])
    ok &= _exit_code(f"B={MAX_GLOBAL_BATCH:,} on 4 GPUs", rc, 0) and _check(f"B={MAX_GLOBAL_BATCH:,} on 4 GPUs plans",
                                                                           seconds, 60, " s")
    return bool(ok)


# ----------------------------------------------------------------------------- emulated speed-up


def _module():
    from cephalo_lightning.demo import GPTModule

    module = GPTModule(preset="small", seq_len=SEQ, warmup_steps=2, lr_decay_steps=WARMUP + MEASURED)
    module.configure_model()  # built now, from the seed: every strategy compared starts from the same weights
    return module


def _data():
    from cephalo_lightning.demo import TextDataModule

    return TextDataModule(seq_len=SEQ, batch_size=GLOBAL_BATCH)


def _trainer(strategy, steps: int, callbacks: list):
    import lightning.pytorch as pl

    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        use_distributed_sampler=False, callbacks=callbacks,
    )


def _timer():
    from lightning.pytorch.callbacks import Callback

    class BatchEnds(Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.ends.append(time.perf_counter())

    return BatchEnds()


def _side_by_side(rank: int, world: int) -> dict:
    import lightning.pytorch as pl

    from cephalo_lightning import CephaloCallback, CephaloStrategy
    from cephalo_lightning.planner import plan as make_plan

    warnings.simplefilter("ignore")
    callback = CephaloCallback(max_micro_batch=4, cache_dir=None, watch_every_n_steps=0, print_plan=False, quiet=True)
    pl.seed_everything(0, verbose=False)
    _trainer(CephaloStrategy(emulate=EMULATE), 1, [callback]).fit(_module(), _data())  # profile once
    cluster = callback.cluster
    plans = {name: make_plan(cluster, GLOBAL_BATCH, mode="layered", planner=name) for name in ("cephalo", "even")}
    iterations: dict[str, list[list[float]]] = {name: [] for name in plans}  # per round: seconds per batch
    for i in range(ROUNDS):
        for name in (["cephalo", "even"] if i % 2 == 0 else ["even", "cephalo"]):
            timer = _timer()
            pl.seed_everything(0, verbose=False)
            _trainer(CephaloStrategy(plan=plans[name], emulate=EMULATE), WARMUP + MEASURED, [timer]).fit(_module(), _data())
            iterations[name].append([b - a for a, b in zip(timer.ends, timer.ends[1:])][WARMUP - 1:])
    return {"plans": {k: (p.batch_sizes, p.num_micro_batches, p.predicted_samples_per_s) for k, p in plans.items()},
            "iterations": iterations, "slowdowns": [d.emulate.slowdown for d in cluster.devices]}


def _samples_per_s(per_rank: list[dict], name: str) -> list[float]:
    """Per round: global batch / median over batches of the slowest rank's time for that batch."""
    rounds = zip(*(r["iterations"][name] for r in per_rank))
    return [GLOBAL_BATCH / statistics.median(max(ts) for ts in zip(*per_batch)) for per_batch in rounds]


def check_emulated() -> bool:
    from cephalo_lightning.testing.local_ranks import run_local_ranks

    per_rank = run_local_ranks(_side_by_side, 2)
    result = per_rank[0]
    plans = result["plans"]
    measured = {name: _samples_per_s(per_rank, name) for name in plans}
    (c_batch, c_micro, c_pred), (e_batch, e_micro, e_pred) = plans["cephalo"], plans["even"]
    per_round = [c / e for c, e in zip(measured["cephalo"], measured["even"])]
    ratio = statistics.median(per_round)
    print(f"EMULATED cluster on CPU (slowdowns {result['slowdowns']}), global batch {GLOBAL_BATCH}:\n"
          f"  cephalo plan batches {c_batch} micro-batches {c_micro}: measured "
          f"{statistics.median(measured['cephalo']):.1f} samples/s, predicted {c_pred:.1f}\n"
          f"  even plan    batches {e_batch} micro-batches {e_micro}: measured "
          f"{statistics.median(measured['even']):.1f} samples/s, predicted {e_pred:.1f}\n"
          f"  rounds {', '.join(f'{r:.2f}' for r in per_round)}, predicted {c_pred / e_pred:.2f}")
    return _check("cephalo / even measured", ratio, MIN_SPEEDUP, "x", below=False)


# ----------------------------------------------------------------------------- profiled slowdown

PROFILED_SLOWDOWN = 3.0
PROFILED_TOLERANCE = 0.15


def _profile_slow_pair(rank: int, world_size: int) -> float:
    """The slow device's summed layer times over the fast one's, as the profiler measured them."""
    import torch

    from cephalo_lightning.demo.gpt import GPT, GPTConfig
    from cephalo_lightning.profiling import ClusterProfiler, ModelDescription, ProfileOptions

    torch.manual_seed(0)
    layers = GPT(GPTConfig.preset("small", seq_len=64)).layers()
    sample = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    emulate = [{"slowdown": 1}, {"slowdown": PROFILED_SLOWDOWN, "memory_gb": 0.05}]
    options = ProfileOptions(max_micro_batch=4, collective_modes=("padded", "exact"))
    fast, slow = ClusterProfiler(layers, sample, ModelDescription(name="gpt-small"), emulate=emulate, options=options,
                                 quiet=True).run().cluster.devices
    return (sum(slow.layer_fwd_ms) + sum(slow.layer_bwd_ms)) / (sum(fast.layer_fwd_ms) + sum(fast.layer_bwd_ms))


def check_profiled() -> bool:
    from cephalo_lightning.testing.local_ranks import run_local_ranks

    ratio = run_local_ranks(_profile_slow_pair, 2)[0]
    error = abs(ratio / PROFILED_SLOWDOWN - 1)
    print(f"EMULATED x{PROFILED_SLOWDOWN:g} device profiled at x{ratio:.2f}")
    return _check("profiled slowdown, relative error", error, PROFILED_TOLERANCE, "")


CHECKS = ("planner", "emulated", "profiled")


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checks", nargs="*", choices=CHECKS, help="default: all")
    checks = parser.parse_args(argv).checks or list(CHECKS)
    ok = True
    with tempfile.TemporaryDirectory() as workdir:
        if "planner" in checks:
            ok &= check_planner(Path(workdir))
        if "emulated" in checks:
            ok &= check_emulated()
        if "profiled" in checks:
            ok &= check_profiled()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
