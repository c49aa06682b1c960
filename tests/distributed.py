"""Run a function on W gloo ranks (CPU processes) and collect what each returns."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), NODE_RANK="0",  # Lightning: processes launched externally
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank; returns the per-rank results in rank order.

    ``fn`` must be importable (a module-level function) because ranks are spawned.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.spawn(_worker, args=(world_size, free_port(), out_dir, fn, args), nprocs=world_size, join=True)
        except mp.ProcessRaisedException as err:
            # the first rank to fail is often a victim of another's crash: show every rank's error
            errors = []
            for rank in range(world_size):
                path = os.path.join(out_dir, f"{rank}.pt")
                if os.path.exists(path):
                    record = torch.load(path, weights_only=False)
                    if not record["ok"]:
                        errors.append(f"--- rank {rank}:\n{record['error']}")
            raise AssertionError("a rank failed:\n" + ("\n".join(errors) or str(err))) from None
        results = []
        for rank in range(world_size):
            record = torch.load(os.path.join(out_dir, f"{rank}.pt"), weights_only=False)
            if not record["ok"]:
                raise AssertionError(f"rank {rank} failed:\n{record['error']}")
            results.append(record["result"])
        return results
