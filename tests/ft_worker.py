"""One life of one shard group (one rank) under fault tolerance (tests/test_fault_tolerance.py,
benchmarks/bench_fault_tolerance.py).

``python tests/ft_worker.py WORKDIR GROUP LIGHTHOUSE``: trains TinyLM in fp64 (sharded by the
package in its group of one rank) for :data:`TOTAL` steps of :data:`GLOBAL` samples, each group on
its part of every global batch (:class:`~cephalo_lightning.lightning.fault_tolerance.ReplicaGroup`).
Instrumented points, each a file in WORKDIR as well:

* **start**: every life writes ``ready-G-PID`` once its manager heartbeats; a group's first life
  waits for both groups' (so the first quorum holds both);
* **the kill**: group 1's first life, in step :data:`KILL_AT` after its backward and before the
  cross-group all-reduce, writes ``killed`` (the time) and SIGKILLs itself: the group is lost mid-step;
* **the return**: group 0, after committing step :data:`WAIT_AT`, waits (at most :data:`WAIT_S`)
  for the ``ready`` of a later life of group 1, so that the return happens mid-run.

Every step appends a line to ``events-G-PID.jsonl`` (the step, the quorum's participants, the
batches, whether it committed, the time); a life that trains to the end writes ``final-G-PID.pt``
(its parameters, by name).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402

from cephalo_lightning.lightning.fault_tolerance import ReplicaGroup, Settings  # noqa: E402
from cephalo_lightning.planner import Plan, RankPlan  # noqa: E402
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel  # noqa: E402
from tests.models import TinyLM, batches  # noqa: E402
from tests.reference import make_optimizer  # noqa: E402

GLOBAL, TOTAL, KILL_AT, WAIT_AT = 12, 10, 3, 6
WAIT_S = 120  # the longest any instrumented wait lasts; past it the life fails
# two groups of one rank each: a big device (8 of 12 samples) and a small one (4 of 12)
PLAN = Plan(GLOBAL, "layered", (RankPlan(0, "cpu (emulated big)", 8, 1, 8, 1.0, shard_group=0),
                                RankPlan(1, "cpu (emulated small)", 4, 1, 4, 1.0, shard_group=1)))


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {WAIT_S} s")
        time.sleep(0.02)


def main(work: Path, group: int, lighthouse: str) -> None:
    torch.set_num_threads(1)
    pid = os.getpid()
    first_life = not any(work.glob(f"ready-{group}-*"))
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the group's own store (one rank)
    model = TinyLM().double()
    sharded = ShardedModel(model, [1.0])  # the group's in-group sharding (one rank here)
    parameters = list(sharded.parameters())
    optimizer = make_optimizer(parameters)
    settings = Settings(lighthouse=lighthouse, store_addr="127.0.0.1", store_port=store.port, hostname="127.0.0.1",
                        timeout=timedelta(seconds=20), quorum_timeout=timedelta(seconds=WAIT_S))
    ft = ReplicaGroup(parameters, optimizer, PLAN, group, settings)
    (work / f"ready-{group}-{pid}").write_text(str(time.time()))
    if first_life:
        _wait_for(lambda: all(any(work.glob(f"ready-{g}-*")) for g in (0, 1)), "start of both groups")
    data = batches(TOTAL, GLOBAL)
    events = open(work / f"events-{group}-{pid}.jsonl", "a")
    waited = False
    while ft.step < TOTAL:
        part = ft.start_step()
        x, y = data[part.step]
        x, y = x[part.start:part.start + part.size], y[part.start:part.start + part.size]
        loss = model.loss(model(x), y) * (part.size / GLOBAL)
        sharded.backward(loss)
        if group == 1 and first_life and part.step == KILL_AT:
            (work / "killed").write_text(json.dumps({"time": time.time(), "step": part.step}))
            os.kill(pid, signal.SIGKILL)
        ft.reduce_gradients()
        committed = ft.commit()
        events.write(json.dumps({"step": part.step, "participants": list(part.participants),
                                 "batches": list(part.batches), "committed": committed, "time": time.time()}) + "\n")
        events.flush()
        if group == 0 and committed and part.step == WAIT_AT and not waited:
            waited = True
            _wait_for(lambda: len(list(work.glob("ready-1-*"))) > 1, "return of group 1")
    torch.save({name: p.detach().clone() for name, p in sharded.full_state_dict().items()}, work / f"final-{group}-{pid}.pt")
    ft.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
