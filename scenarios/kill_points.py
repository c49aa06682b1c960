"""A child that SIGKILLs itself at one named point of a checkpoint save or a top-k deletion.

``python -m scenarios.kill_points`` imports Lightning and the package once, then serves requests read
from stdin, one JSON object a line: ``{"point": ..., "ckpt": dir, "resume": path or "",
"max_steps": n, "workdir": dir}``. Each request runs in a forked process: one-rank training that
saves every step (``save_top_k=2`` by step, ``save_last``); after the optimizer step
``max_steps`` the instrumented calls below are armed (``"async": true``: the saves are written by
the background writer, and the kill lands in its thread), and the first call that matches ``point``
kills the process. The server answers each request with one JSON line: the forked process's exit
status (``-9``: killed at the point; ``0``: it finished without reaching it).

The instrumentation lives here, in the test's own process, not in the package: ``os.replace``,
``os.fsync``, ``shutil.rmtree`` and the atomic-io module's ``renameat2`` exchange are wrapped, and
each point is a predicate on the call and its paths. Forking after the imports costs a fraction of
a fresh interpreter (nothing before the fork starts threads or a process group).
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from cephalo_lightning import CephaloStrategy
from cephalo_lightning._common import atomic_io
from tests.lightning_models import TinyLayered, token_data
from tests.plans import plan_of

Call = tuple[str, tuple[str, ...]]  # (what is called, the names of the paths it is called on)


def _replace(src: str, dst: str) -> Callable[[Call], bool]:
    return lambda call: call[0] == "replace" and fnmatch.fnmatch(call[1][0], src) and fnmatch.fnmatch(call[1][1], dst)


POINTS: dict[str, Callable[[Call], bool]] = {  # name -> does this call kill?
    # a save of a new top-k checkpoint (step=K.ckpt)
    "save: a shard written, not yet synced": lambda c: c[0] == "fsync" and c[1][0].endswith(".distcp"),
    "save: DCP's metadata written, not yet synced": lambda c: c[0] == "fsync" and c[1][0] == ".metadata.tmp",
    "save: meta.pt written, before its rename": _replace(".meta.pt.tmp-*", "meta.pt"),
    "save: the manifest written, before its rename": _replace(".manifest.json.tmp-*", "manifest.json"),
    "save: complete, before it is published": _replace(".step=*.ckpt.staging-*", "step=*.ckpt"),
    # the top-k deletion of the oldest kept checkpoint
    "delete: before the rename away": _replace("step=*.ckpt", ".step=*.ckpt.trash-*"),
    "delete: renamed away, nothing deleted yet": lambda c: c[0] == "rmtree" and fnmatch.fnmatch(c[1][0], ".step=*.trash-*"),
    "delete: half deleted": lambda c: c[0] == "rmtree-half" and fnmatch.fnmatch(c[1][0], ".step=*.trash-*"),
    # last.ckpt replaced by one renameat2(RENAME_EXCHANGE)
    "last: complete, before the exchange": lambda c: c[0] == "exchange" and c[1][1] == "last.ckpt",
    "last: exchanged, the old version not yet removed": _replace(".last.ckpt.staging-*", "..last.ckpt.staging-*.trash-*"),
    # last.ckpt replaced where the exchange is unsupported: two renames
    "last, no exchange: the old set aside, the new not yet in": _replace(".last.ckpt.staging-*", "last.ckpt"),
    "last, no exchange: the new in, the old not yet removed": _replace(".last.ckpt.old-*", "..last.ckpt.old-*.trash-*"),
}
NEEDS_EXCHANGE = ("last: exchanged, the old version not yet removed",)
WITHOUT_EXCHANGE = ("last, no exchange: the old set aside, the new not yet in",
                    "last, no exchange: the new in, the old not yet removed")


def points_here(directory: Path) -> list[str]:
    """Every kill point this file system can reach: without an atomic exchange (renameat2), the one
    inside an exchange does not exist."""
    from cephalo_lightning._common.atomic_io import _exchange

    a, b = directory / "probe-a", directory / "probe-b"
    a.mkdir()
    b.mkdir()
    try:
        exchange = _exchange(a, b)
    finally:
        a.rmdir()
        b.rmdir()
    return [p for p in POINTS if exchange or p not in NEEDS_EXCHANGE]


class Instrumented:
    """Wraps the calls a save and a deletion make; once armed, kills at the first matching one."""

    def __init__(self, point: str, workdir: Path, exchange: bool) -> None:
        self.matches = POINTS[point]
        self.point = point
        self.workdir = workdir
        self.armed = False
        replace, fsync, rmtree, swap = os.replace, os.fsync, shutil.rmtree, atomic_io._exchange

        def replace_(src, dst, **kwargs):
            self.check(("replace", (Path(src).name, Path(dst).name)))
            return replace(src, dst, **kwargs)

        def fsync_(fd):
            self.check(("fsync", (Path(os.readlink(f"/proc/self/fd/{fd}")).name,)))
            return fsync(fd)

        def rmtree_(path, *args, **kwargs):
            call = ("rmtree", (Path(path).name,))
            self.check(call)
            if self.armed and self.matches(("rmtree-half", call[1])):
                files = sorted(p for p in Path(path).rglob("*") if p.is_file())
                for file in files[: max(1, len(files) // 2)]:
                    file.unlink()
                self.kill()
            return rmtree(path, *args, **kwargs)

        def exchange_(a, b):
            self.check(("exchange", (Path(a).name, Path(b).name)))
            return swap(a, b) if exchange else False

        os.replace, os.fsync, shutil.rmtree, atomic_io._exchange = replace_, fsync_, rmtree_, exchange_

    def check(self, call: Call) -> None:
        if self.armed and self.matches(call):
            self.kill()

    def kill(self) -> None:
        (self.workdir / "killed-at").write_text(self.point)
        (self.workdir / "killed-in").write_text(threading.current_thread().name)  # a background save's thread?
        os.kill(os.getpid(), signal.SIGKILL)


class Arm(pl.Callback):
    """Arms the instrumentation after optimizer step ``at``; checkpoint callbacks run after this one."""

    def __init__(self, instrumented: Instrumented, at: int) -> None:
        self.instrumented = instrumented
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            trainer.strategy.fit_runtime.checkpoints.wait()  # an earlier background save is not the one killed
            self.instrumented.armed = True


def train(request: dict) -> None:
    """One run: resume if asked, save every step, die at the request's point after ``max_steps``."""
    warnings.simplefilter("ignore")
    workdir = Path(request["workdir"])
    instrumented = Instrumented(request["point"], workdir, exchange=request["point"] not in WITHOUT_EXCHANGE)
    saver = ModelCheckpoint(dirpath=request["ckpt"], every_n_train_steps=1, save_top_k=2, monitor="step", mode="max",
                            save_last=True, filename="{step}")

    class LogStep(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            module.log("step", float(trainer.global_step))

    plan = plan_of(batches=[8], micro=[2], shares=[1.0])
    strategy = CephaloStrategy(plan=plan, async_checkpoint=request.get("async", False))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1,
                         max_steps=request["max_steps"], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[saver, LogStep(), Arm(instrumented, request["max_steps"])],
                         default_root_dir=str(workdir))
    trainer.fit(TinyLayered(), torch.utils.data.DataLoader(token_data(800), batch_size=8),
                ckpt_path=request["resume"] or None)


