"""``python -m cephalo_lightning lighthouse``: torchft's lighthouse, the one process every replica group
of ``CephaloStrategy(fault_tolerance=True)`` asks for its quorum.

Each step every group asks the lighthouse for a quorum; the lighthouse answers once every group it
heard from within ``--heartbeat-timeout-ms`` has asked (or ``--join-timeout-ms`` after the first
request, with at least ``--min-replicas`` groups), so a group that stops heartbeating is left out of
the next quorum ``--heartbeat-timeout-ms`` after its last beat: that is most of the recovery time.

It serves until SIGTERM or SIGINT (then exits 0). It prints the address the groups connect to, and
with ``--address-file`` writes it there (atomically), for job scripts whose groups start on other
nodes: they read it into ``TORCHFT_LIGHTHOUSE``.

[Note: the lighthouse is not replicated] It holds no training state: while it is down no quorum
forms and the groups wait (up to their quorum timeout); started again at the same address, it is
asked again. Run it where a failure ends the job anyway (the batch script's own node under SLURM).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from cephalo_lightning._common.atomic_io import write_text_atomic
from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning._common.help_text import PlainHelpFormatter

DEFAULT_BIND = "[::]:29510"
DEFAULT_HEARTBEAT_TIMEOUT_MS = 5_000
DEFAULT_JOIN_TIMEOUT_MS = 60_000


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cephalo_lightning lighthouse", description=__doc__.split("\n\n")[0],
                                formatter_class=PlainHelpFormatter)
    p.add_argument("--bind", default=DEFAULT_BIND,
                   help=f"HOST:PORT to listen on (default {DEFAULT_BIND}: every interface; port 0: any free port)")
    p.add_argument("--min-replicas", type=int, default=1,
                   help="the fewest groups a quorum may hold (default 1: one surviving group trains on alone)")
    p.add_argument("--join-timeout-ms", type=int, default=DEFAULT_JOIN_TIMEOUT_MS,
                   help="how long a quorum waits for a heartbeating group that has not asked yet "
                        f"(default {DEFAULT_JOIN_TIMEOUT_MS})")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=DEFAULT_HEARTBEAT_TIMEOUT_MS,
                   help="a group silent this long is left out of the next quorum "
                        f"(default {DEFAULT_HEARTBEAT_TIMEOUT_MS})")
    p.add_argument("--quorum-tick-ms", type=int, default=None, help="how often the lighthouse re-checks a quorum "
                   "(default: torchft's)")
    p.add_argument("--address-file", default=None,
                   help="also write the address the groups connect to into this file (atomically)")
    return p


def check(args: argparse.Namespace) -> None:
    """Refuse values torchft would take and misbehave on, naming the flag."""
    if args.min_replicas < 1:
        raise ConfigurationError(f"--min-replicas {args.min_replicas}: a quorum needs at least one group; give 1 or more")
    for flag in ("join_timeout_ms", "heartbeat_timeout_ms", "quorum_tick_ms"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ConfigurationError(f"--{flag.replace('_', '-')} {value}: give a positive number of milliseconds")
    host, _, port = args.bind.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigurationError(f"--bind {args.bind!r}: give HOST:PORT, e.g. 0.0.0.0:29510 or [::]:29510")


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    check(args)
    from cephalo_lightning.lightning.fit.fault_tolerance import require_torchft

    require_torchft()
    from torchft.coordination import LighthouseServer

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    server = LighthouseServer(bind=args.bind, min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
                              heartbeat_timeout_ms=args.heartbeat_timeout_ms, quorum_tick_ms=args.quorum_tick_ms)
    try:
        address = server.address()
        if args.address_file:
            write_text_atomic(Path(args.address_file), address + "\n")
        print(f"lighthouse at {address} (every group: TORCHFT_LIGHTHOUSE={address}); stop it with SIGTERM", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        server.shutdown()
    print("lighthouse stopped", file=sys.stderr, flush=True)
    return 0
