"""The planner answers at any size: a plan, or a clear error above its documented limits.

Each check runs the torch-free planner in a subprocess under a 2 GiB address-space limit; how
long each takes is checked by ``benchmarks/wall_clock_checks.py planner`` and measured by
``benchmarks/bench_planner.py``, not here (the timeout only stops a hang).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cephalo_lightning.planner import PlanningError, cluster_from_dict, load_cluster, plan
from cephalo_lightning.planner.schema.limits import MAX_GLOBAL_BATCH, MAX_RANKS
from tests.conftest import HANG_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = ROOT / "configs" / "clusters"
KINDS = ["h100", "a100-80gb", "a100-40gb", "l40s", "a6000", "v100-32gb", "l4", "t4"]
GPT67 = {"name": "gpt-6.7b", "num_layers": 32, "parameters": 6658203648, "hidden_size": 4096, "seq_len": 1024}
MEMORY_LIMIT = 2 * 2**30


def run_limited(args: list[str], timeout: float = HANG_TIMEOUT_S) -> tuple[int, str]:
    """``plan`` CLI in a fresh torch-free interpreter under the memory limit: (rc, stderr)."""
    code = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))
        for name in ("torch", "lightning", "pytorch_lightning"):
            sys.modules[name] = None
        from cephalo_lightning.planner.command import main
        sys.exit(main({args!r}))
    """)
    env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                            timeout=timeout)
    return result.returncode, result.stderr


def million_gpus(tmp_path: Path) -> Path:
    path = tmp_path / "million.json"
    path.write_text(json.dumps({"model": GPT67, "settings": {"link_bandwidth_gbps": 50},
                                "devices": [{"name": k, "count": 125_000} for k in KINDS]}))
    return path


@pytest.mark.multiprocess
def test_a_billion_samples_on_four_gpus_is_a_clear_error_in_seconds() -> None:
    rc, err = run_limited([str(CLUSTERS / "l4-a6000-p40.yaml"), "--global-batch-size", "1000000000"])
    assert rc == 2, (rc, err)
    assert "1,000,000,000" in err and f"limit of {MAX_GLOBAL_BATCH:,}" in err and "accumulate_grad_batches" in err


@pytest.mark.multiprocess
def test_a_million_gpus_is_a_clear_error_in_seconds(tmp_path: Path) -> None:
    rc, err = run_limited([str(million_gpus(tmp_path)), "-b", "65536"])
    assert rc == 2, (rc, err)
    assert "1,000,000 ranks" in err and f"limit of {MAX_RANKS:,}" in err and "divided by 10" in err


@pytest.mark.multiprocess
def test_the_limits_themselves_plan_within_memory() -> None:
    """At the largest batch on 4 GPUs the plan comes back under the same limits."""
    rc, err = run_limited([str(CLUSTERS / "l4-a6000-p40.yaml"), "-b", str(MAX_GLOBAL_BATCH), "--json"])
    assert rc == 0, err


def test_limits_in_process() -> None:
    cluster = load_cluster(CLUSTERS / "l4-a6000-p40.yaml")
    with pytest.raises(PlanningError, match="accumulate the rest"):
        plan(cluster, MAX_GLOBAL_BATCH + 1)
    big = cluster_from_dict({"model": GPT67, "devices": [{"name": "a100-80gb", "count": MAX_RANKS + 1}]})
    with pytest.raises(PlanningError, match=f"{MAX_RANKS:,}"):
        plan(big, 65536)
