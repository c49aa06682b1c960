"""One life of one shard group (one rank) under fault tolerance (tests/lightning/fit/test_fault_tolerance.py,
benchmarks/bench_fault_tolerance.py).

:func:`run_scenario` runs the whole scenario (a lighthouse on 127.0.0.1, both groups, the kill,
the return) and reads what the lives wrote. One life: ``python scenarios/ft_worker.py WORKDIR GROUP LIGHTHOUSE`` trains TinyLM in fp64 (sharded by the
package in its group of one rank) for :data:`TOTAL` steps of :data:`GLOBAL` samples, each group on
its part of every global batch (:class:`~cephalo_lightning.lightning.fit.fault_tolerance.ReplicaGroup`).
Instrumented points, each a file in WORKDIR as well:

* **start**: every life writes ``ready-G-PID`` once its manager heartbeats; a group's first life
  waits for both groups' (so the first quorum holds both);
* **the kill**: group 1's first life, in step :data:`KILL_AT` after its forward and before its
  backward (where the gradients are summed over the groups), writes ``killed`` (the time) and
  SIGKILLs itself: the group is lost mid-step;
* **the return**: group 0, after committing step :data:`WAIT_AT`, writes ``waiting`` and waits (at
  most :data:`WAIT_S`) for the ``ready`` of a later life of group 1, which starts its manager only
  once ``waiting`` is there and writes ``ready`` only once the lighthouse has its heartbeat (one sent
  and answered, not left to the manager's timer); group 0 then also waits until the lighthouse's
  status page counts group 1's first quorum request as pending, since the lighthouse forms a quorum
  at once from the previous quorum's participants (group 0 alone) when they all ask again: the return
  lands at step ``WAIT_AT + 1`` whatever the machine's load.

Every step appends a line to ``events-G-PID.jsonl`` (the step, the quorum's participants, the
batches, whether it committed, the time; in the plain loop also the cross-group all-reduces the
step's backward started and the buckets there are: :data:`BUCKET_BYTES` cuts several); a life that
trains to the end writes ``final-G-PID.pt`` (its parameters, by name). Group 0's plain loop also
writes ``grads-0-PID.pt``: the summed gradient of steps :data:`SUMMED_AT` as it stood before each
committed optimizer step (by parameter name), for the replay to check.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed import TCPStore

from cephalo_lightning.lightning.fit.fault_tolerance import ReplicaGroup, Settings
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel
from tests.plans import plan_of
from tests.reference import make_optimizer
from tests.tiny_lm import TinyLM, batches

GLOBAL, TOTAL, KILL_AT, WAIT_AT = 12, 10, 3, 6
SUMMED_AT = (KILL_AT - 1, KILL_AT)  # both groups' sum; the survivor's redo after a failed attempt
BUCKET_BYTES = (256, 512)  # TinyLM's units (fp64) in buckets of their own: a sum skipped for one shows
WAIT_S = 120  # the longest any instrumented wait lasts; past it the life fails
# two groups of one rank each: a big device (8 of 12 samples) and a small one (4 of 12)
PLAN = plan_of(batches=[8, 4], micro=[1, 1], shares=[1.0, 1.0], devices=["cpu (emulated big)", "cpu (emulated small)"],
               groups=[0, 1])


ROOT = Path(__file__).resolve().parents[1]
HEARTBEAT_TIMEOUT_MS = 2000  # the lighthouse drops a group this long after its last heartbeat (beats: 0.1 s)
JOIN_TIMEOUT_MS = 60_000  # how long a quorum waits for a heartbeating group that has not asked yet


def event_line(part, committed: bool, **more: int) -> str:
    """One line of a life's events file: the step, who took part, their batches, whether it committed (and ``more``)."""
    return json.dumps({"step": part.step, "participants": list(part.participants), "batches": list(part.batches),
                       "committed": committed, "time": time.time(), **more}) + "\n"


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {WAIT_S} s")
        time.sleep(0.02)


def _pending_quorum_requests(lighthouse: str) -> int:
    """How many groups have asked the lighthouse for the next quorum (its status page's count)."""
    with urllib.request.urlopen(f"{lighthouse}/status", timeout=5) as page:
        found = re.search(r"\[\d+/(\d+) participants healthy\]", page.read().decode())
    if found is None:
        raise RuntimeError(f"the lighthouse's status page at {lighthouse}/status no longer shows its participants")
    return int(found.group(1))


