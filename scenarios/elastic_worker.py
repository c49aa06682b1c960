"""One rank of the two-agent elastic run (tests/lightning/fit/test_elastic_torchrun.py), started by torchrun.

``python scenarios/elastic_worker.py WORKDIR``; the agent's environment says which "node" it is
(``ELASTIC_NODE``: ``A``, two ranks, or ``B``, one). Every start resumes with
``fit(ckpt_path="last")`` under a plan pinned for 3 ranks and ``CephaloStrategy(elastic=True)``.
Two instrumented points drive the run, each a file in WORKDIR as well:

* **the kill**: node B's rank, in its first life, after optimizer step :data:`KILL_AT` and before
  that step's checkpoint (the checkpoint callback runs after this one), SIGKILLs its agent and
  itself: the node is gone, mid-run (``killed``: the wall-clock time of the kill);
* **the grow point**: a run with fewer than 3 ranks, after step :data:`GROW_AT`, writes ``grow``
  and waits until the agent stops it for the next rendezvous (its SIGTERM, recorded by the
  strategy's preemption handling, which then saves at the next step boundary and exits).

Every start appends a line to ``lives.jsonl`` (node, rank, world, the plan's batches); the first
step after the kill writes ``recovered`` (its time); the finished run's rank 0 writes ``final.pt``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from cephalo_lightning import CephaloStrategy
from tests import helpers
from tests.plans import plan_of
from tests.sgd_run import GLOBAL, SEED, SGDModule, data_loader

KILL_AT, GROW_AT, TOTAL = 3, 5, 9
WAIT_FOR_AGENT_S = 600  # the grow point's wait for the agent's stop; past it the run fails
# emulated capacities name the devices: node A holds a big and a mid device, node B a small one
MEMORY_GB = {("A", 0): 3.0, ("A", 1): 2.0, ("B", 0): 1.0}


def device_name(memory_gb: float) -> str:
    return f"cpu (emulated x1.0, {memory_gb:g} GiB)"


PLAN3 = plan_of(batches=[6, 4, 2], micro=[2, 2, 1], shares=[0.5, 0.3, 0.2], devices=[device_name(m) for m in (3.0, 2.0, 1.0)])
assert PLAN3.global_batch_size == GLOBAL


class Instrumented(pl.Callback):
    def __init__(self, work: Path, node: str, world: int) -> None:
        self.work, self.node, self.world = work, node, world
        self.first_step = True

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step
        if self.first_step and trainer.is_global_zero and (self.work / "killed").exists() \
                and not (self.work / "recovered").exists():
            (self.work / "recovered").write_text(json.dumps({"time": time.time(), "step": step}))
        self.first_step = False
        if self.node == "B" and step == KILL_AT and not (self.work / "killed").exists():
            (self.work / "killed").write_text(json.dumps({"time": time.time(), "step": step}))
            os.kill(os.getppid(), signal.SIGKILL)  # the agent: the node is lost with its ranks
            os.kill(os.getpid(), signal.SIGKILL)
        if self.world < 3 and step == GROW_AT:
            if trainer.is_global_zero:
                (self.work / "grow").write_text(str(time.time()))
            deadline = time.monotonic() + WAIT_FOR_AGENT_S
            while not trainer.strategy._preemption.pending():  # the agent's SIGTERM, recorded
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no restart by the agent within {WAIT_FOR_AGENT_S} s of the grow point")
                time.sleep(0.05)


def main(work: Path) -> None:
    warnings.simplefilter("ignore")
    node, local, world = os.environ["ELASTIC_NODE"], int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    mine = {"slowdown": 1.0, "memory_gb": MEMORY_GB[node, local]}
    emulate = [mine] * world  # only this rank's entry is this rank's device
    strategy = CephaloStrategy(plan=PLAN3, seed=SEED, elastic=True, emulate=emulate)
    saver = ModelCheckpoint(dirpath=str(work / "ckpt"), save_top_k=0, save_last=True, every_n_train_steps=1)
    trainer = helpers.trainer(strategy, int(os.environ["LOCAL_WORLD_SIZE"]), TOTAL, precision="64-true",
                              default_root_dir=str(work), enable_checkpointing=True,
                              callbacks=[Instrumented(work, node, world), saver])
    life = {"node": node, "rank": rank, "world": world, "pid": os.getpid(),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "start": time.time()}
    try:
        # the first start from the reference's initialisation; a resume from another one, so that
        # everything it continues from must come from the checkpoint
        resumes = (work / "ckpt" / "last.ckpt").exists()
        trainer.fit(SGDModule(seed=3) if resumes else SGDModule(), data_loader(True), ckpt_path="last")
    finally:
        life.update(batches=trainer.strategy.plan.batch_sizes if trainer.strategy.plan else None,
                    planner=trainer.strategy.plan.planner if trainer.strategy.plan else None,
                    step=trainer.global_step)
        with open(work / "lives.jsonl", "a") as out:
            out.write(json.dumps(life) + "\n")
    state = trainer.strategy.sharded.full_state_dict()
    if trainer.is_global_zero:
        torch.save(state, work / "final.pt")
    # as PyTorch asks on a normal exit: gloo's threads may otherwise abort the interpreter's
    # teardown (exit -6), which torchrun answers by restarting the finished run
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
