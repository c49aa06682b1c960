"""The run-with-failures benchmark's bounds, without running it: a launched process tree ended whole
(:mod:`scenarios.process_tree`, against ``sleep`` processes, one in a session of its own as torchrun
starts its ranks), torchrun started without the store it would share with restarted ranks, and an arm
past its deadline printed as such (no figures, no ratio)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmarks import bench_ft_failures as bench
from scenarios.launch_env import clean_env, torchrun_env
from scenarios.process_tree import descendants, end_tree

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_end_tree_ends_the_launcher_and_the_children_in_sessions_of_their_own() -> None:
    # a launcher whose children are a plain one and one in its own session (torchrun's ranks are)
    launcher = subprocess.Popen(["sh", "-c", "sleep 60 & setsid sleep 60 & wait"], start_new_session=True)
    deadline = time.monotonic() + 20
    while len(descendants(launcher.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    children = descendants(launcher.pid)
    assert len(children) == 2, children
    end_tree(launcher)
    deadline = time.monotonic() + 20
    while any(map(_alive, children)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert launcher.returncode is not None and not any(map(_alive, children))


def test_torchrun_is_started_without_sharing_its_store_with_the_ranks() -> None:
    assert torchrun_env()["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in clean_env()


def test_the_deadline_grows_with_the_steps_and_the_lives() -> None:
    assert bench.kill_steps(36, 8) == [8, 16, 24] and bench.kill_steps(16, 6) == [6]
    full, quick = bench.deadline_s(36, 3), bench.deadline_s(16, 1)
    assert full > quick > 0
    assert bench.deadline_s(36, 4) > full and bench.deadline_s(37, 3) > full


def _row(way: str, **fields) -> dict:
    return {"way": way, "wall_s": 50.0, "kills": 1, "steps": 16, "completed_again": 0, "interrupted_redone": 1,
            "processes": 3, "finished": True, "deadline_s": 840.0, "failure": None, "log_tail": [], **fields}


def test_an_arm_past_its_deadline_prints_so_and_no_ratio(capsys) -> None:
    result = {"steps": 16, "every": 6, "checkpoint_every": 4, "heartbeat_timeout_ms": 2000, "load": [1.0, 2.0, 2],
              "rows": [_row("fault tolerance (torchft)"),
                       _row("checkpoint-restart (torchrun, ckpt every 4)", finished=False, wall_s=840.2, steps=9,
                            processes=4, log_tail=["--- torchrun.log", "waiting for the rendezvous"])]}
    bench.print_report(result)
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("checkpoint-restart"))
    assert "did not finish in 840 s" in line and "9 of 16 steps committed" in line
    assert "    waiting for the rendezvous" in out
    assert "wall time:" not in out and "no ratio: an arm did not finish" in out
    result["rows"][1] = _row("checkpoint-restart (torchrun, ckpt every 4)", wall_s=100.0)
    bench.print_report(result)
    assert "fault tolerance / checkpoint-restart wall time: 0.50" in capsys.readouterr().out