@dataclass(frozen=True)
class KillLoop:
    """What :func:`kill_loop` saw: kills, the threads they landed in, complete checkpoints found
    after them, and how many landed inside a save or a deletion (a leftover was there)."""

    kills: int
    threads: tuple[str, ...]
    complete_seen: int
    interrupted: int


def kill_loop(workdir: Path, points: list[str], background: bool = False) -> KillLoop:
    """One SIGKILL at each of ``points`` (served by a ``python -m scenarios.kill_points`` child), each
    run resuming from the previous one's ``last.ckpt``. After every kill: what the next run does
    first (``clean_stale``), then every directory that looks like a checkpoint must verify, and
    ``last.ckpt`` must be complete. Raises ``AssertionError`` naming the kill otherwise."""
    import subprocess

    from cephalo_lightning.runtime import checkpoint

    ckpt = workdir / "ckpts"
    resume, threads, saw_complete, interrupted = "", [], 0, 0
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                             "LOCAL_RANK", "NODE_RANK")}
    server = subprocess.Popen([sys.executable, "-m", "scenarios.kill_points"], cwd=Path(__file__).resolve().parents[1],
                              env={**env, "WANDB_MODE": "disabled"}, text=True, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    try:
        for kill, point in enumerate(points):
            # two steps past the resumed one: the armed save is of a new name and deletes a kept one
            start = checkpoint.read_meta(resume)["global_step"] if resume else 1
            request = {"point": point, "ckpt": str(ckpt), "resume": resume, "max_steps": start + 2,
                       "workdir": str(workdir), "async": background}
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            status = json.loads(server.stdout.readline())["status"]
            log = (workdir / "run.log").read_text()
            assert status == -signal.SIGKILL, f"{point}: the run ended with {status} instead of dying there\n{log[-3000:]}"
            assert (workdir / "killed-at").read_text() == point
            threads.append((workdir / "killed-in").read_text())
            interrupted += any(p.name.startswith(".") for p in ckpt.iterdir())  # a save or deletion was under way
            checkpoint.clean_stale(ckpt)  # what the next run does first
            found = [p for p in ckpt.iterdir() if checkpoint.is_checkpoint(p)]
            assert found, f"kill {kill} ({point}): no checkpoint survived"
            for path in found:  # everything that looks like a checkpoint is one
                checkpoint.verify(path)
            assert checkpoint.is_complete(ckpt / "last.ckpt"), f"kill {kill} ({point}): last.ckpt is missing or incomplete"
            assert not [p for p in ckpt.iterdir() if p.name.startswith(".")], f"{point}: leftovers after clean_stale"
            saw_complete += len(found)
            resume = str(ckpt / "last.ckpt")  # and the next run resumes from it
    finally:
        server.stdin.close()
        server.wait(timeout=60)
    return KillLoop(len(points), tuple(threads), saw_complete, interrupted)


def serve() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the run: its output goes to a log, the server's stdout carries only answers
            log = os.open(Path(request["workdir"]) / "run.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(log, 1)
            os.dup2(log, 2)
            try:
                train(request)
                code = 0
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