def main(work: Path, group: int, lighthouse: str) -> None:
    torch.set_num_threads(1)
    pid = os.getpid()
    first_life = not any(work.glob(f"ready-{group}-*"))
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the group's own store (one rank)
    if not first_life:
        wait_for(lambda: (work / "waiting").exists(), "group 0 at the return point")
    model = TinyLM().double()
    sharded = ShardedModel(model, [1.0], bucket_bytes=BUCKET_BYTES)  # the group's in-group sharding (one rank here)
    parameters = list(sharded.parameters())
    optimizer = make_optimizer(parameters)
    settings = Settings(lighthouse=lighthouse, store_addr="127.0.0.1", store_port=store.port, hostname="127.0.0.1",
                        timeout=timedelta(seconds=20), quorum_timeout=timedelta(seconds=WAIT_S))
    ft = ReplicaGroup(parameters, optimizer, PLAN, group, settings, sharded=sharded)
    if not first_life:  # the lighthouse knows this life is up before group 0 asks for its next quorum
        from torchft.coordination import LighthouseClient
        from torchft.manager import REPLICA_ID_KEY

        LighthouseClient(lighthouse, timedelta(seconds=20)).heartbeat(store.get(REPLICA_ID_KEY).decode())
    (work / f"ready-{group}-{pid}").write_text(str(time.time()))
    if first_life:
        wait_for(lambda: all(any(work.glob(f"ready-{g}-*")) for g in (0, 1)), "start of both groups")
    data = batches(TOTAL, GLOBAL)
    events = open(work / f"events-{group}-{pid}.jsonl", "a")
    waited = False
    summed: dict[str, dict[str, torch.Tensor]] = {}
    while ft.step < TOTAL:
        issued = ft.sum.issued
        part = ft.start_step()
        x, y = data[part.step]
        x, y = x[part.start:part.start + part.size], y[part.start:part.start + part.size]
        loss = model.loss(model(x), y) * (part.size / GLOBAL)
        if group == 1 and first_life and part.step == KILL_AT:
            (work / "killed").write_text(json.dumps({"time": time.time(), "step": part.step}))
            os.kill(pid, signal.SIGKILL)
        sharded.backward(loss)  # the gradients summed over the groups in it
        ft.finish_sums()
        grads = {name: p.grad.clone() for name, p in sharded.named_parameters()} if part.step in SUMMED_AT else None
        committed = ft.commit()
        if committed and grads is not None:
            summed[str(part.step)] = grads
        events.write(event_line(part, committed, sums=ft.sum.issued - issued, buckets=len(sharded.replicas.buckets)))
        events.flush()
        if group == 0 and committed and part.step == WAIT_AT and not waited:
            waited = True
            (work / "waiting").write_text(str(time.time()))
            wait_for(lambda: len(list(work.glob("ready-1-*"))) > 1, "return of group 1")
            wait_for(lambda: _pending_quorum_requests(lighthouse) > 0, "group 1's first quorum request")
    torch.save({name: p.detach().clone() for name, p in sharded.full_state_dict().items()}, work / f"final-{group}-{pid}.pt")
    if group == 0:
        torch.save(summed, work / f"grads-{group}-{pid}.pt")
    ft.shutdown()


# two of three groups lost in the same step (the plain loop): groups 1 and 2 SIGKILL themselves in step KILL_AT
# after their forward, before their backward; group 0 redoes the step alone and trains to TOTAL
PLAN3 = plan_of(batches=[4, 4, 4], micro=[1, 1, 1], shares=[1.0, 1.0, 1.0], devices=["cpu"] * 3, groups=[0, 1, 2])


