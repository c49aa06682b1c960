"""Two torchrun agents on loopback as two "nodes" of the elastic run (:mod:`scenarios.elastic_worker`):
each is ``torch.distributed.run --nnodes 1:2`` over a c10d rendezvous on 127.0.0.1, quick to notice a
lost node (heartbeat 1 s x 5) and waiting 10 s after the first node for the others (the start-up skew)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from scenarios.launch_env import torchrun_env

ROOT = Path(__file__).resolve().parents[1]
RDZV_CONF = "last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=300"


def start_agent(work: Path, port: int, node: str, ranks: int, host: bool) -> subprocess.Popen:
    """Agent ``node`` with ``ranks`` ranks of the elastic worker on WORKDIR ``work`` (its log: ``agent-NODE-I.log``);
    ``host``: it hosts the rendezvous store (the node that stays)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", str(ranks),
               "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "elastic-test", "--rdzv-conf", f"is_host={int(host)},{RDZV_CONF}",
               "--monitor-interval", "0.1", str(ROOT / "scenarios" / "elastic_worker.py"), str(work)]
    env = torchrun_env(ELASTIC_NODE=node, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", LOGLEVEL="INFO")
    log = open(work / f"agent-{node}-{len(list(work.glob(f'agent-{node}-*')))}.log", "w")  # noqa: SIM115
    return subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def stop_agents(agents: list[subprocess.Popen]) -> None:
    """SIGTERM to every agent still running (it stops its own ranks first); SIGKILL after 60 s."""
    for agent in agents:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(timeout=60)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
