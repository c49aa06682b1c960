"""A run with failures (benchmarks/bench_ft_failures.py): the same two-group plan under ``Trainer.fit``, a
group killed every ``K`` steps, with fault tolerance or with checkpoint-restart.

Both ways train a tiny Hugging Face Llama (tests/library_models.LibraryLM, AdamW, fp32) on the planned
loader's global batches of :data:`GLOBAL` for ``N`` steps; group (or rank) 1 SIGKILLs itself in step
``s`` for every ``s`` in ``K, 2K, ...`` up to ``N - K``, once per step (a ``killed-S`` file marks it done),
after its backward and before the step commits: mid-step. Every attempt at a step waits :data:`DEVICE_STEP_S`
after its backward, on every rank: the device's compute, emulated as a fixed time (a GPU job's steps of seconds against
start-ups of seconds). A fixed wait rather than an emulated slowdown: a slowdown multiplies each compute
region's measured time, and on an idle host a region that runs right after a long wait runs cold and
measures several times longer, which the multiplier turns into minutes a step.

* ``python scenarios/failure_run.py WORK ft GROUP N K``: one life of one group (one rank) under
  ``CephaloStrategy(fault_tolerance=True)``; the benchmark starts group 1 again as soon as it dies
  (the node is back) and runs the lighthouse (``TORCHFT_LIGHTHOUSE``).
* ``torchrun --nproc-per-node 2 --max-restarts R scenarios/failure_run.py WORK cr - N K C``: both groups
  as one world (``CephaloStrategy`` without fault tolerance), a checkpoint every ``C`` steps, every
  start resuming from the newest (``fit(ckpt_path="last")``); torchrun restarts both ranks when one dies.

The groups' first lives wait for each other at ``on_train_start`` (``ready-G``), so the first quorum
holds both. Each process appends its pid to ``started`` as it starts (a life that fails before training
counts too); each life appends to ``lives.jsonl`` (way, group or rank, the step it starts at, the time); each
committed or redone step to ``steps-G.jsonl`` (fault tolerance: the replica group's history); the
run's end writes ``done-G`` (the time).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch

from tests.plans import plan_of

GLOBAL = 12
DEVICE_STEP_S = 3.0  # every step's emulated device compute, on every rank (see the module notes)
START_WAIT_S = 300  # how long a group's first life waits for the other's at the start
PG_TIMEOUT_S = 300  # checkpoint-restart: a collective stuck this long fails the rank, and torchrun restarts it
PLAN = plan_of(batches=[6, 6], micro=[1, 1], shares=[1.0, 1.0], devices=["cpu", "cpu"], groups=[0, 1])


class Failures(pl.Callback):
    """Kills group 1 mid-step at every multiple of ``every``; records the lives and the steps."""

    def __init__(self, work: Path, way: str, group: int, every: int, steps: int) -> None:
        self.work, self.way, self.group, self.every, self.steps = work, way, group, every, steps
        self.written = 0

    def on_train_start(self, trainer, module):
        if self.way == "ft" and not (self.work / f"ready-{self.group}").exists():
            # the first lives: the manager heartbeats now; both groups ask for the first quorum together
            (self.work / f"ready-{self.group}").write_text(str(time.time()))
            deadline = time.monotonic() + START_WAIT_S
            while not all((self.work / f"ready-{g}").exists() for g in (0, 1)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the other group did not start within {START_WAIT_S} s")
                time.sleep(0.02)
        with open(self.work / "lives.jsonl", "a") as out:
            out.write(json.dumps({"way": self.way, "group": self.group, "pid": os.getpid(),
                                  "start_step": trainer.global_step, "time": time.time()}) + "\n")

    def on_after_backward(self, trainer, module):
        time.sleep(DEVICE_STEP_S)  # the device's compute of this attempt (a redone step pays it again)
        step = trainer.global_step
        marker = self.work / f"killed-{step}"
        if self.group == 1 and 0 < step <= self.steps - self.every and step % self.every == 0 and not marker.exists():
            marker.write_text(json.dumps({"time": time.time(), "step": step}))
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        replica = getattr(trainer.strategy, "replica", None)
        with open(self.work / f"steps-{self.group}.jsonl", "a") as out:
            if replica is None:
                out.write(json.dumps({"step": trainer.global_step - 1, "committed": True, "time": time.time()}) + "\n")
            else:
                for part, committed in replica.history[self.written:]:
                    out.write(json.dumps({"step": part.step, "committed": committed, "time": time.time()}) + "\n")
                self.written = len(replica.history)

    def on_train_end(self, trainer, module):
        (self.work / f"done-{self.group}").write_text(str(time.time()))


def main(work: Path, way: str, group_arg: str, steps: int, every: int, checkpoint_every: int) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from cephalo_lightning import CephaloStrategy
    from tests import helpers
    from tests.library_models import LibraryLM, PaddedTokens, loader

    with open(work / "started", "a") as started:
        started.write(f"{os.getpid()}\n")
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    data = loader(PaddedTokens(steps * GLOBAL), GLOBAL)
    if way == "ft":
        group = int(group_arg)
        strategy = CephaloStrategy(plan=PLAN, fault_tolerance=True, replica_group=group, check_devices=False, seed=0)
        trainer = helpers.trainer(strategy, 1, steps, callbacks=[Failures(work, way, group, every, steps)])
        trainer.fit(LibraryLM("llama", "adamw"), data)
        return
    rank = int(os.environ["RANK"])
    saver = ModelCheckpoint(dirpath=str(work / "ckpt"), save_top_k=0, save_last=True,
                            every_n_train_steps=checkpoint_every)
    strategy = CephaloStrategy(plan=PLAN, check_devices=False, seed=0, timeout=timedelta(seconds=PG_TIMEOUT_S))
    trainer = helpers.trainer(strategy, 2, steps, default_root_dir=str(work), enable_checkpointing=True,
                              callbacks=[Failures(work, way, rank, every, steps), saver])
    trainer.fit(LibraryLM("llama", "adamw"), data, ckpt_path="last")
    # as PyTorch asks on a normal exit (gloo's threads may otherwise abort the teardown, which torchrun restarts)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Path(args[0]), args[1], args[2], int(args[3]), int(args[4]), int(args[5]) if len(args) > 5 else 0)
