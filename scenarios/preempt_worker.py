"""One preempted fit (benchmarks/bench_preemption.py): ``Trainer.fit`` under ``CephaloStrategy`` as a
SLURM job with requeueing, stopped by SIGUSR1.

``python scenarios/preempt_worker.py WORKDIR DEPTH ASYNC``: a TinyLM of width :data:`DIM` and
``DEPTH`` blocks (AdamW, fp32, one CPU rank; about ``12.6 M x DEPTH`` parameters) trains on random
tokens with a sharded checkpoint, written in the background when ``ASYNC`` is ``1``. After step
:data:`READY_AT` it writes ``ready`` (its step times so far, and the checkpoint's size in bytes of
the training state) and trains on; the benchmark then sends SIGUSR1. The strategy's preemption
handling stops at the next step boundary, saves ``last-preempted.ckpt`` under WORKDIR, runs
``scontrol requeue`` (absent here: logged, not retried) and exits with 138.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment

from cephalo_lightning import CephaloStrategy
from tests import helpers
from tests.lightning_models import TinyLayered, loader, token_data
from tests.tiny_lm import TinyLM

DIM, VOCAB, READY_AT, GLOBAL = 1024, 1024, 3, 4


class Wide(TinyLayered):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.model = TinyLM(vocab=VOCAB, dim=DIM, depth=depth)


class Ready(pl.Callback):
    def __init__(self, work: Path) -> None:
        self.work = work
        self.times: list[float] = [time.perf_counter()]

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter())
        if trainer.global_step == READY_AT:
            params = sum(p.numel() for p in module.parameters())
            steps = [b - a for a, b in zip(self.times[1:], self.times[2:])]
            # on disk: the fp32 weights and AdamW's two moments
            (self.work / "ready").write_text(json.dumps({"time": time.time(), "parameters": params,
                                                          "state_bytes": 12 * params, "step_s": steps}))


def main(work: Path, depth: int, background: bool) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    strategy = CephaloStrategy(state_dict_type="sharded", async_checkpoint=background)
    trainer = helpers.trainer(strategy, 1, 10_000, default_root_dir=str(work), callbacks=[Ready(work)],
                              plugins=[SLURMEnvironment(auto_requeue=True)])
    trainer.fit(Wide(depth), loader(token_data(64, seq=8, vocab=VOCAB), GLOBAL))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1")