def lost_together_main(work: Path, group: int, lighthouse: str) -> None:
    """One life of one of three groups; see :data:`PLAN3`."""
    torch.set_num_threads(1)
    pid = os.getpid()
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = TinyLM().double()
    sharded = ShardedModel(model, [1.0])
    parameters = list(sharded.parameters())
    settings = Settings(lighthouse=lighthouse, store_addr="127.0.0.1", store_port=store.port, hostname="127.0.0.1",
                        timeout=timedelta(seconds=20), quorum_timeout=timedelta(seconds=WAIT_S))
    ft = ReplicaGroup(parameters, make_optimizer(parameters), PLAN3, group, settings, sharded=sharded)
    (work / f"ready-{group}-{pid}").write_text(str(time.time()))
    wait_for(lambda: all(any(work.glob(f"ready-{g}-*")) for g in (0, 1, 2)), "start of the three groups")
    data = batches(TOTAL, GLOBAL)
    events = open(work / f"events-{group}-{pid}.jsonl", "a")  # noqa: SIM115 (closed at exit)
    while ft.step < TOTAL:
        part = ft.start_step()
        x, y = data[part.step]
        x, y = x[part.start:part.start + part.size], y[part.start:part.start + part.size]
        loss = model.loss(model(x), y) * (part.size / GLOBAL)
        if group > 0 and part.step == KILL_AT:
            os.kill(pid, signal.SIGKILL)
        sharded.backward(loss)
        ft.finish_sums()
        committed = ft.commit()
        events.write(event_line(part, committed))
        events.flush()
    torch.save({name: p.detach().clone() for name, p in sharded.full_state_dict().items()}, work / f"final-{group}-{pid}.pt")
    ft.shutdown()


def run_lost_together(work: Path, deadline_s: float) -> Scenario:
    """Three groups on a loopback lighthouse, two lost in one step (:func:`lost_together_main`); every
    process is ended before this returns."""
    from torchft._torchft import LighthouseServer

    work.mkdir(parents=True, exist_ok=True)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    lives = [_start(work, g, lighthouse.address(), "lost-together", f"life-{g}-0.log") for g in (0, 1, 2)]
    deadline = time.monotonic() + deadline_s
    try:
        while any(life.poll() is None for life in lives) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        _end(lives, lighthouse)
    return _read(work, lives, (0, 1, 2))


# Trainer.fit under CephaloStrategy(fault_tolerance=True): the same two groups, a tiny Hugging Face Llama
# built from its config (tests/library_models.LibraryLM, AdamW) in fp64 on right-padded dict batches (the
# planned loader's order over PaddedTokens(TOTAL * GLOBAL), unshuffled; a per-token mean loss)
FIT_PLAN = PLAN  # its device names are the emulated ones (check_devices=False)
FIT_MODEL = ("llama", "adamw")
RETURN_GRACE_S = 2.0  # fit: group 0 waits this long after the return's `ready` (its quorum request follows the hook)


def metric_lines(path: Path):
    """A Lightning logger that writes every logged value to ``path``, one JSON line per call."""
    from lightning.pytorch.loggers.logger import Logger

    lines = open(path, "w")  # noqa: SIM115 (closed at exit)

    class Lines(Logger):
        name, version = "lines", 0

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            lines.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")
            lines.flush()

    return Lines()


def steps_and_epochs(lines: list[dict]) -> tuple[list[float], list[tuple[float, list[float]]]]:
    """The logged ``train_loss_step`` values in order, and each ``train_loss_epoch`` with the step values since the last."""
    steps, epochs, since = [], [], []
    for line in lines:
        if "train_loss_step" in line:
            steps.append(line["train_loss_step"])
            since.append(line["train_loss_step"])
        if "train_loss_epoch" in line:
            epochs.append((line["train_loss_epoch"], since))
            since = []
    return steps, epochs


def fit_main(work: Path, group: int) -> None:
    """One life of one group under ``Trainer.fit``, with the instrumented points of :func:`main`
    as a callback (the kill in ``on_before_backward``: after the forward, before the backward and its
    sum over the groups)."""
    import lightning.pytorch as pl

    from cephalo_lightning import CephaloStrategy
    from tests import helpers
    from tests.library_models import LibraryLM, PaddedTokens, loader

    torch.set_num_threads(1)
    pid = os.getpid()
    first_life = not any(work.glob(f"ready-{group}-*"))
    if not first_life:
        wait_for(lambda: (work / "waiting").exists(), "group 0 at the return point")
    events = open(work / f"events-{group}-{pid}.jsonl", "a")

    class Instrumented(pl.Callback):
        written = 0

        def on_train_start(self, trainer, module):  # the manager heartbeats; the first quorum is next
            (work / f"ready-{group}-{pid}").write_text(str(time.time()))
            if first_life:
                wait_for(lambda: all(any(work.glob(f"ready-{g}-*")) for g in (0, 1)), "start of both groups")

        def on_before_backward(self, trainer, module, loss):
            if group == 1 and first_life and trainer.global_step == KILL_AT:
                (work / "killed").write_text(json.dumps({"time": time.time(), "step": trainer.global_step}))
                os.kill(pid, signal.SIGKILL)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            history = trainer.strategy.replica.history
            for part, committed in history[self.written:]:
                events.write(event_line(part, committed))
            events.flush()
            self.written = len(history)
            if group == 0 and trainer.global_step == WAIT_AT + 1 and not (work / "waiting").exists():
                (work / "waiting").write_text(str(time.time()))
                wait_for(lambda: len(list(work.glob("ready-1-*"))) > 1, "return of group 1")
                time.sleep(RETURN_GRACE_S)

    module = LibraryLM(*FIT_MODEL)
    strategy = CephaloStrategy(plan=FIT_PLAN, fault_tolerance=True, replica_group=group, check_devices=False)
    trainer = helpers.trainer(strategy, 1, TOTAL, precision="64-true", callbacks=[Instrumented()],
                              logger=metric_lines(work / f"metrics-{group}-{pid}.jsonl"), log_every_n_steps=1)
    trainer.fit(module, loader(PaddedTokens(TOTAL * GLOBAL), GLOBAL))
    torch.save({name: p.detach().clone() for name, p in module.named_parameters()}, work / f"final-{group}-{pid}.pt")


