"""On an emulated heterogeneous CPU cluster the Cephalo plan trains faster than the even plan.

Issue 6's acceptance, measured side by side in ONE run: 2 gloo ranks, rank 1 emulated 4x slower
(``slowdown`` sleeps after each compute region; no memory cap), profiled once by
``CephaloCallback`` at setup; then the Cephalo plan and the ``even`` plan of that profiled cluster
train the demo GPT through ``Trainer.fit`` in alternating rounds (same seed, same data), and the
throughputs are compared. Everything here is EMULATED on CPU.

Why the bound 1.2: the planner predicts 2.2-2.8x here (the profile varies a little run to run).
Measured on a shared 2-core machine already loaded by other programs (load average 2-3), the ratio
came out 1.79-2.54 in 10 runs (per-round ratios 1.43-2.75), and 1.66 and 1.83 in 2 runs with a
second 2-rank benchmark running beside it (per-round 1.55-2.03). Host contention only slows the
fast rank's real compute, never the slow rank's emulated wait, so load pulls the ratio towards 1;
1.2 leaves that margin and still fails if the plan stopped helping: with both ranks at x1 (the two
plans then coincide) the same test measured 0.93 and 0.95.

Exits: the ranks return their raw per-batch times and the test combines them, so a rank's last
collective is not an all-reduce of its own. Gloo's worker thread may still be releasing the last
collective's tensors when the spawned process finalizes Python, which aborts it (SIGABRT,
"terminate called without an active exception"; pytorch#190489); ending on an explicit all-reduce
hit that in 3 of 10 runs here, this way 0 of 8.
"""

from __future__ import annotations

import statistics
import time
import warnings

import pytest

from tests.distributed import run_distributed

EMULATE = [{"slowdown": 1.0}, {"slowdown": 4.0}]
SEQ = 64
GLOBAL_BATCH = 16
ROUNDS = 3
WARMUP = 2  # batches skipped at the start of every fit
MEASURED = 5
MIN_SPEEDUP = 1.2


def _module():
    from cephalo_lightning.demo import GPTModule

    return GPTModule(preset="small", seq_len=SEQ, warmup_steps=2, lr_decay_steps=WARMUP + MEASURED)


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
    # combined over the ranks by the caller: a rank's last collective must not be its own here
    # (see the module docstring's note on exits)
    return {"plans": {k: (p.batch_sizes, p.num_micro_batches, p.predicted_samples_per_s) for k, p in plans.items()},
            "iterations": iterations, "slowdowns": [d.emulate.slowdown for d in cluster.devices]}


def _samples_per_s(per_rank: list[dict], name: str) -> list[float]:
    """Per round: global batch / median over batches of the slowest rank's time for that batch."""
    rounds = zip(*(r["iterations"][name] for r in per_rank))
    return [GLOBAL_BATCH / statistics.median(max(ts) for ts in zip(*per_batch)) for per_batch in rounds]


@pytest.mark.multiprocess
def test_cephalo_plan_trains_faster_than_the_even_plan_on_an_emulated_cluster():
    per_rank = run_distributed(_side_by_side, 2)
    result = per_rank[0]
    plans = result["plans"]
    measured = {name: _samples_per_s(per_rank, name) for name in plans}
    (c_batch, c_micro, c_pred), (e_batch, e_micro, e_pred) = plans["cephalo"], plans["even"]
    per_round = [c / e for c, e in zip(measured["cephalo"], measured["even"])]
    ratio = statistics.median(per_round)
    predicted = c_pred / e_pred
    print(f"\nEMULATED cluster on CPU (slowdowns {result['slowdowns']}), global batch {GLOBAL_BATCH}:\n"
          f"  cephalo plan batches {c_batch} micro-batches {c_micro}: measured "
          f"{statistics.median(measured['cephalo']):.1f} samples/s, predicted {c_pred:.1f}\n"
          f"  even plan    batches {e_batch} micro-batches {e_micro}: measured "
          f"{statistics.median(measured['even']):.1f} samples/s, predicted {e_pred:.1f}\n"
          f"  cephalo / even: measured {ratio:.2f} (rounds {', '.join(f'{r:.2f}' for r in per_round)}), "
          f"predicted {predicted:.2f}")
    assert c_batch[1] < c_batch[0], "the profiled plan should give the emulated slow rank the smaller batch"
    assert predicted > MIN_SPEEDUP
    assert ratio > MIN_SPEEDUP, f"cephalo / even measured {ratio:.2f} (predicted {predicted:.2f}), rounds {per_round}"
