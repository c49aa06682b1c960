"""Run a function on W gloo ranks of this machine (CPU processes) and collect what each returns.

What the tests and benchmarks use to stand up a small CPU "cluster"; also handy for trying the
runtime without a launcher. Each rank's result (or traceback) goes through a file, so a failure
reports every rank's error, not only the first victim's.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, world_size: int, port: int, out_dir: str, threads: int, environ: dict[str, str], cwd: str,
          fn: Callable[..., Any], args: tuple) -> None:
    # a forkserver child inherits the server's environment, not the caller's: take the caller's
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), NODE_RANK="0",  # Lightning then treats the processes as launched externally
    )
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    dist.destroy_process_group()
    # gloo's worker threads can still be releasing the last collective's tensors while the
    # interpreter shuts down, which aborts the process now and then (pytorch#190489); the result
    # is on disk, so leave without the interpreter's teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_local_ranks(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1, start_method: str = "spawn",
                    preload: Sequence[str] = ()) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank; the per-rank results in rank order.

    ``fn`` must be a module-level function (ranks are spawned and import it); a script calling this
    must guard its entry point with ``if __name__ == "__main__":``. ``threads``: torch intra-op
    threads per rank (1 keeps W ranks from fighting over a small machine's cores). ``start_method``:
    ``"spawn"`` or ``"forkserver"``; ``preload``: the modules a forkserver imports before its first
    fork (``multiprocessing``'s setting is per process and fixed once the server runs, so the first
    call's list holds for the rest of the process).
    """
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"run_local_ranks(start_method={start_method!r}): use 'spawn' or 'forkserver'")
    if preload and start_method != "forkserver":
        raise ValueError("run_local_ranks(preload=...) needs start_method='forkserver' (spawn imports everything per rank)")
    if preload:
        mp.get_context("forkserver").set_forkserver_preload(list(preload))
    sys.audit("cephalo_lightning.testing.run_local_ranks", world_size)  # lets a test suite see every launch
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_rank, args=(world_size, free_port(), out_dir, threads, dict(os.environ), os.getcwd(), fn, args),
                               nprocs=world_size, join=True, start_method=start_method)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            errors = []
            for rank in range(world_size):
                path = os.path.join(out_dir, f"{rank}.pt")
                if os.path.exists(path):
                    record = torch.load(path, weights_only=False)
                    if not record["ok"]:
                        errors.append(f"--- rank {rank}:\n{record['error']}")
            if isinstance(err, mp.ProcessExitedException) and not errors:
                raise  # killed by a signal: the caller may expect that
            raise RuntimeError("a rank failed:\n" + ("\n".join(errors) or str(err))) from None
        return [torch.load(os.path.join(out_dir, f"{rank}.pt"), weights_only=False)["result"] for rank in range(world_size)]