@dataclass(frozen=True)
class Scenario:
    """What the lives wrote: every life's events (by pid), the kill's record and the final parameters."""

    events: dict[tuple[int, int], list[dict]]  # (group, pid) -> its steps, in order
    killed: dict
    finals: dict[tuple[int, int], dict[str, torch.Tensor]]
    exit_codes: dict[tuple[int, int], int]
    logs: str
    metrics: dict[tuple[int, int], list[dict]]  # (group, pid) -> what its Trainer logged (Trainer.fit lives)
    grads: dict[str, dict[str, torch.Tensor]]  # group 0's summed gradient of steps SUMMED_AT (plain loop), by step

    def lives(self, group: int) -> list[int]:
        """The pids of ``group``'s lives, in start order."""
        return sorted((pid for g, pid in self.events if g == group), key=lambda pid: self.events[group, pid][0]["time"])


# Trainer.fit with groups of two ranks (no kill): each group shards TinyLayered 0.7 / 0.3 inside and takes
# 5 + 3 of its samples; every rank's Trainer is started as a launcher would (LOCAL_RANK, MASTER_PORT)
HSDP_PLAN = plan_of(batches=[5, 3, 5, 3], micro=[1] * 4, shares=[0.7, 0.3, 0.7, 0.3], devices=["cpu"] * 4, groups=[0, 0, 1, 1])
HSDP_STEPS = 3


def fit_ranks_main(work: Path, group: int) -> None:
    """One rank of a group of two under ``Trainer.fit``; writes its parameters after the fit."""
    import lightning.pytorch as pl

    from cephalo_lightning import CephaloStrategy
    from tests import helpers
    from tests.lightning_models import TinyLayered, loader, token_data

    torch.set_num_threads(1)
    parts: list = []

    class Record(pl.Callback):
        def on_train_end(self, trainer, module):  # before the strategy's teardown ends the replica group
            parts.extend((p.participants, p.start, p.size, ok) for p, ok in trainer.strategy.replica.history)

    module = TinyLayered()
    strategy = CephaloStrategy(plan=HSDP_PLAN, fault_tolerance=True, replica_group=group, check_devices=False)
    trainer = helpers.trainer(strategy, 2, HSDP_STEPS, precision="64-true", callbacks=[Record()])
    trainer.fit(module, loader(token_data(HSDP_STEPS * HSDP_PLAN.global_batch_size), HSDP_PLAN.global_batch_size))
    torch.save({"state": {name: p.detach().clone() for name, p in module.named_parameters()}, "parts": parts},
               work / f"final-{group}-{os.environ['LOCAL_RANK']}.pt")


def run_ranks(work: Path, deadline_s: float) -> dict[tuple[int, int], dict]:
    """A lighthouse for two groups (both in every quorum), two groups of two ranks under ``Trainer.fit``;
    every process is ended before this returns. Returns each rank's final parameters, by (group, rank)."""
    from torchft._torchft import LighthouseServer

    from cephalo_lightning.testing.local_ranks import free_port

    work.mkdir(parents=True, exist_ok=True)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=JOIN_TIMEOUT_MS,
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    ranks: list[subprocess.Popen] = []
    try:
        for group in (0, 1):
            port = free_port()
            for local in (0, 1):
                ranks.append(_start(work, group, lighthouse.address(), "fit-ranks", f"rank-{group}-{local}.log",
                                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(local),
                                    NODE_RANK="0"))
        deadline = time.monotonic() + deadline_s
        while any(r.poll() is None for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        _end(ranks, lighthouse)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(work.glob("rank-*.log")))
    assert all(r.returncode == 0 for r in ranks), ([r.returncode for r in ranks], logs)
    return {(g, r): torch.load(work / f"final-{g}-{r}.pt") for g in (0, 1) for r in (0, 1)}


