"""One group of the steady-state run (benchmarks/bench_ft_overhead.py): the same two-group plan, fault
tolerance on or off, no failure.

``python scenarios/ft_steady.py WORKDIR GROUP MODE ENDPOINT STEPS``. Two shard groups of one rank
each train :func:`model` (fp32) on their halves of every global batch of :data:`GLOBAL` sequences:

* ``off``: the two groups are one gloo world of two ranks, one :class:`ShardedModel` with shard groups
  ``[[0], [1]]`` (``ENDPOINT``: the world's ``host:port``); the cross-group sum is the runtime's
  bucketed all-reduce, started during the backward, as ``CephaloStrategy(fault_tolerance=False)``
  runs this plan;
* ``ft``: each group its own :class:`ShardedModel` of one rank and a
  :class:`~cephalo_lightning.lightning.fit.fault_tolerance.ReplicaGroup` on the lighthouse at
  ``ENDPOINT``: a quorum, the cross-group sum over torchft's managed process group (the same buckets,
  started during the backward) and the commit, as ``CephaloStrategy(fault_tolerance=True)`` runs it.

Every step writes one line to ``steps-GROUP-MODE.jsonl``: its phases' lengths in seconds (``quorum``,
``compute``: forward and backward, the cross-group sum's buckets started and waited inside it,
``sum``: what is left after the backward (``on``: the step's control sum waited and compared;
``off``: nothing), ``commit``: the commit decision, ``optimizer``) and the whole step (``step``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel
from tests.plans import plan_of
from tests.reference import make_optimizer
from tests.tiny_lm import TinyLM, batches

GLOBAL, SEQ, VOCAB, DIM, DEPTH = 16, 64, 1024, 256, 6
PLAN = plan_of(batches=[GLOBAL // 2, GLOBAL // 2], micro=[1, 1], shares=[1.0, 1.0], devices=["cpu", "cpu"],
               groups=[0, 1])


def model() -> TinyLM:
    """About 5.3M parameters: a step of some hundred milliseconds on one CPU thread."""
    return TinyLM(vocab=VOCAB, dim=DIM, depth=DEPTH)


def main(work: Path, group: int, mode: str, endpoint: str, steps: int) -> None:
    torch.set_num_threads(1)
    data = batches(steps, GLOBAL, seq=SEQ, vocab=VOCAB)
    net = model()
    half = GLOBAL // 2
    if mode == "off":
        host, port = endpoint.rsplit(":", 1)
        store = TCPStore(host, int(port), 2, is_master=group == 0, timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=group, world_size=2)
        sharded = ShardedModel(net, [1.0, 1.0], shard_groups=[[0], [1]])
        ft = None
    else:
        from cephalo_lightning.lightning.fit.fault_tolerance import ReplicaGroup, Settings

        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        sharded = ShardedModel(net, [1.0])
    optimizer = make_optimizer(list(sharded.parameters()))
    if mode == "ft":
        settings = Settings(lighthouse=endpoint, store_addr="127.0.0.1", store_port=store.port, hostname="127.0.0.1",
                            timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=120))
        ft = ReplicaGroup(list(sharded.parameters()), optimizer, PLAN, group, settings, sharded=sharded)
    out = open(work / f"steps-{group}-{mode}.jsonl", "w")  # noqa: SIM115
    step = 0
    while step < steps:
        t0 = time.perf_counter()
        if ft is not None:
            part = ft.start_step()
            start, size = part.start, part.size
        else:
            start, size = group * half, half
        t1 = time.perf_counter()
        x, y = data[step]
        loss = net.loss(net(x[start:start + size]), y[start:start + size]) * (size / GLOBAL)
        sharded.backward(loss)  # both ways: the cross-group sum's buckets start and are waited in it
        t2 = time.perf_counter()
        if ft is not None:
            ft.finish_sums()
        else:
            sharded.wait_reductions()
        t3 = time.perf_counter()
        committed = ft.agree() if ft is not None else True
        t4 = time.perf_counter()
        if committed:
            optimizer.step()
            step += 1
        optimizer.zero_grad(set_to_none=False)
        t5 = time.perf_counter()
        out.write(json.dumps({"quorum": t1 - t0, "compute": t2 - t1, "sum": t3 - t2, "commit": t4 - t3,
                              "optimizer": t5 - t4, "step": t5 - t0, "committed": committed}) + "\n")
    out.close()
    torch.save({n: p.detach().clone() for n, p in sharded.full_state_dict().items()}, work / f"final-{group}-{mode}.pt")
    if ft is not None:
        ft.shutdown()
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
