"""On an emulated heterogeneous CPU cluster the Cephalo plan is predicted to train faster than the
even plan, and gives the slow rank the smaller batch.

2 gloo ranks, rank 1 EMULATED 4x slower (``slowdown`` sleeps after each compute region; no memory
cap), profiled once by ``CephaloCallback`` at setup; then the Cephalo plan and the ``even`` plan
of that profiled cluster. What is asserted does not depend on how busy the machine is: the plan's
shape and the planner's predicted speed-up (2.2-2.8x here; the profile varies a little run to run,
the 4x emulated wait dominates it). The MEASURED speed-up of the two plans trained side by side is
a wall-clock property, checked by ``benchmarks/wall_clock_checks.py emulated`` (bound 1.2, and why).
"""

from __future__ import annotations

import warnings

import pytest

from tests.distributed import run_distributed
from tests.helpers import trainer

EMULATE = [{"slowdown": 1.0}, {"slowdown": 4.0}]
SEQ = 64
GLOBAL_BATCH = 16
MIN_SPEEDUP = 1.2


def _profiled_plans(rank: int, world: int) -> dict:
    import lightning.pytorch as pl

    from cephalo_lightning import CephaloCallback, CephaloStrategy
    from cephalo_lightning.demo import GPTModule, TextDataModule
    from cephalo_lightning.planner import plan as make_plan

    warnings.simplefilter("ignore")
    callback = CephaloCallback(max_micro_batch=4, cache_dir=None, watch_every_n_steps=0, print_plan=False, quiet=True)
    pl.seed_everything(0, verbose=False)
    profiling = trainer(CephaloStrategy(emulate=EMULATE), world, 1, callbacks=[callback], limit_val_batches=0,
                        num_sanity_val_steps=0)
    profiling.fit(GPTModule(preset="small", seq_len=SEQ), TextDataModule(seq_len=SEQ, batch_size=GLOBAL_BATCH))
    cluster = callback.cluster
    plans = {name: make_plan(cluster, GLOBAL_BATCH, mode="layered", planner=name) for name in ("cephalo", "even")}
    return {"plans": {k: (p.batch_sizes, p.num_micro_batches, p.predicted_samples_per_s) for k, p in plans.items()},
            "slowdowns": [d.emulate.slowdown for d in cluster.devices]}


@pytest.mark.multiprocess
def test_cephalo_plan_trains_faster_than_the_even_plan_on_an_emulated_cluster():
    result = run_distributed(_profiled_plans, 2)[0]
    (c_batch, c_micro, c_pred), (e_batch, e_micro, e_pred) = result["plans"]["cephalo"], result["plans"]["even"]
    predicted = c_pred / e_pred
    print(f"\nEMULATED cluster on CPU (slowdowns {result['slowdowns']}), global batch {GLOBAL_BATCH}:\n"
          f"  cephalo plan batches {c_batch} micro-batches {c_micro}: predicted {c_pred:.1f} samples/s\n"
          f"  even plan    batches {e_batch} micro-batches {e_micro}: predicted {e_pred:.1f} samples/s")
    assert result["slowdowns"] == [1.0, 4.0]
    assert c_batch[1] < c_batch[0], "the profiled plan should give the emulated slow rank the smaller batch"
    assert list(e_batch) == [GLOBAL_BATCH // 2] * 2
    assert predicted > MIN_SPEEDUP, f"cephalo / even predicted {predicted:.2f}"