def _start(work: Path, group: int, lighthouse: str, mode: str, log_name: str, **env: str) -> subprocess.Popen:
    """One process of ``group`` running this file in ``mode`` (its output in ``log_name``); ``env``: its
    launcher's variables (each group its own store and ranks, none inherited)."""
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    environment.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RUST_LOG="warn", TORCHFT_LIGHTHOUSE=lighthouse, **env)
    log = open(work / log_name, "w")  # noqa: SIM115 (the child writes it)
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(work), str(group), lighthouse, mode],
                            cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT)


def _end(processes: list[subprocess.Popen], lighthouse) -> None:
    """Kill whatever of ``processes`` still runs, wait for all, and stop the lighthouse."""
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()
    lighthouse.shutdown()


def _life(work: Path, group: int, lighthouse: str, index: int, fit: bool) -> subprocess.Popen:
    return _start(work, group, lighthouse, "fit" if fit else "loop", f"life-{group}-{index}.log")


def run_scenario(work: Path, deadline_s: float, *, fit: bool = False) -> Scenario:
    """A lighthouse on loopback, group 0 and group 1 started together, group 1 killed mid-step
    :data:`KILL_AT` and started again at once; every process is ended before this returns.
    ``fit``: each life runs ``Trainer.fit`` (:func:`fit_main`) instead of the plain loop (:func:`main`)."""
    from torchft._torchft import LighthouseServer

    work.mkdir(parents=True, exist_ok=True)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    address = lighthouse.address()
    deadline = time.monotonic() + deadline_s
    lives: list[subprocess.Popen] = []

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(work.glob("life-*.log")))

    def wait(what: str, done) -> None:
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{logs()}")
            time.sleep(0.05)

    try:
        lives += [_life(work, 0, address, 0, fit), _life(work, 1, address, 0, fit)]
        wait("the kill", lambda: (work / "killed").exists() or lives[0].poll() is not None)
        wait("group 1's first life to end", lambda: lives[1].poll() is not None)
        lives.append(_life(work, 1, address, 1, fit))  # the node is back: the group starts again
        wait("both groups to finish", lambda: lives[0].poll() is not None and lives[2].poll() is not None)
    finally:
        _end(lives, lighthouse)
    return _read(work, lives, (0, 1, 1))


def _read(work: Path, lives: list[subprocess.Popen], groups: tuple[int, ...]) -> Scenario:
    """What the lives (of ``groups``, in order) wrote in ``work``."""
    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(work.glob("life-*.log")))

    events = {}
    for path in work.glob("events-*.jsonl"):
        _, group, pid = path.stem.split("-")
        events[int(group), int(pid)] = [json.loads(line) for line in path.read_text().splitlines()]
    finals = {(int(p.stem.split("-")[1]), int(p.stem.split("-")[2])): torch.load(p) for p in work.glob("final-*.pt")}
    codes = {(g, life.pid): life.returncode for g, life in zip(groups, lives)}
    killed = json.loads((work / "killed").read_text()) if (work / "killed").exists() else {}
    metrics = {}
    for path in work.glob("metrics-*.jsonl"):
        _, group, pid = path.stem.split("-")
        metrics[int(group), int(pid)] = [json.loads(line) for line in path.read_text().splitlines()]
    grads = {k: v for path in work.glob("grads-0-*.pt") for k, v in torch.load(path).items()}
    return Scenario(events, killed, finals, codes, logs(), metrics, grads)


if __name__ == "__main__":
    if sys.argv[4:] == ["fit"]:
        fit_main(Path(sys.argv[1]), int(sys.argv[2]))
    elif sys.argv[4:] == ["lost-together"]:
        lost_together_main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    elif sys.argv[4:] == ["fit-ranks"]:
        fit_ranks_main(Path(sys.argv[1]), int(sys.argv[2]))
    else:
        main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
