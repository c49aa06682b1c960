"""Plans a person can read: what binds each rank (checked against the cost model's own figures on
clusters built so that each constraint binds), the table's legend, baselines and lines, the help
texts, ``plan --plot`` and the blocks of docs/plan-reading.md."""

from __future__ import annotations

from typing import Any

import pytest

from cephalo_lightning.planner import Cluster, Plan, cluster_from_dict, plan
from cephalo_lightning.planner.cost import DeviceCost, collective_ms
from cephalo_lightning.planner.plan import Binding

LAYERS = 4


def device(name: str, memory: float, compute_memory: list[float], fwd: list[float] | None = None,
           count: int = 1) -> dict[str, Any]:
    fwd = fwd or [1.0, 2.0]
    return {"name": name, "memory_gb": memory, "layer_fwd_ms": fwd, "layer_bwd_ms": [2 * f for f in fwd],
            "compute_memory_gb": compute_memory, "count": count}


def cluster(devices: list[dict[str, Any]], **settings: Any) -> Cluster:
    """A 1e9-parameter model (14.9 GiB of state at 16 bytes a parameter), nothing reserved, no
    micro-batch overhead, all of every device's memory usable."""
    return cluster_from_dict({
        "model": {"name": "m", "num_layers": LAYERS, "parameters": 1_000_000_000},
        "settings": {"reserved_memory_gb": 0, "micro_batch_overhead_ms": 0, "usable_memory_fraction": 1.0, **settings},
        "devices": devices})


def s(value: float) -> str:
    return f"{value:.3g} s"


# two big devices and a small one whose one sample does not fit beside its share of the state,
# over a slow link (20 ms per layer's all-gather and reduce-scatter): the big ones are link-bound
SLOW_LINK = cluster([device("big", 80, [1.0, 2.0], count=2), device("small", 8, [7.5, 15.0])],
                    allgather_ms=20.0, reduce_scatter_ms=20.0)
FAST = cluster([device("a", 80, [1.0, 2.0], fwd=[10.0, 20.0], count=2)])  # no collectives priced: compute binds


def test_a_rank_without_samples_because_of_memory_says_what_one_sample_would_need() -> None:
    p = plan(SLOW_LINK, 8)
    small = p.ranks[2]
    assert small.batch_size == 0 and small.binding is Binding.MEMORY
    cost = DeviceCost(SLOW_LINK.devices[2], SLOW_LINK)
    need = cost.memory_gb(1, small.state_share, 0.0, num_micro_batches=1, batch_size=1)
    assert need > small.memory_limit_gb == 8.0
    assert small.why == (f"stores {100 * small.state_share:.3g}% of the state; computing one sample would need "
                         f"{need:.3g} GiB of 8 GiB usable")
    assert Plan.from_dict(p.to_dict()).ranks == p.ranks  # the plan JSON carries binding and why


def test_link_bound_ranks_name_their_collectives_and_compute() -> None:
    p = plan(SLOW_LINK, 8)
    ag, rs, exposed = collective_ms(SLOW_LINK, p.state_shares)
    cost = DeviceCost(SLOW_LINK.devices[0], SLOW_LINK)
    for r in p.ranks[:2]:
        fwd, bwd = cost.compute_ms(r.batch_size, r.num_micro_batches, r.recompute)
        compute = LAYERS * (fwd + bwd) / 1e3
        collectives = LAYERS * (2 * ag[r.rank] + rs[r.rank] + exposed[r.rank]) / 1e3  # gather twice, reduce once
        assert collectives > compute
        assert r.binding is Binding.LINK
        assert r.why == (f"its collectives take {s(collectives)} of the {s(p.predicted_step_s)} step, more than its "
                         f"compute ({s(compute)})")


def test_compute_bound_ranks_set_the_step_with_their_compute() -> None:
    p = plan(FAST, 4)
    cost = DeviceCost(FAST.devices[0], FAST)
    for r in p.ranks:
        step = cost.step_s(r.batch_size, r.num_micro_batches, 0.0, 0.0, r.state_share, r.recompute)
        assert step == pytest.approx(p.predicted_step_s, rel=1e-12)
        assert r.binding is Binding.COMPUTE
        assert r.why == f"its compute ({s(step)}) sets the step of {s(step)}; its collectives take 0 s"


def test_a_rank_one_sample_short_of_the_step_is_bound_by_granularity() -> None:
    p = plan(FAST, 3)  # two identical ranks, three samples: one rank computes two, the other one
    short = min(p.ranks, key=lambda r: r.batch_size)
    assert short.batch_size == 1
    cost = DeviceCost(FAST.devices[short.rank], FAST)
    now = cost.step_s(1, 1, 0.0, 0.0, short.state_share, short.recompute)
    more = min(cost.step_s(2, n, 0.0, 0.0, short.state_share) for n in (1, 2))  # no graph memory measured: recompute
    assert now < p.predicted_step_s <= more
    assert short.binding is Binding.GRANULARITY
    assert short.why == (f"one sample more would take it from {s(now)} to {s(more)}, at or past the step of "
                         f"{s(p.predicted_step_s)}")
    longest = max(p.ranks, key=lambda r: r.batch_size)
    assert longest.binding is Binding.COMPUTE


def test_a_binding_that_is_not_one_of_the_four_is_refused_in_a_plan_file() -> None:
    data = plan(FAST, 4).to_dict()
    data["ranks"][0]["binding"] = "bandwidth"
    with pytest.raises(Exception, match=r"ranks\[0\]\.binding \(rank 0\) must be one of \['compute', 'memory', 'link', "
                                        r"'granularity'\], got 'bandwidth'"):
        Plan.from_dict(data)
