"""``python -m cephalo_lightning lighthouse``: a working torchft lighthouse behind a public entry point.

Started as a job script starts it (its own process, port 0, ``--address-file``), it must answer two
replica groups' quorum requests with one quorum of both (what every step of
``CephaloStrategy(fault_tolerance=True)`` asks), and stop on SIGTERM with status 0. Bad values are
refused before it binds, naming the flag.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest

from cephalo_lightning.__main__ import main as cli_main
from tests.conftest import HANG_TIMEOUT_S, clean_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_the_lighthouse_answers_two_groups_with_one_quorum_and_stops_on_sigterm(tmp_path):
    pytest.importorskip("torchft")
    from torchft.coordination import LighthouseClient

    address_file = tmp_path / "lighthouse"
    process = subprocess.Popen([sys.executable, "-m", "cephalo_lightning", "lighthouse", "--bind", "127.0.0.1:0",
                                "--address-file", str(address_file), "--min-replicas", "2"],
                               cwd=ROOT, env=clean_env(PYTHONPATH=str(ROOT), RUST_LOG="warn"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + HANG_TIMEOUT_S
        while not address_file.exists():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
            time.sleep(0.05)
        address = address_file.read_text().strip()
        assert address.startswith("http://")

        def ask(group: int):
            client = LighthouseClient(address, connect_timeout=timedelta(seconds=10))
            return client.quorum(replica_id=f"cephalo_group_{group}", timeout=timedelta(seconds=30),
                                 address=f"http://127.0.0.1:{2000 + group}", store_address=f"127.0.0.1:{3000 + group}",
                                 step=0, world_size=1, shrink_only=False)

        with ThreadPoolExecutor(2) as pool:  # min_replicas=2: neither request is answered alone
            quorums = list(pool.map(ask, (0, 1)))
        assert {q.quorum_id for q in quorums} == {quorums[0].quorum_id}
        assert sorted(m.replica_id for m in quorums[0].participants) == ["cephalo_group_0", "cephalo_group_1"]
    finally:
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=HANG_TIMEOUT_S)
    assert process.returncode == 0, out
    assert f"TORCHFT_LIGHTHOUSE={address}" in out


@pytest.mark.parametrize(("argv", "named"), [
    (["--min-replicas", "0"], "--min-replicas 0"),
    (["--heartbeat-timeout-ms", "-5"], "--heartbeat-timeout-ms -5"),
    (["--bind", "29510"], "--bind '29510'"),
])
def test_bad_values_are_refused_naming_the_flag(argv, named, capsys):
    assert cli_main(["lighthouse", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err
