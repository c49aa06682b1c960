"""``make demo`` keeps its headline: the shipped quickstart, profiled as the demo profiles it, has a
baseline that fits (the even plan, FSDP's split), so the demo measures the Cephalo plan against it
side by side; and the demo's lines say what the baseline is and the measured ratio."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cephalo_lightning._common.vocabulary import Planner
from cephalo_lightning.demo.run import Baseline, fair_baseline, speed_up_lines
from cephalo_lightning.planner import PlanningError, cluster_from_dict, load_cluster, plan
from tests.conftest import HANG_TIMEOUT_S, clean_env, failure_report
from tests.planner_cases import small_cluster

GLOBAL_BATCH = 32  # the quickstart's vars.global_batch


@pytest.mark.multiprocess
def test_the_shipped_quickstarts_even_plan_fits_so_the_demo_measures_against_it(tmp_path):
    """The quickstart profiled by ``python -m cephalo_lightning profile`` (both emulated ranks, as
    the demo's callback does): the even plan of its global batch fits, with one common micro-batch
    count, and it is the demo's baseline. (With 0.012 GiB on rank 0 half the state and one sample
    needed 11.3 MiB of 11.1 MiB usable: the demo printed "even plan: infeasible here".)"""
    cluster_file = tmp_path / "cluster.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "cephalo_lightning", "profile", "--config", "quickstart", "-o", str(cluster_file),
         f"--vars.out={tmp_path / 'run'}"], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
        timeout=HANG_TIMEOUT_S)
    assert done.returncode == 0, failure_report(done)
    cluster = load_cluster(cluster_file)
    even = plan(cluster, GLOBAL_BATCH, planner=Planner.EVEN)  # raises where it does not fit
    assert even.batch_sizes == [16, 16] and [r.state_share for r in even.ranks] == [0.5, 0.5]
    assert len(set(even.num_micro_batches)) == 1
    baseline = fair_baseline(cluster, GLOBAL_BATCH)
    assert isinstance(baseline, Baseline) and baseline.plan == even


def test_where_the_even_plan_cannot_fit_the_fastest_feasible_baseline_is_named():
    data = small_cluster()
    data["devices"][1]["memory_gb"] = 6  # b cannot hold 1/3 of the state beside a sample: of the baselines only the
    # reference planner's uneven shares fit
    cluster = cluster_from_dict(data)
    with pytest.raises(PlanningError):
        plan(cluster, 12, planner=Planner.EVEN)
    feasible = {}
    for name in ("proportional", "poplar", "reference", "ddp-even", "hsdp-even"):
        try:
            feasible[name] = plan(cluster, 12, planner=name).predicted_samples_per_s
        except PlanningError:
            continue
    baseline = fair_baseline(cluster, 12)
    assert isinstance(baseline, Baseline)
    assert baseline.plan.planner == max(feasible, key=feasible.get)
    assert "the even plan does not fit" in baseline.described


def test_the_demo_prints_the_measured_ratio_and_what_it_was_measured_against():
    even = plan(cluster_from_dict(small_cluster()), 12, planner=Planner.EVEN)
    lines = speed_up_lines({"measured_samples_per_s": 230.8, "predicted_samples_per_s": 303.7},
                           Baseline(even, "even plan (FSDP's: equal batches and state shares, one micro-batch each)"),
                           {"measured_samples_per_s": 90.0, "predicted_samples_per_s": 120.5})
    assert lines == [
        "  baseline:     the even plan (FSDP's: equal batches and state shares, one micro-batch each)",
        "                90.0 samples/s measured side by side, 120.5 predicted",
        "  speed-up:     Cephalo is 2.56x faster than the baseline, measured on the CPU-emulated cluster "
        "(predicted 2.52x)",
    ]
