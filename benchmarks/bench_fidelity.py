"""Plan fidelity: predicted vs measured step time and peak memory, before and after calibration.

    python -m benchmarks.bench_fidelity            # clusters A, C, D, E (EMULATED; minutes)
    python -m benchmarks.bench_fidelity --quick    # the same clusters, fewer steps
    python -m benchmarks.bench_fidelity --clusters A,C,D,E,F,S1,S2 --json fidelity.json

THE CLUSTERS ARE EMULATED ON CPU: every rank is a CPU process on this machine (gloo), slowed by
sleeping after each compute region and given an accounted memory capacity
(:class:`~cephalo_lightning.runtime.emulation.emulator.DeviceEmulator`); no GPU is involved.

Only the public Lightning path is used. Per cluster, in one spawned group of ranks:

1. profile: a 1-step ``Trainer.fit`` with ``CephaloCallback`` (which profiles every emulated rank at
   setup) gives the planner's cluster, and ``planner.plan`` plans it in the cluster's mode;
2. calibrate: ``Trainer.fit(strategy=CephaloStrategy(plan=..., emulate=...))`` with a watching
   ``CephaloCallback`` measures that plan as the callback's defaults calibrate (``calibrate_after_windows``
   windows of ``watch_every_n_steps`` steps after the first); its windows (median step wall time, every
   rank's median busy time) are the observations :func:`~cephalo_lightning.planner.cost.calibration_fit.fit_calibration` fits;
3. predict, then measure: other plans of the same profile (another global batch, the even baseline,
   the other mode, the calibrated optimum: other batches, micro-batch counts, shares and modes) are
   priced by the profile alone (BEFORE) and by the calibrated cluster (AFTER), then measured the
   same way. No measured step of these plans enters the fit: the figures test prediction, not fitting.

Every plan is measured once per round (``rounds``, the order rotated; the host's load drifts over
minutes and should reach every plan alike); a plan's measured step is the median over the windows of
all its rounds (the first ``warmup_windows`` windows of each run, about the calibration's first 10 steps, are
left out: a run's first steps are slower). The
goal: AFTER within 10% of the measured step on the plans not fitted, and peak memory never under-predicted (calibration does not touch memory).
Where the profile records the host's cores (CPU ranks on one host), the same windows are also fitted by
the per-rank model without the shared-host bound, and its errors printed beside (a paired comparison);
so are they by each rank's passes summed (``settings.sync_passes`` off, the model before a shard group's
passes ended together). ``--json`` also carries every cluster's profile (``profiled``, a cluster file's dict) and every plan with its
watch windows, so another cost model can be fitted to the same measurements offline.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks import _common as common
from benchmarks.harness import Benchmark
from cephalo_lightning.lightning.callback.callback_config import CallbackConfig  # noqa: E402
from cephalo_lightning.planner.cost.calibration_fit import (  # noqa: E402 - torch-free
    fit_calibration,
    plan_label,
    predicted,
    predicted_collective_s,
)
from cephalo_lightning.planner.cost.cluster_cost import predicted_busy_s  # noqa: E402 - torch-free
from cephalo_lightning.planner.schema.cluster import cluster_to_dict  # noqa: E402 - torch-free


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    mode: str
    emulate: tuple[tuple[float, float], ...]  # (slowdown, memory_gb) per rank
    global_batch: int
    note: str


CLUSTERS = (
    ClusterSpec("A", "layered", ((1.0, 0.02), (3.0, 0.5)), 32, "2 ranks, fast rank tight (quickstart)"),
    ClusterSpec("B", "uniform", ((1.0, 0.5), (2.0, 0.5)), 32, "2 ranks, both loose"),
    ClusterSpec("C", "layered", ((1.0, 0.03), (2.0, 0.5), (4.0, 0.5)), 48, "3 ranks, slowdowns 1-4"),
    ClusterSpec("D", "uniform", ((1.0, 0.05), (1.5, 0.05), (3.0, 0.05)), 48, "3 ranks, all tight"),
    ClusterSpec("E", "layered", ((1.0, 0.5), (4.0, 0.5)), 32, "2 ranks, both loose, x4"),
    ClusterSpec("F", "layered", ((1.0, 0.02), (1.0, 0.02), (2.0, 0.5), (4.0, 0.5)), 48, "4 ranks on 2 cores"),
    # controls, to tell the model's errors from the host's: no collectives and no neighbour; two equal ranks
    ClusterSpec("S1", "layered", ((1.0, 0.5),), 16, "control: one rank"),
    ClusterSpec("S2", "layered", ((1.0, 0.5), (1.0, 0.5)), 32, "control: two equal ranks"),
)


@dataclass(frozen=True)
class Config:
    preset: str = "small"  # the demo GPT of configs/quickstart.yaml: 4 blocks x 128, ~0.9M parameters
    seq_len: int = 64
    profile_k: int = 8
    usable_memory_fraction: float = 0.9
    window: int = 3  # CephaloCallback(watch_every_n_steps=window) of the plans measured to test the predictions
    windows: int = 2  # measured windows per run after the warm-up
    # windows left out of every measured run: its first steps run slower (the first counts every tensor;
    # steps 3-8 measured ~4% slower than steps 10-29 of the same plan), and the calibration run leaves
    # out its first window of 10 steps
    warmup_windows: int = 3
    # the calibration run sees what CephaloCallback's defaults fit: calibrate_after_windows windows of
    # watch_every_n_steps steps after the first
    calibration_window: int = CallbackConfig.watch_every_n_steps
    calibration_windows: int = CallbackConfig.calibrate_after_windows
    rounds: int = 3  # every plan measured once per round, interleaved
    threads: int = 1


QUICK = Config(window=3, windows=1, rounds=2)


def _specs(cluster: ClusterSpec) -> list[dict[str, float]]:
    return [{"slowdown": s, "memory_gb": m} for s, m in cluster.emulate]


def _trainer(world: int, strategy: Any, steps: int, callbacks: list) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=steps, precision="32-true",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=callbacks,
    )


def _fit(cfg: Config, cluster: ClusterSpec, strategy: Any, steps: int, callback: Any, batch: int | None = None) -> None:
    import lightning.pytorch as pl

    from cephalo_lightning.demo import GPTModule, TextDataModule

    pl.seed_everything(0, verbose=False)
    module = GPTModule(preset=cfg.preset, seq_len=cfg.seq_len, warmup_steps=2, lr_decay_steps=steps)
    module.configure_model()  # built now, from the seed: every strategy compared starts from the same weights
    data = TextDataModule(seq_len=cfg.seq_len, batch_size=batch or cluster.global_batch)
    _trainer(len(cluster.emulate), strategy, steps, [callback]).fit(module, data)


def _measure_plan(cfg: Config, cluster: ClusterSpec, plan: Any, calibration: bool = False) -> dict[str, Any]:
    """Run ``plan`` for ``window * (warmup_windows + windows)`` steps (the calibration run: the callback's
    defaults, ``calibration_window * (1 + calibration_windows)``); the watcher's windows after the warm-up."""
    from cephalo_lightning import CephaloCallback, CephaloStrategy

    window, warmup, windows = ((cfg.calibration_window, 1, cfg.calibration_windows) if calibration
                               else (cfg.window, cfg.warmup_windows, cfg.windows))
    watcher = CephaloCallback(watch_every_n_steps=window, print_plan=False, quiet=True, cache_dir=None,
                              calibrate_after_windows=0)
    _fit(cfg, cluster, CephaloStrategy(plan=plan, emulate=_specs(cluster), mode=plan.mode),
         window * (warmup + windows), watcher, batch=plan.global_batch_size)
    return {"plan": plan, "history": watcher.history[warmup:]}


def _other_plans(profiled: Any, calibrated: Any, cluster: ClusterSpec, fitted: Any) -> list[tuple[str, Any]]:
    """Plans that differ from the fitted one in batch, micro-batch counts, shares or mode (those that fit)."""
    from cephalo_lightning.planner import PlanningError
    from cephalo_lightning.planner import plan as make_plan

    other_mode = "uniform" if cluster.mode == "layered" else "layered"
    B = cluster.global_batch
    wanted = [
        (f"B={B * 3 // 2}", lambda: make_plan(profiled, B * 3 // 2, mode=cluster.mode)),
        (f"B={B // 2}", lambda: make_plan(profiled, B // 2, mode=cluster.mode)),
        ("even", lambda: make_plan(profiled, B, mode=cluster.mode, planner="even")),
        (other_mode, lambda: make_plan(profiled, B, mode=other_mode)),
        ("calibrated optimum", lambda: make_plan(calibrated, B, mode=cluster.mode)),
    ]
    out: list[tuple[str, Any]] = []
    for name, make in wanted:
        try:
            candidate = make()
        except PlanningError:
            continue
        if all(candidate.ranks != p.ranks or candidate.mode != p.mode for _, p in [("fitted", fitted), *out]):
            out.append((name, candidate))
    return out


def profile(cfg: Config, cluster: ClusterSpec) -> Any:
    """Collective: every rank profiled by ``CephaloCallback`` (one step, no cache): the profiled cluster."""
    from cephalo_lightning import CephaloCallback, CephaloStrategy

    # the layers are profiled through the layered protocol whichever mode the plan then runs in
    profiler = CephaloCallback(max_micro_batch=cfg.profile_k, cache_dir=None, watch_every_n_steps=0, mode=cluster.mode,
                               settings={"usable_memory_fraction": cfg.usable_memory_fraction},
                               print_plan=False, quiet=True, calibrate_after_windows=0)
    _fit(cfg, cluster, CephaloStrategy(emulate=_specs(cluster)), 1, profiler)
    assert profiler.cluster is not None
    return profiler.cluster


def _rank_main(rank: int, world: int, cfg: Config, cluster: ClusterSpec) -> dict[str, Any]:
    from cephalo_lightning.planner import plan as make_plan
    from cephalo_lightning.planner.cost.calibration import with_calibration

    common.quiet_lightning()
    common.pin_threads(cfg.threads)
    start = time.perf_counter()
    profiled = profile(cfg, cluster)
    profile_s = time.perf_counter() - start
    plan = make_plan(profiled, cluster.global_batch, mode=cluster.mode)
    fitted = _measure_plan(cfg, cluster, plan, calibration=True)
    from cephalo_lightning.runtime.distributed import broadcast_object

    # each rank's windows hold its own step walls: rank 0's fit, for every rank (one plan everywhere)
    calibration = broadcast_object(fit_calibration(profiled, observations(plan, fitted["history"]),
                                                   fitted_on=plan_label(plan)) if rank == 0 else None)
    calibrated = with_calibration(profiled, calibration)
    others = _other_plans(profiled, calibrated, cluster, plan)
    # rounds: every plan (the fitted one too) once per round, the order rotated, so that the host's
    # load, which drifts over minutes, reaches every plan alike; a plan's step is its median over rounds
    measured: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in [("fitted on", plan), *others]}
    measured["fitted on"].extend(fitted["history"])
    runs = [("fitted on", plan), *others]
    for r in range(cfg.rounds):
        order = runs[r % len(runs):] + runs[:r % len(runs)]
        for name, p in order:
            if r == 0 and name == "fitted on":
                continue  # round 0 of the fitted plan is the calibration run
            measured[name].extend(_measure_plan(cfg, cluster, p)["history"])
    return {"cluster": profiled, "plan": plan, "history": measured["fitted on"], "calibration": calibration,
            "others": [{"name": name, "plan": p, "history": measured[name]} for name, p in others],
            "fit_windows": len(fitted["history"]), "profile_s": profile_s}


def observations(plan: Any, history: list[dict[str, Any]]) -> list[Any]:
    """The watcher's windows as the fit's observations: the median step and every rank's median busy time."""
    from cephalo_lightning.lightning.callback.run_model import observations as from_windows

    return from_windows(plan, history)


def _without_bound(cluster: Any) -> Any:
    """The cluster without the shared-host bound (no host_cores): the per-rank model alone."""
    from dataclasses import replace

    return replace(cluster, settings=replace(cluster.settings, host_cores=None))


def _passes_summed(cluster: Any) -> Any:
    """The cluster priced by each rank's passes summed (``settings.sync_passes`` off): the model before
    every pass of a shard group ended together."""
    from dataclasses import replace

    return replace(cluster, settings=replace(cluster.settings, sync_passes=False))


def _profiled_collectives(calibrated: Any) -> Any:
    """The calibrated cluster with the profile's collectives in place of the fitted ones (how a plan of
    the other mode than the fitted plan's was priced before a pass's later gathers were told apart)."""
    from dataclasses import replace

    from cephalo_lightning.planner.cost.collective_prices import communication

    profile = replace(calibrated, calibration=None)
    comm = communication(profile)
    return replace(calibrated, calibration=replace(
        calibrated.calibration, allgather_ms=comm.allgather_ms, reduce_scatter_ms=comm.reduce_scatter_ms,
        overlap=comm.overlap))


def _plan_row(name: str, plan: Any, history: list[dict[str, Any]], profiled: Any, calibrated: Any,
              fitted: bool, unbound: tuple[Any, Any] | None = None,
              summed: tuple[Any, Any] | None = None) -> dict[str, Any]:
    measured = statistics.median(w["step_s"] for w in history)  # windows of every round
    before, after = predicted(profiled, plan)[0], predicted(calibrated, plan)[0]
    cal = calibrated.calibration
    paired: dict[str, Any] = {  # paired: the same measurements, the profile's collectives
        "error_after_profiled_collectives": measured / predicted(_profiled_collectives(calibrated), plan)[0] - 1,
        # a plan of the other mode under the fitted grouping (under another, both price the profile's collectives)
        "other_mode": plan.mode != cal.mode and cal.prices_collectives_of([r.shard_group for r in plan.ranks]),
    }
    if unbound is not None:  # the same measurements against the per-rank model alone, fitted again without the bound
        before_u, after_u = predicted(unbound[0], plan)[0], predicted(unbound[1], plan)[0]
        paired.update({"error_before_unbound": measured / before_u - 1, "error_after_unbound": measured / after_u - 1,
                       "bound_binds_after": after > predicted(_without_bound(calibrated), plan)[0] * (1 + 1e-9)})
    if summed is not None:  # the same measurements against each rank's passes summed, fitted again
        before_s, after_s = predicted(summed[0], plan)[0], predicted(summed[1], plan)[0]
        paired.update({"predicted_before_summed_s": before_s, "error_after_summed": measured / after_s - 1})
    memory = []
    for i, r in enumerate(plan.ranks):
        peaks = [w["ranks"][i]["peak_memory_gb"] for w in history if w["ranks"][i]["peak_memory_gb"] is not None]
        if peaks and r.predicted_memory_gb:
            memory.append(max(peaks) / r.predicted_memory_gb)
    collectives = [min(r["measured_collective_s"] for r in w["ranks"]) for w in history
                   if len(w["ranks"]) > 1 and all(r.get("measured_collective_s") is not None for r in w["ranks"])]
    detail = {  # what tells the terms apart: every rank's compute, the collectives as run
        "shares": [round(r.state_share, 4) for r in plan.ranks], "recompute": [r.recompute for r in plan.ranks],
        "measured_busy_s": [statistics.median(w["ranks"][i]["measured_busy_s"] for w in history)
                            for i in range(len(plan.ranks))],
        "predicted_busy_after_s": predicted(calibrated, plan)[1],
        "measured_collective_s": statistics.median(collectives) if collectives else None,
        "measured_busy_wall_s": [statistics.median(w["ranks"][i]["measured_busy_wall_s"] for w in history)
                                 for i in range(len(plan.ranks))],
        "measured_collective_per_rank_s": [  # None where not measured (CUDA: no host span says it)
            None if any(w["ranks"][i]["measured_collective_s"] is None for w in history)
            else statistics.median(w["ranks"][i]["measured_collective_s"] for w in history)
            for i in range(len(plan.ranks))],
        "predicted_collective_after_s": predicted_collective_s(calibrated, plan),
    }
    return {"name": name, "label": plan_label(plan), "plan": plan.to_dict(), "windows": history,
            "fitted": fitted, "measured_step_s": measured, **detail,
            "predicted_before_s": before, "predicted_after_s": after,
            "error_before": measured / before - 1, "error_after": measured / after - 1,
            "window_errors_after": [w["step_s"] / after - 1 for w in history],
            "memory_ratio_max": max(memory) if memory else None, **paired}


def measure_cluster(cfg: Config, cluster: ClusterSpec) -> dict[str, Any]:
    from cephalo_lightning.planner.cost.calibration import with_calibration

    try:
        per_rank = common.run_ranks(_rank_main, len(cluster.emulate), cfg, cluster, threads=cfg.threads)
    except RuntimeError as err:  # e.g. an emulated OOM: the plan did not hold; report it, measure the rest
        lines = [line for line in str(err).splitlines() if "Error:" in line and "Traceback" not in line]
        return {"cluster": asdict(cluster), "mode": cluster.mode, "failed": lines[0] if lines else str(err)[-300:]}
    r0 = per_rank[0]
    profiled, plan, history, calibration = r0["cluster"], r0["plan"], r0["history"], r0["calibration"]
    calibrated = with_calibration(profiled, calibration)
    fit_on = observations(plan, history[:r0["fit_windows"]])  # the calibration run's windows

    def refitted(model: Any) -> tuple[Any, Any]:  # paired: the same windows fitted by another model
        return model, with_calibration(model, fit_calibration(model, fit_on))

    # the per-rank model alone (no shared-host bound); each rank's passes summed (no synced passes)
    unbound = refitted(_without_bound(profiled)) if profiled.settings.host_cores else None
    summed = refitted(_passes_summed(profiled)) if profiled.settings.sync_passes else None
    plans = [_plan_row("fitted on", plan, history, profiled, calibrated, True, unbound, summed)]
    plans += [_plan_row(o["name"], o["plan"], o["history"], profiled, calibrated, False, unbound, summed)
              for o in r0["others"]]
    # paired: the same plans against a calibration fitted on the fitted plan's windows of every round (still
    # one plan's steps, but as many windows as each prediction is measured on): what the fit's own window costs
    pooled = with_calibration(profiled, fit_calibration(profiled, observations(plan, history)))
    for row, p in zip(plans, [plan, *(o["plan"] for o in r0["others"])]):
        row["error_after_pooled"] = row["measured_step_s"] / predicted(pooled, p)[0] - 1
    measured_step = plans[0]["measured_step_s"]
    # the noise floor: the fitted plan itself, re-measured in the later rounds, against its calibrated prediction
    plans[0]["remeasured_errors"] = plans[0]["window_errors_after"][r0["fit_windows"]:]
    compute = predicted_busy_s(profiled, plan)  # layers and optimizer step, as the busy time counts them
    rows = []
    for i, r in enumerate(plan.ranks):
        busy = statistics.median(w["ranks"][i]["measured_busy_s"] for w in history)
        peaks = [w["ranks"][i]["peak_memory_gb"] for w in history if w["ranks"][i]["peak_memory_gb"] is not None]
        peak = max(peaks) if peaks else None
        rows.append({
            "rank": i, "device": profiled.devices[i].name, "batch": r.batch_size, "micro_batches": r.num_micro_batches,
            "share": r.state_share, "recompute": r.recompute,
            "predicted_step_s": r.predicted_step_s, "measured_step_s": measured_step,
            "step_ratio": measured_step / r.predicted_step_s if r.predicted_step_s else None,
            "bottleneck": r.predicted_step_s == plan.predicted_step_s,
            "predicted_compute_s": compute[i], "measured_busy_s": busy,
            "compute_ratio": busy / compute[i] if compute[i] else None,
            "predicted_memory_gb": r.predicted_memory_gb, "measured_memory_gb": peak,
            "memory_ratio": peak / r.predicted_memory_gb if peak and r.predicted_memory_gb else None,
        })
    s = profiled.settings
    slowest = max(range(len(rows)), key=lambda i: rows[i]["predicted_step_s"])
    outside = {  # the slowest rank's step beyond its compute: collectives and the loop
        "predicted_s": rows[slowest]["predicted_step_s"] - rows[slowest]["predicted_compute_s"],
        "measured_s": measured_step - max(r["measured_busy_s"] for r in rows),
    }
    return {"cluster": asdict(cluster), "profiled": cluster_to_dict(profiled), "mode": plan.mode,
            "predicted_step_s": plan.predicted_step_s, "outside": outside,
            "measured_step_s": measured_step, "ranks": rows, "plans": plans, "calibration": calibration.as_dict(),
            "profile_s": r0["profile_s"],
            "settings": {"allgather_ms": s.allgather_ms, "reduce_scatter_ms": s.reduce_scatter_ms,
                         "uneven_slope": s.uneven_slope, "overlap": s.overlap},
            "optimizer_ns_per_param": [d.optimizer_ns_per_param for d in profiled.devices]}


def run_benchmark(cfg: Config = Config(), clusters: tuple[ClusterSpec, ...] = CLUSTERS) -> dict[str, Any]:
    start, load = time.perf_counter(), common.load_average()
    results = [measure_cluster(cfg, c) for c in clusters]
    return {"config": asdict(cfg), "environment": common.environment_note(cfg.threads), "emulated": True,
            "clusters": results, "wall_s": time.perf_counter() - start,
            "load_average": common.load_span(load), "cores": os.cpu_count()}


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_report(result: dict[str, Any]) -> None:
    print("EMULATED heterogeneous clusters on CPU: every rank is a CPU process on this machine (gloo), slowed by "
          "sleeping and given an\naccounted memory capacity; none of these figures comes from a GPU. Predicted: the "
          "planner's cost model on the profiled cluster.")
    print(result["environment"])
    rows = []
    within = []
    for c in result["clusters"]:
        spec = c["cluster"]
        if "failed" in c:
            rows.append([f"{spec['name']} {c['mode']}", "-", " ".join(f"x{s:g} {m:g}G" for s, m in spec["emulate"]),
                         *["" for _ in range(11)], "FAILED"])
            continue
        for r in c["ranks"]:
            within += [abs(x - 1) <= 0.10 for x in (r["step_ratio"] if r["bottleneck"] else None, r["memory_ratio"])
                       if x is not None]
            rows.append([
                f"{spec['name']} {c['mode']}" if r["rank"] == 0 else "", r["rank"],
                f"x{spec['emulate'][r['rank']][0]:g} {spec['emulate'][r['rank']][1]:g}G",
                r["batch"], f"{r['micro_batches']}{'' if r['recompute'] else ' kept'}", f"{r['share']:.2f}",
                f"{1e3 * r['predicted_step_s']:.0f}" + ("*" if r["bottleneck"] else ""), f"{1e3 * r['measured_step_s']:.0f}",
                _ratio(r["step_ratio"]), f"{1e3 * r['predicted_compute_s']:.0f}", f"{1e3 * r['measured_busy_s']:.0f}",
                _ratio(r["compute_ratio"]), f"{r['predicted_memory_gb']:.4f}",
                "-" if r["measured_memory_gb"] is None else f"{r['measured_memory_gb']:.4f}", _ratio(r["memory_ratio"]),
            ])
    common.print_table(
        ["cluster", "rank", "emulated", "b", "n", "share", "pred. step ms", "meas. step ms", "meas./pred.",
         "pred. compute ms", "meas. busy ms", "meas./pred.", "pred. peak GiB", "meas. peak GiB", "meas./pred."],
        rows, title="Plan fidelity per rank (EMULATED): predicted vs measured step time, compute and peak memory")
    print("*: the rank the plan predicts slowest (its step is the plan's); every rank measures the same step, as "
          "every step ends in\ncollectives, so only the starred rank's step ratio tests the model; the others wait.")
    for c in result["clusters"]:
        if "failed" in c:
            print(f"  {c['cluster']['name']}: {c['cluster']['note']}; FAILED: {c['failed']}")
            continue
        s = c["settings"]
        print(f"  {c['cluster']['name']}: {c['cluster']['note']}; profiled AG {s['allgather_ms']:.3f} ms, RS "
              f"{s['reduce_scatter_ms']:.3f} ms per layer, uneven slope {s['uneven_slope']}, overlap {s['overlap']}, "
              f"optimizer ns/param {c['optimizer_ns_per_param']}; plan {1e3 * c['predicted_step_s']:.0f} ms, "
              f"measured {1e3 * c['measured_step_s']:.0f} ms ({c['measured_step_s'] / c['predicted_step_s']:.2f}); "
              f"beyond the compute: predicted {1e3 * c['outside']['predicted_s']:.0f} ms, measured "
              f"{1e3 * c['outside']['measured_s']:.0f} ms")
    print(f"profile alone, the fitted plan: within 10%: {sum(within)} of {len(within)} figures (the slowest rank's "
          "step, every rank's peak memory)")
    print_calibration(result)
    most = max(len(c["cluster"]["emulate"]) for c in result["clusters"])
    if most > (result["cores"] or 0):
        print(f"NOTE: up to {most} ranks on {result['cores']} cores: "
              "ranks computing at once compete for cores, which the turn-taking profile does not see.")
    print(f"wall time {result['wall_s']:.0f} s; " + common.load_note(*result["load_average"]))


def print_calibration(result: dict[str, Any]) -> None:
    """Per plan: the measured step against the profile's prediction (BEFORE) and the calibrated one (AFTER)."""
    rows, after, before, under = [], [], [], []
    for c in result["clusters"]:
        if "failed" in c:
            continue
        for p in c["plans"]:
            if not p["fitted"]:
                after.append(abs(p["error_after"]))
                before.append(abs(p["error_before"]))
            if p["memory_ratio_max"] is not None and p["memory_ratio_max"] > 1 + 1e-9:
                under.append(f"{c['cluster']['name']} {p['name']}")
            rows.append([c["cluster"]["name"] if p is c["plans"][0] else "", p["name"], p["label"],
                         f"{1e3 * p['measured_step_s']:.0f}", f"{1e3 * p['predicted_before_s']:.0f}",
                         f"{100 * p['error_before']:+.0f}%", f"{1e3 * p['predicted_after_s']:.0f}",
                         f"{100 * p['error_after']:+.1f}%",
                         "-" if p["memory_ratio_max"] is None else f"{p['memory_ratio_max']:.2f}"])
    common.print_table(
        ["cluster", "plan", "assignment", "meas. step ms", "pred. before ms", "error", "pred. after ms", "error",
         "max meas./pred. peak"], rows,
        title="Prediction before and after calibration (EMULATED; 'fitted on': the plan whose windows were fitted, "
              "the rest are predicted)")
    for c in result["clusters"]:
        if "failed" not in c:
            from cephalo_lightning.planner.cost.calibration import describe
            from cephalo_lightning.planner.schema.calibration_terms import Calibration

            cal = dict(c["calibration"])
            cal["compute_scale"] = tuple(cal["compute_scale"])
            print(f"  {c['cluster']['name']} calibration: {describe(Calibration(**cal))}")
    if after:
        print(f"plans not fitted: {len(after)}; median |error| BEFORE {100 * statistics.median(before):.0f}%, "
              f"AFTER {100 * statistics.median(after):.1f}%; within 10% after: {sum(e <= 0.10 for e in after)} of "
              f"{len(after)} (before: {sum(e <= 0.10 for e in before)})")
    paired = [p for c in result["clusters"] if "failed" not in c for p in c["plans"]
              if not p["fitted"] and "error_after_unbound" in p]
    if paired:
        print(f"the same plans against the per-rank model alone (no shared-host bound, fitted again on the same "
              f"windows): median |error| BEFORE {100 * statistics.median(abs(p['error_before_unbound']) for p in paired):.0f}%, "
              f"AFTER {100 * statistics.median(abs(p['error_after_unbound']) for p in paired):.1f}%; the bound sets "
              f"the calibrated prediction of {sum(p['bound_binds_after'] for p in paired)} of {len(paired)} plans")
    pooled = [abs(p["error_after_pooled"]) for c in result["clusters"] if "failed" not in c for p in c["plans"]
              if not p["fitted"] and "error_after_pooled" in p]
    if pooled:
        print(f"the same plans against a calibration fitted on the fitted plan's windows of every round (paired; the "
              f"calibration above sees its first run only): median |error| AFTER {100 * statistics.median(pooled):.1f}%; "
              f"within 10%: {sum(e <= 0.10 for e in pooled)} of {len(pooled)}")
    other = [p for c in result["clusters"] if "failed" not in c for p in c["plans"] if not p["fitted"]
             and p.get("other_mode")]
    if other:
        print(f"the {len(other)} plans of the other mode than the fitted one, under its grouping: median |error| AFTER "
              f"{100 * statistics.median(abs(p['error_after']) for p in other):.1f}% (the fitted collectives, a uniform "
              f"pass's later gathers at the profiled transfer), "
              f"{100 * statistics.median(abs(p['error_after_profiled_collectives']) for p in other):.1f}% with the "
              f"profile's collectives (paired); within 10%: {sum(abs(p['error_after']) <= 0.10 for p in other)} against "
              f"{sum(abs(p['error_after_profiled_collectives']) <= 0.10 for p in other)}")
    # plan-to-plan: each plan's measured step over the fitted plan's, against the profile's ratio (the
    # common factors of one host cancel), priced by the cost model (a group's passes end together) and
    # by each rank's passes summed; and the calibrated errors of the summed model, fitted again
    ratios = [(p["measured_step_s"] / c["plans"][0]["measured_step_s"],
               p["predicted_before_s"] / c["plans"][0]["predicted_before_s"],
               p["predicted_before_summed_s"] / c["plans"][0]["predicted_before_summed_s"])
              for c in result["clusters"] if "failed" not in c and "predicted_before_summed_s" in c["plans"][0]
              for p in c["plans"][1:]]
    if ratios:
        model = [abs(m / r - 1) for m, r, _ in ratios]
        summed = [abs(m / r - 1) for m, _, r in ratios]
        print(f"plan-to-plan (each plan's measured step / the fitted plan's, against the profile's ratio): median "
              f"|error| {100 * statistics.median(model):.1f}% by the cost model (each pass ending together on a shard "
              f"group), {100 * statistics.median(summed):.1f}% with each rank's passes summed (paired); within 10%: "
              f"{sum(e <= 0.10 for e in model)} against {sum(e <= 0.10 for e in summed)} of {len(ratios)}")
    summed_after = [(abs(p["error_after"]), abs(p["error_after_summed"])) for c in result["clusters"]
                    if "failed" not in c for p in c["plans"] if not p["fitted"] and "error_after_summed" in p]
    if summed_after:
        print(f"the same plans against each rank's passes summed (settings.sync_passes off, fitted again on the same "
              f"windows): median |error| AFTER {100 * statistics.median(s for _, s in summed_after):.1f}% against "
              f"{100 * statistics.median(a for a, _ in summed_after):.1f}%; within 10%: "
              f"{sum(s <= 0.10 for _, s in summed_after)} against {sum(a <= 0.10 for a, _ in summed_after)} of "
              f"{len(summed_after)}")
    again = [abs(e) for c in result["clusters"] if "failed" not in c for e in c["plans"][0].get("remeasured_errors", [])]
    if again:
        print(f"noise floor: the fitted plan itself re-measured in the later rounds, against its calibrated prediction: "
              f"median |error| {100 * statistics.median(again):.1f}%, largest {100 * max(again):.1f}% over "
              f"{len(again)} windows (no model predicts a plan closer than the host repeats it)")
    print("peak memory under-predicted: " + (", ".join(under) if under else "never (every measured peak <= predicted)"))


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clusters", default="A,C,D,E", help="which clusters, e.g. A,C,S1 (all: A,B,C,D,E,F,S1,S2)")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``--quick``: fewer measured steps."""
    chosen = tuple(c for c in CLUSTERS if c.name in args.clusters.split(","))
    return run_benchmark(QUICK if args.quick else Config(), chosen)


BENCHMARK = Benchmark(__doc__, measure, print_report, options)

if __name__ == "__main__":
    raise SystemExit(BENCHMARK.main())
